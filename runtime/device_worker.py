"""One device worker per device: a persistent thread that owns the model and runs each
step's device program (resolve, draft, verify, sample) back to back.

The scheduler actor hands it plans through a queue and never waits for it; results come
back to the Trio loop through ``post`` (``TrioToken.run_sync_soon``). There is no thread
hop per device call: a step costs one queue put and one wake-up of the Trio loop.

With overlap scheduling the queue holds the next step's plan while the current one
runs, so the worker starts step N+1 the moment step N's sampling is done, resolving
N+1's pending work from N's result (:mod:`spectrio.stages.overlap`) on this thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import structlog
from msgspec.structs import replace

from spectrio.core.messages import StepPlan, StepResult
from spectrio.core.timing import StepTiming
from spectrio.stages import draft as draft_stage
from spectrio.stages import sampler as sampler_stage
from spectrio.stages import verify as verify_stage
from spectrio.stages.overlap import resolve_plan
from spectrio.stages.sampling import Sampler
from spectrio.stages.scheduler import StageFailure
from spectrio.stages.workspace import Workspace

log = structlog.get_logger("spectrio.runtime.device")

__all__ = ["DeviceWorker"]


class DeviceWorker:
    def __init__(
        self,
        ws: Workspace,
        sampler: Sampler,
        post: Callable[[StepResult | StageFailure, StepTiming | None], None],
        *,
        rank: int = 0,
    ) -> None:
        self.ws = ws
        self.sampler = sampler
        self._post = post
        self._jobs: queue.SimpleQueue[tuple[StepPlan, StepTiming] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"spectrio-device-{rank}")
        self._rank = rank
        # The stage functions, as attributes so a test can inject a fault into one.
        self.draft = draft_stage.draft
        self.verify = verify_stage.verify
        self.sample = sampler_stage.sample

    def start(self) -> None:
        self._thread.start()

    def submit(self, plan: StepPlan, timing: StepTiming) -> None:
        self._jobs.put((plan, timing))

    def stop(self) -> None:
        """Ask the thread to end after the steps already queued."""
        self._jobs.put(None)

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        ws = self.ws
        prev_plan: StepPlan | None = None
        prev_result: StepResult | None = None
        while True:
            job = self._jobs.get()
            if job is None:
                return
            template, timing = job
            stage = "draft"
            try:
                timing.device_start = time.perf_counter()
                fwd0 = ws.forward_seconds
                plan = resolve_plan(template, prev_plan, prev_result)
                plan = self.draft(ws, plan)
                timing.draft_end = time.perf_counter()
                stage = "verify"
                logits = self.verify(ws, plan)
                timing.verify_end = time.perf_counter()
                stage = "sampler"
                result = self.sample(self.sampler, ws, plan, logits)
                timing.device_end = end = time.perf_counter()
                timing.model_seconds = ws.forward_seconds - fwd0
                timing.num_seqs = len(plan.seqs)
                timing.num_drafts = sum(len(w.drafts) for w in plan.seqs)
                timing.num_rows = sum(
                    len(w.token_ids) + (len(w.drafts) if w.sample else 0) for w in plan.seqs
                )
                result = replace(result, device_seconds=end - timing.device_start)
            except BaseException as exc:  # reported to the Trio side, which fails the engine
                log.exception("device stage failed", stage=stage, rank=self._rank)
                self._post(StageFailure(stage, exc), None)
                return
            prev_plan, prev_result = plan, result
            self._post(result, timing)
