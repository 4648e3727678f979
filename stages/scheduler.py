"""The scheduler actor: admits requests, plans each step, folds results back in."""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog
import trio

from spectrio.core.channels import ChannelReceiver, ChannelSender
from spectrio.core.messages import AbortRequest, Control, NewRequest, StepPlan, StepResult
from spectrio.stages.scheduling import Scheduler, Sequence

_log = structlog.get_logger("spectrio.stages.scheduler")


def _handle(sched: Scheduler, msg: Control, log: structlog.typing.FilteringBoundLogger) -> None:
    if isinstance(msg, NewRequest):
        sched.add(
            Sequence(
                seq_id=msg.seq_id,
                request_id=msg.request_id,
                prompt_ids=list(msg.prompt_ids),
                params=msg.params,
                eos_token_ids=list(msg.eos_token_ids),
                speculative=msg.speculative,
            )
        )
    elif isinstance(msg, AbortRequest):
        seq = sched.abort(msg.seq_id)
        if seq is not None:
            log.info("request aborted", request_id=seq.request_id, reason=msg.reason)


async def run_scheduler(
    sched: Scheduler,
    control: ChannelReceiver[Control],
    plans: ChannelSender[StepPlan],
    feedback: ChannelReceiver[StepResult],
    *,
    release: Callable[[list[int]], None] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run until the control channel closes. One step is in flight at a time; on
    cancellation the in-flight step is abandoned and nothing else is sent.

    ``release`` (the workspace's ``release``) drops an aborted request's device state as
    soon as the abort is handled, before the next step is planned. Without it that state
    goes when the next plan's ``released`` reaches the draft stage. Finished requests'
    state is dropped by the sampler stage, where the finish is decided."""
    log = _log.bind(stage="scheduler", rank=0)

    def drop_aborted() -> None:
        dropped = sched.take_aborted()
        if release is not None and dropped:
            release(dropped)

    task_status.started()
    while True:
        if not sched.has_work():
            try:
                _handle(sched, await control.receive(), log)
            except trio.EndOfChannel:
                return
        while True:
            try:
                _handle(sched, control.receive_nowait(), log)
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        drop_aborted()
        plan = sched.schedule()
        if plan is None:
            continue
        started = time.perf_counter()
        await plans.send(plan)
        result = await feedback.receive()
        sched.update(result, time.perf_counter() - started)
