"""A request's lifecycle, in one place.

::

    WAITING ──> RUNNING ──> FINISHED
       ^  │        │  └───> ABORTED
       │  │        v
       │  └──── PREEMPTED ──> (WAITING again, at the head of the queue)
       └────────────┘

Every state change goes through :func:`advance`, which refuses a move the diagram does
not have. ``FINISHED`` and ``ABORTED`` are final: a request ends exactly once. A
preempted request may still finish (a step that sampled it was in flight when it was
preempted) or be aborted. The scheduler owns the states (:class:`Sequence.state`); the
runtime and the publisher ask it (:meth:`Scheduler.state`)."""

from __future__ import annotations

import enum

__all__ = ["LifecycleError", "RequestState", "advance"]


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # lost its KV blocks; queued to recompute its context
    FINISHED = "finished"
    ABORTED = "aborted"

    @property
    def ended(self) -> bool:
        return self in (RequestState.FINISHED, RequestState.ABORTED)

    @property
    def queued(self) -> bool:
        return self in (RequestState.WAITING, RequestState.PREEMPTED)


_MOVES: dict[RequestState, frozenset[RequestState]] = {
    RequestState.WAITING: frozenset({RequestState.RUNNING, RequestState.ABORTED}),
    RequestState.RUNNING: frozenset(
        {RequestState.PREEMPTED, RequestState.FINISHED, RequestState.ABORTED}
    ),
    RequestState.PREEMPTED: frozenset(
        {RequestState.RUNNING, RequestState.FINISHED, RequestState.ABORTED}
    ),
    RequestState.FINISHED: frozenset(),
    RequestState.ABORTED: frozenset(),
}


class LifecycleError(RuntimeError):
    """A state change the lifecycle does not allow: a bug in the caller."""


def advance(current: RequestState, to: RequestState, what: object = "request") -> RequestState:
    """Return ``to`` if ``current -> to`` is a move of the lifecycle, else raise."""
    if to not in _MOVES[current]:
        raise LifecycleError(f"{what}: cannot go from {current.value} to {to.value}")
    return to
