"""The scheduler actor: admits requests, plans steps ahead of the device, folds results
back in and hands them to the publisher.

It never waits for the device. It plans while fewer than ``max_in_flight`` steps are
in flight (2 with overlap: the device worker holds the next plan while it runs the
current one), and reacts to one event at a time: a request, an abort, a step's result,
a device failure, or the control channel's end."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import msgspec
import structlog
import trio

from spectrio.core.channels import ChannelSender
from spectrio.core.messages import AbortRequest, NewRequest, StepPlan, StepResult
from spectrio.core.timing import StepTiming
from spectrio.errors import EngineDead
from spectrio.stages.scheduling import Scheduler, Sequence

_log = structlog.get_logger("spectrio.stages.scheduler")

__all__ = ["ControlClosed", "Resume", "StageFailure", "run_scheduler"]


class ControlClosed(msgspec.Struct, tag=True):
    """The runtime closed its control channel: finish the steps in flight, then end."""


class Resume(msgspec.Struct, tag=True):
    """The runtime was resumed after a pause: plan again (wakes the actor's wait)."""


@dataclasses.dataclass(frozen=True)
class StageFailure:
    """The device worker's stage ``stage`` raised ``error``; the worker has stopped."""

    stage: str
    error: BaseException


def _handle(
    sched: Scheduler, msg: NewRequest | AbortRequest, log: structlog.typing.FilteringBoundLogger
) -> None:
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
    else:
        seq = sched.abort(msg.seq_id)  # usually done already, synchronously, by the runtime
        if seq is not None:
            log.info("request aborted", request_id=seq.request_id, reason=msg.reason)


async def run_scheduler(
    sched: Scheduler,
    events: trio.MemoryReceiveChannel[object],
    submit: Callable[[StepPlan, StepTiming], None],
    outbox: ChannelSender[StepResult],
    *,
    on_idle_check: Callable[[], None] = lambda: None,
    on_result: Callable[[StepResult, StepTiming | None], None] = lambda r, t: None,
    paused: Callable[[], bool] = lambda: False,
    rank: int = 0,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run until the control channel has closed (a :class:`ControlClosed` event) and every
    step in flight has returned; then close ``outbox``, so the publisher ends too.

    ``events`` carries :class:`NewRequest`, :class:`AbortRequest`, ``(StepResult,
    StepTiming)`` pairs and :class:`StageFailure` from the device worker,
    :class:`ControlClosed`, and :class:`Resume`. While ``paused()`` is true no step is
    planned; requests, aborts and results are still taken in (a resume sends
    :class:`Resume`, so the actor plans again). A device failure raises
    :class:`EngineDead`."""
    log = _log.bind(stage="scheduler", rank=rank)
    task_status.started()
    closing = False
    to_publish: StepResult | None = None
    try:
        while True:
            while not closing and not paused() and sched.can_schedule():
                t0 = time.perf_counter()
                plan = sched.schedule()
                if plan is None:
                    break
                timing = StepTiming(
                    step=plan.step,
                    num_seqs=len(plan.seqs),
                    num_rows=0,
                    num_drafts=0,
                    plan_start=t0,
                    planned_at=time.perf_counter(),
                )
                submit(plan, timing)
            if to_publish is not None:  # after planning, so the device is fed first
                await outbox.send(to_publish)
                to_publish = None
            if closing and sched.num_in_flight == 0:
                return
            on_idle_check()
            ev = await events.receive()
            if isinstance(ev, tuple):
                result, timing = ev
                assert isinstance(result, StepResult)
                to_publish = sched.update(result)
                on_result(to_publish, timing)
            elif isinstance(ev, (NewRequest, AbortRequest)):
                if not closing:
                    _handle(sched, ev, log)
            elif isinstance(ev, ControlClosed):
                closing = True
            elif isinstance(ev, Resume):
                pass  # the loop plans again at its top
            elif isinstance(ev, StageFailure):
                raise EngineDead(ev.stage, ev.error) from ev.error
            else:
                raise TypeError(f"scheduler: unexpected event {ev!r}")
    finally:
        outbox.close()
