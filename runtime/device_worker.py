"""One device worker per device: a persistent thread that owns the model and runs each
step's device program (resolve, draft, verify, sample) back to back.

The scheduler actor hands it plans through a queue and never waits for it; the worker
puts each result into a second queue and goes straight on to the next plan. Waking the
Trio loop is left to a pump task (:meth:`next_result` in a Trio worker thread), off the
device's critical path: waking Trio from this thread (``run_sync_soon``) costs the time
to get the GIL back after the wake-up write, milliseconds on a busy host, during which
the device would sit idle (docs/architecture.md).

With overlap scheduling the queue holds the next step's plan while the current one
runs, so the worker starts step N+1 the moment step N's sampling is done, resolving
N+1's pending work from N's result (:mod:`spectrio.stages.device.overlap`) on this thread.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING

import structlog
from msgspec.structs import replace

from spectrio.core.messages import StepPlan, StepResult
from spectrio.core.timing import DeviceTiming
from spectrio.models.ops.paddle_setup import use_configured_threads
from spectrio.stages.device import draft as draft_stage
from spectrio.stages.device import sampler as sampler_stage
from spectrio.stages.device import verify as verify_stage
from spectrio.stages.device.overlap import resolve_plan
from spectrio.stages.device.sampler import Sampler
from spectrio.stages.device.workspace import Workspace
from spectrio.stages.planning.scheduler_actor import StageFailure

if TYPE_CHECKING:
    from spectrio.runtime.tp import TPGroup

log = structlog.get_logger("spectrio.runtime.device")

__all__ = ["DeviceWorker"]


class DeviceWorker:
    def __init__(
        self,
        ws: Workspace,
        sampler: Sampler,
        *,
        rank: int = 0,
        group: TPGroup | None = None,
    ) -> None:
        self.ws = ws
        self.sampler = sampler
        self._jobs: queue.SimpleQueue[StepPlan | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[StepResult | StageFailure | None] = queue.SimpleQueue()
        # With a tensor-parallel group the thread may be stuck inside a collective when a
        # peer dies; as a daemon it cannot keep the process alive (the runtime fails every
        # request first and stops waiting for it after a short time).
        self._thread = threading.Thread(
            target=self._run, name=f"spectrio-device-{rank}", daemon=group is not None
        )
        self._rank = rank
        self._group = group
        # The stage functions, as attributes so a test can inject a fault into one.
        self.draft = draft_stage.draft
        self.verify = verify_stage.verify
        self.sample = sampler_stage.sample

    def start(self) -> None:
        self._thread.start()

    def submit(self, plan: StepPlan) -> None:
        self._jobs.put(plan)

    def stop(self) -> None:
        """Ask the thread to end after the steps already queued."""
        self._jobs.put(None)

    def next_result(self) -> StepResult | StageFailure | None:
        """Block until the next result (None once the worker has ended). For a pump thread."""
        return self._results.get()

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _next_job(self) -> StepPlan | None:
        """The next job; in a tensor-parallel group, a keep-alive goes to the followers
        every :data:`KEEPALIVE_S` while none comes (a dead peer shows up there)."""
        link = self._group.link if self._group is not None else None
        if link is None:
            return self._jobs.get()
        from spectrio.runtime.tp import KEEPALIVE_S

        while True:
            try:
                return self._jobs.get(timeout=KEEPALIVE_S)
            except queue.Empty:
                link.send_keepalive()

    def _run(self) -> None:
        try:
            use_configured_threads()  # OpenMP's thread count is per thread
            self._loop()
        finally:
            self._results.put(None)

    def _loop(self) -> None:
        ws = self.ws
        prev_plan: StepPlan | None = None
        prev_result: StepResult | None = None
        link = self._group.link if self._group is not None else None
        last_end: float | None = None
        while True:
            stage = "tp-link"
            try:
                job = self._next_job()
                if job is None:
                    if link is not None:
                        link.send_stop()
                    return
            except BaseException as exc:
                self._fail(stage, exc)
                return
            template = job
            stage = "draft"
            try:
                with ws.model.step_lock:
                    start = time.perf_counter()
                    fwd0 = ws.forward_seconds
                    gram0 = ws.grammar_seconds
                    plan = resolve_plan(template, prev_plan, prev_result)
                    if link is not None:  # one decision: every rank runs this very plan
                        stage = "tp-link"
                        link.send_plan(plan)
                        stage = "draft"
                    plan = self.draft(ws, plan)
                    draft_end = time.perf_counter()
                    stage = "verify"
                    verified = self.verify(ws, plan)
                    verify_end = time.perf_counter()
                    stage = "sampler"
                    result = self.sample(self.sampler, ws, plan, verified)
                    stage = "end of step"
                    ws.end_step(plan, result)
                    end = time.perf_counter()
                device = DeviceTiming(
                    start=start,
                    draft_end=draft_end,
                    verify_end=verify_end,
                    end=end,
                    model_seconds=ws.forward_seconds - fwd0,
                    grammar_seconds=ws.grammar_seconds - gram0,
                    idle_seconds=0.0 if last_end is None else max(0.0, start - last_end),
                    num_seqs=len(plan.seqs),
                    num_drafts=sum(len(w.drafts) for w in plan.seqs),
                    num_rows=sum(
                        len(w.token_ids) + (len(w.drafts) if w.sample else 0) for w in plan.seqs
                    ),
                )
                last_end = end
                result = replace(
                    result, device=device, draft_rows=plan.draft_rows + verified.draft_rows
                )
            except BaseException as exc:  # reported to the Trio side, which fails the engine
                self._fail(stage, exc)
                return
            prev_plan, prev_result = plan, result
            self._results.put(result)

    def _fail(self, stage: str, exc: BaseException) -> None:
        """Report a failed stage to the Trio side, which fails the engine. In a group, a
        follower that died is named as the failed stage (``"rank 1"``)."""
        if self._group is not None:
            dead = self._group.blame()
            if dead is not None:
                stage = f"rank {dead[0]}"
                exc = RuntimeError(f"{dead[1]} ({type(exc).__name__}: {exc})")
        log.exception("device stage failed", stage=stage, rank=self._rank)
        self._results.put(StageFailure(stage, exc))
