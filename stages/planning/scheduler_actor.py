"""The scheduler actor: admits requests, plans steps ahead of the device, folds results
back in and hands them to the publisher.

It never waits for the device. It plans while fewer than ``max_in_flight`` steps are
in flight (2 with overlap: the device worker holds the next plan while it runs the
current one), and reacts to one event at a time: a request, an abort, a step's result,
a device failure, or the control channel's end.

:class:`SchedulerActor` is the :class:`Scheduler`'s one owner: nothing else calls it.
The runtime talks to the actor only: requests and aborts are messages on one control
channel, taken in the order they were sent (so an abort always follows its request), and
applied by :meth:`SchedulerActor.handle` (from then on no token of an aborted request is
published; the runtime learns of it through ``on_aborted``), and what the runtime shows
its users is the actor's read-only :meth:`SchedulerActor.view`."""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import msgspec
import structlog
import trio

from spectrio.core.acceptance import Acceptance
from spectrio.core.channels import ChannelSender
from spectrio.core.messages import AbortRequest, NewRequest, StepPlan, StepResult
from spectrio.core.timing import StepTiming
from spectrio.errors import EngineDead
from spectrio.stages.planning.scheduler import Scheduler, Sequence

_log = structlog.get_logger("spectrio.stages.planning.scheduler_actor")

__all__ = [
    "ControlClosed",
    "Resume",
    "SchedulerActor",
    "SchedulerView",
    "StageFailure",
    "run_scheduler",
]


class ControlClosed(msgspec.Struct, tag=True):
    """The runtime closed its control channel: finish the steps in flight, then end."""


class Resume(msgspec.Struct, tag=True):
    """Plan again (wakes the actor's wait): the runtime was resumed after a pause, or
    handed the actor an abort that the next plan reports."""


@dataclasses.dataclass(frozen=True)
class StageFailure:
    """The device worker's stage ``stage`` raised ``error``; the worker has stopped."""

    stage: str
    error: BaseException


@dataclasses.dataclass(frozen=True)
class SchedulerView:
    """What the scheduler's state looks like now, for the runtime's stats (a copy)."""

    running: int
    waiting: int
    num_in_flight: int
    has_work: bool
    num_preemptions: int
    finished: dict[str, int]  # requests ended, by finish reason
    steps_by_k: dict[int, int]
    acceptance: Acceptance  # every live request's drafts, counted where results fold in


class SchedulerActor:
    """Owns a :class:`Scheduler`. Lives on the Trio thread; :func:`run_scheduler` is its
    loop, and :meth:`handle` is where every request and abort is applied."""

    def __init__(self, scheduler: Scheduler, *, rank: int = 0) -> None:
        self.scheduler = scheduler  # read it only in tests and research tools
        self._log = _log.bind(stage="scheduler", rank=rank)

    def handle(self, msg: NewRequest | AbortRequest) -> Acceptance | None:
        """Admit a request, or abort one now (its blocks are freed, results in flight for
        it are dropped, and the next plan reports it). An abort returns the request's
        acceptance over its life; None if it had already ended."""
        if isinstance(msg, NewRequest):
            self.scheduler.add(Sequence(msg))
            return None
        return self.abort(msg)

    def abort(self, msg: AbortRequest) -> Acceptance | None:
        """:meth:`handle` for an abort, returning the request's acceptance over its life
        (a copy of the scheduler's count; the stream's final delta carries it)."""
        seq = self.scheduler.abort(msg.seq_id)
        if seq is None:
            return None
        self._log.info("request aborted", request_id=seq.request_id, reason=msg.reason)
        return seq.acceptance.copy()

    def published(self, result: StepResult) -> StepResult:
        """``result`` without requests aborted since it was folded in (the publisher's
        last look before publishing)."""
        return self.scheduler.published(result)

    def view(self) -> SchedulerView:
        sched = self.scheduler
        return SchedulerView(
            running=len(sched.running),
            waiting=len(sched.waiting),
            num_in_flight=sched.num_in_flight,
            has_work=sched.has_work(),
            num_preemptions=sched.num_preemptions,
            finished=dict(sched.finished_by_reason),
            steps_by_k=dict(sorted(sched.steps_by_k.items())),
            acceptance=copy.deepcopy(sched.acceptance),
        )

    @property
    def num_in_flight(self) -> int:
        return self.scheduler.num_in_flight

    def export_timings(self) -> dict[str, Any]:
        """The adaptive policy's measured step times (for the timing cache)."""
        return self.scheduler.policy.export_timings()

    def import_timings(self, kept: dict[str, Any]) -> None:
        """Start the adaptive policy from an earlier run's step times; ValueError when
        they are malformed."""
        self.scheduler.policy.import_timings(kept)


async def run_scheduler(
    actor: SchedulerActor,
    events: trio.MemoryReceiveChannel[object],
    submit: Callable[[StepPlan], None],
    outbox: ChannelSender[StepResult],
    *,
    on_idle_check: Callable[[], None] = lambda: None,
    on_result: Callable[[StepResult, StepTiming], None] = lambda r, t: None,
    on_aborted: Callable[[int, Acceptance | None], None] = lambda s, a: None,
    paused: Callable[[], bool] = lambda: False,
    rank: int = 0,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run until the control channel has closed (a :class:`ControlClosed` event) and every
    step in flight has returned; then close ``outbox``, so the publisher ends too.

    ``events`` carries :class:`NewRequest`, :class:`AbortRequest`, :class:`StepResult`
    and :class:`StageFailure` from the device worker,
    :class:`ControlClosed`, and :class:`Resume`; an abort is applied as it comes, and
    ``on_aborted`` gets its sequence id and the request's acceptance over its life (None:
    it had already ended). While ``paused()`` is true no step is
    planned; requests, aborts and results are still taken in (a resume sends
    :class:`Resume`, so the actor plans again). A device failure raises
    :class:`EngineDead`. ``on_result`` gets each folded step with its timeline (the plan's
    times, kept here, and the device's record from the result)."""
    sched = actor.scheduler
    task_status.started()
    closing = False
    to_publish: StepResult | None = None
    planned: dict[int, tuple[float, float]] = {}  # step -> (plan start, planned at)
    try:
        while True:
            while not closing and not paused() and sched.can_schedule():
                t0 = time.perf_counter()
                plan = sched.schedule()
                if plan is None:
                    break
                planned[plan.step] = (t0, time.perf_counter())
                submit(plan)
            if to_publish is not None:  # after planning, so the device is fed first
                await outbox.send(to_publish)
                to_publish = None
            if closing and sched.num_in_flight == 0:
                return
            on_idle_check()
            ev = await events.receive()
            if isinstance(ev, StepResult):
                to_publish = sched.update(ev)
                on_result(
                    to_publish, StepTiming.assemble(ev.step, *planned.pop(ev.step), ev.device)
                )
            elif isinstance(ev, NewRequest):
                if not closing:
                    actor.handle(ev)
            elif isinstance(ev, AbortRequest):
                on_aborted(ev.seq_id, actor.abort(ev))
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
