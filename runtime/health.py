"""Whether a runtime's requests can progress: :class:`Health` and :func:`judge_health`.

Pure: no Trio, no I/O, no clock. :meth:`spectrio.runtime.api.Runtime.health` gathers the
inputs (times from ``time.monotonic()``) and the HTTP front's ``/health``, the Prometheus
gauge ``spectrio_healthy`` and the wire server read the verdict.

The rules, first match wins:

1. a dead engine is not healthy (``cause="engine_dead"``);
2. a runtime whose stages have ended is not healthy (``cause="stopped"``);
3. a publisher that has awaited one record sink for longer than ``stall_timeout_s`` is
   not healthy (``cause="sink_blocked"``; the reason names the sink and the seconds);
4. with open requests and not paused, no step completed for longer than
   ``stall_timeout_s`` is not healthy (``cause="stalled"``; the reason says how long and
   how many requests). The time is measured from the later of the last completed step
   and ``active_since`` (when the runtime went from no open request to some, or was
   resumed), so a server that was idle and just got a request is not unhealthy;
5. otherwise healthy.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["Health", "HealthCause", "judge_health"]

HealthCause = Literal["engine_dead", "stopped", "sink_blocked", "stalled"]
"""Why a runtime is unhealthy, as a machine-readable code."""


class Health(msgspec.Struct, kw_only=True, frozen=True):
    """A runtime's health at one moment.

    ``ok`` is False exactly when ``reason`` (a sentence for people) and ``cause`` (its
    code) are set. ``open_requests`` counts the requests the runtime accepted whose
    final result it has not produced yet (every front: HTTP, wire, embedding).
    ``seconds_since_step`` is None before the first completed step. ``blocked_sink``
    and ``blocked_s`` name the record sink the publisher is awaiting now and for how
    long (None when it awaits none), whether or not that is over the threshold."""

    ok: bool
    reason: str | None = None
    cause: HealthCause | None = None
    open_requests: int = 0
    seconds_since_step: float | None = None
    blocked_sink: str | None = None
    blocked_s: float | None = None
    paused: bool = False
    stall_timeout_s: float


def judge_health(
    *,
    now: float,
    stall_timeout_s: float,
    open_requests: int,
    last_step_at: float | None = None,
    active_since: float | None = None,
    sink: str | None = None,
    sink_since: float | None = None,
    dead: str | None = None,
    stopped: bool = False,
    paused: bool = False,
) -> Health:
    """The :class:`Health` these facts make, by the rules in the module docstring.

    All times are seconds on one monotonic clock. ``last_step_at``: when the last step
    completed (None: none yet). ``active_since``: when the runtime last went from no
    open request to some, or resumed after a pause (None: never). ``sink`` and
    ``sink_since``: the record sink the publisher is awaiting and since when (None:
    none). ``dead``: the engine's death as text (None: alive). ``stopped``: the
    pipeline's stages have ended. ``paused``: :meth:`Runtime.pause` holds the steps,
    which is not a stall."""
    since_step = None if last_step_at is None else max(0.0, now - last_step_at)
    blocked_s = None if sink is None or sink_since is None else max(0.0, now - sink_since)

    def verdict(cause: HealthCause | None = None, reason: str | None = None) -> Health:
        return Health(
            ok=cause is None,
            reason=reason,
            cause=cause,
            open_requests=open_requests,
            seconds_since_step=since_step,
            blocked_sink=sink if blocked_s is not None else None,
            blocked_s=blocked_s,
            paused=paused,
            stall_timeout_s=stall_timeout_s,
        )

    if dead is not None:
        return verdict("engine_dead", f"the engine is dead: {dead}")
    if stopped:
        return verdict("stopped", "the runtime has stopped: its stages have ended")
    if blocked_s is not None and blocked_s > stall_timeout_s:
        return verdict(
            "sink_blocked",
            f"the publisher has been awaiting record sink {sink!r} for {blocked_s:.1f} s "
            f"(over {stall_timeout_s:g} s); no step can be published",
        )
    if open_requests > 0 and not paused:
        marks = [t for t in (last_step_at, active_since) if t is not None]
        if marks:
            quiet = max(0.0, now - max(marks))
            if quiet > stall_timeout_s:
                return verdict(
                    "stalled",
                    f"no step completed for {quiet:.1f} s (over {stall_timeout_s:g} s) "
                    f"with {open_requests} open request{'s' if open_requests != 1 else ''}",
                )
    return verdict()
