"""Request traces: the format (``docs/trace.md``), its reader and its writer.

A trace is JSON Lines. The first line is a :class:`Header`; then, in any interleaving,
:class:`TraceRequest` lines (one per request, in arrival order), :class:`TraceResult`
lines (the run's output for a request, written when it finished) and at most one
trailing :class:`RunSummary` line. Every line is an object whose ``kind`` field names
its type. JSON Lines, so that ``serve --record`` can append one line per event and a
trace cut short by a crash is still readable up to its last complete line.

The API other tools use (``bench --save-trace`` is about ten lines with it; the builder is
:mod:`~spectrio.tools.measurement.trace_record`'s, the summary
:mod:`~spectrio.tools.measurement.trace_summary`'s)::

    with TraceWriter(path, source="bench", model=cfg.model, runtime=runtime_fields(cfg)) as w:
        w.add_request("r0", prompt_ids, params, arrival_s=0.0)
        builder = ResultBuilder("r0", start=time.perf_counter())
        async for delta in rt.generate(prompt_ids, params, request_id="r0"):
            builder.add(delta, time.perf_counter())
        w.add_result(builder.result())
        w.add_summary(wall_s, summarize(...))   # optional

Nothing here imports Paddle or Trio, so reading and diffing traces is cheap.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any, Final

import msgspec

from spectrio.core.draft_methods import DRAFT_METHODS
from spectrio.core.params import SamplingParams
from spectrio.errors import SpectrioError

__all__ = [
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "Header",
    "RunSummary",
    "Trace",
    "TraceError",
    "TraceRequest",
    "TraceResult",
    "TraceWriter",
    "config_from_fields",
    "parse_lines",
    "read_trace",
    "runtime_fields",
    "write_trace",
]

TRACE_FORMAT: Final = "spectrio-trace"
TRACE_VERSION: Final = "1.0"
"""``major.minor``. A reader accepts every minor of its major: a minor version only adds
optional fields, which older readers ignore. A new major is refused."""


class TraceError(SpectrioError, ValueError):
    """A file that is not a readable trace; the message names the file and line."""


class Header(msgspec.Struct, tag="header", tag_field="kind", kw_only=True):
    """First line: what the file is and what produced it."""

    format: str = TRACE_FORMAT
    version: str = TRACE_VERSION
    created: str = ""  # ISO 8601 UTC time the file was started
    source: str = ""  # "import" | "serve" | "replay" | "bench" | ...
    model: str | None = None  # whose tokenizer made prompt_ids; with results, their model
    runtime: dict[str, Any] | None = None  # RuntimeConfig fields of that run (runtime_fields)


class TraceRequest(msgspec.Struct, tag="request", tag_field="kind", kw_only=True):
    """One request as it arrived."""

    request_id: str
    arrival_s: float  # seconds since the start of the trace
    prompt_ids: list[int]  # what the model saw (replay sends these, never the text)
    prompt_text: str | None = None  # the text, when the request came as text
    # every field is written, so a change of a default never changes a replay
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)


class TraceResult(msgspec.Struct, tag="result", tag_field="kind", kw_only=True):
    """What a run produced for one request. Chunk ``i`` is one step's output for it."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    ttft_s: float | None = None  # arrival (submission) to the first chunk with tokens
    itl_s: list[float] = []  # gap between consecutive chunks with tokens (len: chunks - 1)
    step_tokens: list[int] = []  # tokens in each chunk
    step_drafts: list[int] = []  # drafts proposed in each chunk's step (empty: unknown)
    step_accepted: list[int] = []  # drafts accepted in each chunk's step
    e2e_s: float | None = None  # arrival to the final chunk
    error: str | None = None  # why the request was refused (finish_reason "error")


class RunSummary(msgspec.Struct, tag="summary", tag_field="kind", kw_only=True):
    """Optional last line: the run's wall time and its summary (:func:`summarize`)."""

    wall_s: float
    stats: dict[str, Any] = {}


Line = Header | TraceRequest | TraceResult | RunSummary
_decoder: Final = msgspec.json.Decoder(Line)
_encoder: Final = msgspec.json.Encoder()


@dataclasses.dataclass
class Trace:
    """A parsed trace: requests in file order, results by request id."""

    header: Header
    requests: list[TraceRequest]
    results: dict[str, TraceResult]
    summary: RunSummary | None = None

    def request(self, request_id: str) -> TraceRequest:
        for r in self.requests:
            if r.request_id == request_id:
                return r
        raise KeyError(request_id)

    def ordered_results(self) -> list[TraceResult]:
        """Results in request order (requests without a result are skipped)."""
        return [self.results[r.request_id] for r in self.requests if r.request_id in self.results]


def _check_header(header: Header, where: str) -> None:
    if header.format != TRACE_FORMAT:
        raise TraceError(f"{where}: format {header.format!r} is not {TRACE_FORMAT!r}")
    major = header.version.split(".", 1)[0]
    if major != TRACE_VERSION.split(".", 1)[0]:
        raise TraceError(
            f"{where}: trace version {header.version} is not readable by this version "
            f"(reads {TRACE_VERSION.split('.', 1)[0]}.x)"
        )


def parse_lines(lines: Iterable[str | bytes], name: str = "<trace>") -> Trace:
    """Parse trace lines (see :func:`read_trace`)."""
    header: Header | None = None
    requests: list[TraceRequest] = []
    seen: set[str] = set()
    results: dict[str, TraceResult] = {}
    summary: RunSummary | None = None
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            line = _decoder.decode(raw)
        except msgspec.DecodeError as exc:  # ValidationError included
            raise TraceError(f"{where}: {exc}") from None
        if header is None:
            if not isinstance(line, Header):
                raise TraceError(f"{where}: the first line must be the header (kind 'header')")
            _check_header(line, where)
            header = line
        elif isinstance(line, Header):
            raise TraceError(f"{where}: a second header")
        elif isinstance(line, TraceRequest):
            if line.request_id in seen:
                raise TraceError(f"{where}: request_id {line.request_id!r} appears twice")
            if not (math.isfinite(line.arrival_s) and line.arrival_s >= 0):
                raise TraceError(f"{where}: arrival_s must be a finite number >= 0")
            seen.add(line.request_id)
            requests.append(line)
        elif isinstance(line, TraceResult):
            if line.request_id not in seen:
                raise TraceError(f"{where}: result for unknown request {line.request_id!r}")
            if line.request_id in results:
                raise TraceError(f"{where}: a second result for {line.request_id!r}")
            results[line.request_id] = line
        else:
            summary = line
    if header is None:
        raise TraceError(f"{name}: empty file, not a trace")
    return Trace(header, requests, results, summary)


def read_trace(path: str | Path) -> Trace:
    """Read a trace file. Raises :class:`TraceError` (file and line named) for anything
    that is not a trace of a readable version: a missing header, a malformed line, a
    duplicate request id, a result for an unknown request, an invalid params field."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return parse_lines(fh, str(path))
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None


# Settings of the recording host, not of the run: a trace replayed elsewhere with
# --same-config must not carry the recording host's cache folder or health threshold,
# and they never change a token. Section "" is the top level.
_HOST_LOCAL = {"": ("stall_timeout_s",), "speculative": ("timing_cache",)}


def runtime_fields(config: object) -> dict[str, Any]:
    """A RuntimeConfig's fields as plain JSON values, for :attr:`Header.runtime`, less the
    settings of the recording host (``_HOST_LOCAL``: the replaying host uses its own)."""
    fields: dict[str, Any] = msgspec.to_builtins(dataclasses.asdict(config))  # type: ignore[call-overload]
    for section, names in _HOST_LOCAL.items():
        table = fields if not section else (fields.get(section) or {})
        for name in names:
            table.pop(name, None)
    # SpeculativeConfig fields only one draft method reads (DraftNeeds.fields) are left
    # out of another method's header, which then names only what shaped its run (they
    # keep their defaults on replay).
    spec = fields.get("speculative") or {}
    method = spec.get("method")
    own = DRAFT_METHODS[method].fields if method in DRAFT_METHODS else ()
    for needs in DRAFT_METHODS.values():
        for name in needs.fields:
            if name not in own:
                spec.pop(name, None)
    return fields


def config_from_fields(fields: dict[str, Any]) -> Any:
    """The RuntimeConfig :func:`runtime_fields` wrote (raises ConfigError for a field this
    version does not know), so a replay can run with the recorded run's configuration."""
    from spectrio.core.config import RuntimeConfig, SpeculativeConfig
    from spectrio.errors import ConfigError

    try:
        return _build_config(fields, RuntimeConfig, SpeculativeConfig)
    except TypeError as exc:
        raise ConfigError(f"runtime: the trace's configuration is not readable: {exc}") from None


def _build_config(fields: dict[str, Any], cfg: Any, spec_cls: Any) -> Any:
    f = dict(fields)
    spec = f.pop("speculative", None)
    if spec is not None:
        f["speculative"] = spec_cls(**spec)
    for key, value in list(f.items()):
        if isinstance(value, list):
            f[key] = tuple(value)
    return cfg(**f)


class TraceWriter:
    """Writes a trace, one flushed line per call, so a reader (or a crash) never sees a
    partial line of an earlier call.

    With ``append=True`` an existing non-empty file is continued (its header must be a
    trace header; ``serve --record`` uses this so restarts add to one file); request ids
    already in it are remembered, and :meth:`unique_id` renames a reused one."""

    def __init__(
        self,
        path: str | Path,
        *,
        source: str,
        model: str | None = None,
        runtime: dict[str, Any] | None = None,
        append: bool = False,
    ) -> None:
        self.path = Path(path)
        self._ids: set[str] = set()
        self.last_arrival_s = 0.0  # of the requests in the file already (append)
        existing = append and self.path.exists() and self.path.stat().st_size > 0
        if existing:
            old = read_trace(self.path).requests
            self._ids = {r.request_id for r in old}
            self.last_arrival_s = max((r.arrival_s for r in old), default=0.0)
        try:
            self._fh: IO[bytes] = self.path.open("ab" if existing else "wb")
        except OSError as exc:
            raise TraceError(f"{self.path}: cannot write: {exc.strerror or exc}") from None
        if not existing:
            created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
            self._write(Header(created=created, source=source, model=model, runtime=runtime))

    def _write(self, line: Line) -> None:
        self._fh.write(_encoder.encode(line) + b"\n")
        self._fh.flush()

    def unique_id(self, request_id: str) -> str:
        """``request_id``, or ``request_id~N`` when the trace has it already (a client
        may reuse an id once its request finished; a trace's ids are unique)."""
        rid, n = request_id, 1
        while rid in self._ids:
            n += 1
            rid = f"{request_id}~{n}"
        return rid

    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        arrival_s: float,
        prompt_text: str | None = None,
    ) -> None:
        if request_id in self._ids:
            raise TraceError(f"{self.path}: request_id {request_id!r} is in the trace already")
        self._ids.add(request_id)
        self._write(
            TraceRequest(
                request_id=request_id,
                arrival_s=round(arrival_s, 6),
                prompt_ids=[int(t) for t in prompt_ids],
                prompt_text=prompt_text,
                params=params,
            )
        )

    def add_result(self, result: TraceResult) -> None:
        self._write(result)

    def add_summary(self, wall_s: float, stats: dict[str, Any]) -> None:
        self._write(RunSummary(wall_s=round(wall_s, 6), stats=stats))

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_trace(path: str | Path, trace: Trace) -> None:
    """Write a whole :class:`Trace` (header as given)."""
    with Path(path).open("wb") as fh:
        for line in [trace.header, *trace.requests, *trace.ordered_results()]:
            fh.write(_encoder.encode(line) + b"\n")
        if trace.summary is not None:
            fh.write(_encoder.encode(trace.summary) + b"\n")
