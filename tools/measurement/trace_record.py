"""Recording a run into a trace: :class:`ResultBuilder` turns one request's deltas into
its :class:`~spectrio.tools.measurement.trace_format.TraceResult`, and
:class:`TraceRecorder` writes every request a server accepts (``serve --record``)."""

from __future__ import annotations

from typing import Any, Protocol

from spectrio.core.params import SamplingParams
from spectrio.tools.measurement.trace_format import TraceRequest, TraceResult, TraceWriter

__all__ = ["DeltaLike", "ResultBuilder", "TraceRecorder"]


class DeltaLike(Protocol):
    """What :class:`ResultBuilder` reads: a runtime ``Delta`` or a wire ``Chunk``."""

    @property
    def token_ids(self) -> list[int]: ...
    @property
    def text(self) -> str: ...
    @property
    def finish_reason(self) -> str | None: ...


class ResultBuilder:
    """Accumulates one request's deltas (or wire chunks) with their arrival times into
    a :class:`TraceResult`. ``start`` is when the request was submitted, on the same
    clock as the times given to :meth:`add`."""

    def __init__(self, request_id: str, start: float) -> None:
        self.request_id = request_id
        self.start = start
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.error: str | None = None
        self._times: list[float] = []
        self._tokens: list[int] = []
        self._drafts: list[int] = []
        self._accepted: list[int] = []
        self._has_drafts = True
        self._end: float | None = None

    def add(self, delta: DeltaLike, now: float) -> None:
        if delta.token_ids:
            self.token_ids += delta.token_ids
            self._times.append(now)
            self._tokens.append(len(delta.token_ids))
            drafts = getattr(delta, "num_drafts", None)
            if drafts is None:
                self._has_drafts = False
            else:
                self._drafts.append(int(drafts))
                self._accepted.append(int(getattr(delta, "num_accepted", 0)))
        self.text += delta.text
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self._end = now

    def fail(self, error: str, now: float) -> None:
        """The request was refused or failed: finish reason ``"error"``."""
        self.finish_reason = "error"
        self.error = error
        self._end = now

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def result(self) -> TraceResult:
        times = self._times
        return TraceResult(
            request_id=self.request_id,
            token_ids=list(self.token_ids),
            text=self.text,
            finish_reason=self.finish_reason,
            ttft_s=round(times[0] - self.start, 6) if times else None,
            itl_s=[round(b - a, 6) for a, b in zip(times, times[1:], strict=False)],
            step_tokens=list(self._tokens),
            step_drafts=list(self._drafts) if self._has_drafts else [],
            step_accepted=list(self._accepted) if self._has_drafts else [],
            e2e_s=round(self._end - self.start, 6) if self._end is not None else None,
            error=self.error,
        )


class TraceRecorder:
    """Request hooks (:class:`spectrio.runtime.metrics.RequestHooks`) that append every
    request a server accepts, with its result, to a :class:`TraceWriter` when the request
    finishes. Arrival offsets count from the recorder's creation; a trace continued with
    ``append=True`` goes on after its last arrival. A refused request is not recorded."""

    def __init__(self, writer: TraceWriter, now: float) -> None:
        self.writer = writer
        self._t0 = now - writer.last_arrival_s
        self._open: dict[str, tuple[TraceRequest, ResultBuilder]] = {}

    def on_start(self, request_id: str, prompt: Any, params: Any, now: float) -> None:
        ids = [int(t) for t in prompt] if not isinstance(prompt, str) else []
        req = TraceRequest(
            request_id=request_id,
            arrival_s=round(now - self._t0, 6),
            prompt_ids=ids,
            prompt_text=prompt if isinstance(prompt, str) else None,
            params=params if params is not None else SamplingParams(),
        )
        self._open[request_id] = (req, ResultBuilder(request_id, now))

    def on_delta(self, request_id: str, delta: Any, now: float) -> None:
        entry = self._open.get(request_id)
        if entry is None:
            return
        req, builder = entry
        builder.add(delta, now)
        if builder.finished:
            del self._open[request_id]
            rid = self.writer.unique_id(request_id)
            self.writer.add_request(
                rid,
                req.prompt_ids,
                req.params,
                arrival_s=req.arrival_s,
                prompt_text=req.prompt_text,
            )
            result = builder.result()
            result.request_id = rid
            self.writer.add_result(result)

    def on_refused(self, request_id: str, error: Exception, now: float) -> None:
        self._open.pop(request_id, None)
