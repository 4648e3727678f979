"""Per-step timings of the pipeline, for benchmarks and metrics.

Every field is a ``time.perf_counter()`` reading in seconds, taken where the work
happens. A step's phases:

* ``schedule``: the scheduler planning it (``planned_at - plan_start``), off the device;
* ``draft``, ``verify``, ``sample``: the device worker's work for it, back to back
  (``device_start`` .. ``draft_end`` .. ``verify_end`` .. ``device_end``);
* ``publish``: packing its record and handing it to sinks, off the device.

The device worker is *busy* from ``device_start`` to ``device_end``; the gap between one
step's ``device_end`` and the next step's ``device_start`` is device idle time (a
pipeline *bubble* when work was waiting)."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

__all__ = ["DeviceTiming", "StepTiming", "device_summary"]


class DeviceTiming(msgspec.Struct, kw_only=True):
    """The device worker's record of one step. Its thread alone writes it, and it reaches
    the Trio side inside the step's result."""

    start: float = 0.0
    draft_end: float = 0.0
    verify_end: float = 0.0
    end: float = 0.0
    model_seconds: float = 0.0  # inside the model's forward calls (draft and verify)
    grammar_seconds: float = 0.0  # in structured output's grammar work (state, drafts, masks)
    idle_seconds: float = 0.0  # how long the worker waited for this step after its last one
    num_seqs: int = 0
    num_rows: int = 0
    num_drafts: int = 0

    @property
    def seconds(self) -> float:
        """The worker's time on the step (draft, verify and sample)."""
        return self.end - self.start


class StepTiming(msgspec.Struct, kw_only=True):
    """One step's timeline, put together by the scheduler actor when it folds the step in
    (its plan times and the device's record, :meth:`assemble`); the publisher adds its
    own two readings."""

    step: int
    num_seqs: int  # sequences in the step
    num_rows: int  # target rows verified (prefill tokens + 1 + drafts per sampling seq)
    num_drafts: int  # drafts proposed, all sequences
    plan_start: float = 0.0
    planned_at: float = 0.0
    device_start: float = 0.0
    draft_end: float = 0.0
    verify_end: float = 0.0
    device_end: float = 0.0
    model_seconds: float = 0.0  # inside the model's forward calls (draft and verify)
    grammar_seconds: float = 0.0  # in structured output's grammar work (state, drafts, masks)
    publish_start: float = 0.0
    publish_end: float = 0.0

    @classmethod
    def assemble(
        cls, step: int, plan_start: float, planned_at: float, device: DeviceTiming
    ) -> StepTiming:
        return cls(
            step=step,
            num_seqs=device.num_seqs,
            num_rows=device.num_rows,
            num_drafts=device.num_drafts,
            plan_start=plan_start,
            planned_at=planned_at,
            device_start=device.start,
            draft_end=device.draft_end,
            verify_end=device.verify_end,
            device_end=device.end,
            model_seconds=device.model_seconds,
            grammar_seconds=device.grammar_seconds,
        )

    @property
    def schedule(self) -> float:
        return self.planned_at - self.plan_start

    @property
    def draft(self) -> float:
        return self.draft_end - self.device_start

    @property
    def verify(self) -> float:
        return self.verify_end - self.draft_end

    @property
    def sample(self) -> float:
        return self.device_end - self.verify_end

    @property
    def publish(self) -> float:
        return self.publish_end - self.publish_start

    @property
    def device(self) -> float:
        return self.device_end - self.device_start


def device_summary(
    timings: list[StepTiming], wall: float, pauses: Sequence[tuple[float, float]] = ()
) -> dict[str, float]:
    """``efficiency`` (device busy time over ``wall``), ``bubble`` (device idle between
    consecutive steps, over ``wall``), ``model_share`` (time in model forwards over
    ``wall``) and the mean per-step breakdown in milliseconds (``schedule``, ``draft``,
    ``verify``, ``sample``, ``publish``, ``idle``). ``timings`` are one run's steps in
    step order. ``pauses`` are ``(start, end)`` spans the runtime was paused on purpose
    (``Runtime.pause``); ``wall`` excludes them, and so do the gaps."""
    if not timings or wall <= 0:
        return {}
    busy = sum(t.device for t in timings)

    def paused_within(start: float, end: float) -> float:
        return sum(max(0.0, min(end, p1) - max(start, p0)) for p0, p1 in pauses)

    gaps = [
        max(0.0, b.device_start - a.device_end - paused_within(a.device_end, b.device_start))
        for a, b in zip(timings, timings[1:], strict=False)
    ]
    n = len(timings)
    ms = 1000.0 / n
    return {
        "efficiency": busy / wall,
        "bubble": sum(gaps) / wall,
        "model_share": sum(t.model_seconds for t in timings) / wall,
        "steps": float(n),
        "schedule_ms": sum(t.schedule for t in timings) * ms,
        "draft_ms": sum(t.draft for t in timings) * ms,
        "verify_ms": sum(t.verify for t in timings) * ms,
        "sample_ms": sum(t.sample for t in timings) * ms,
        "publish_ms": sum(t.publish for t in timings) * ms,
        "idle_ms": sum(gaps) * 1000.0 / max(1, n - 1),
    }
