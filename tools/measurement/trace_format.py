"""Request traces: the format (``docs/trace.md``), a reader, a writer, and the pure
helpers that turn a run's deltas into results and results into a summary.

A trace is JSON Lines. The first line is a :class:`Header`; then, in any interleaving,
:class:`TraceRequest` lines (one per request, in arrival order), :class:`TraceResult`
lines (the run's output for a request, written when it finished) and at most one
trailing :class:`RunSummary` line. Every line is an object whose ``kind`` field names
its type. JSON Lines, so that ``serve --record`` can append one line per event and a
trace cut short by a crash is still readable up to its last complete line.

The API other tools use (``bench --save-trace`` is about ten lines with it)::

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
from typing import IO, Any, Final, Protocol

import msgspec

from spectrio.core.draft_methods import DRAFT_METHODS
from spectrio.core.params import SamplingParams
from spectrio.errors import SpectrioError
from spectrio.tools.latency import percentiles

__all__ = [
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "Header",
    "ResultBuilder",
    "RunSummary",
    "Trace",
    "TraceError",
    "TraceRequest",
    "TraceResult",
    "TraceWriter",
    "acceptance",
    "percentiles",
    "read_trace",
    "runtime_fields",
    "summarize",
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
    """Request hooks (:class:`spectrio.tools.metrics.RequestHooks`) that append every
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


# ---- summaries (pure) ---------------------------------------------------------------------


def acceptance(results: Iterable[TraceResult]) -> dict[str, Any]:
    """Acceptance per draft position (share of steps that proposed position i in which it
    was accepted) and the mean accepted length (tokens per step), over results that
    carry per-step draft counts."""
    proposed: list[int] = []
    accepted: list[int] = []
    steps = tokens = 0
    for r in results:
        if not r.step_drafts:
            continue
        for d, a, n in zip(r.step_drafts, r.step_accepted, r.step_tokens, strict=False):
            steps += 1
            tokens += n
            while len(proposed) < d:
                proposed.append(0)
                accepted.append(0)
            for i in range(d):
                proposed[i] += 1
                accepted[i] += int(i < a)
    return {
        "accepted_per_position": [
            round(a / p, 4) if p else 0.0 for a, p in zip(accepted, proposed, strict=False)
        ],
        "proposed_per_position": proposed,
        "mean_accept_len": round(tokens / steps, 4) if steps else None,
    }


def summarize(results: Sequence[TraceResult], wall_s: float | None) -> dict[str, Any]:
    """The figures ``bench`` reports, for one run: requests and their finish reasons,
    tokens, tokens per second over ``wall_s``, TTFT, ITL (gap between chunks) and TPOT
    (time per output token after the first) percentiles in ms, and acceptance."""
    reasons: dict[str, int] = {}
    for r in results:
        key = r.finish_reason or "unfinished"
        reasons[key] = reasons.get(key, 0) + 1
    tokens = sum(len(r.token_ids) for r in results)
    tpot = [
        (r.e2e_s - r.ttft_s) / (len(r.token_ids) - 1)
        for r in results
        if r.e2e_s is not None and r.ttft_s is not None and len(r.token_ids) > 1
    ]
    return {
        "requests": len(results),
        "finish_reasons": dict(sorted(reasons.items())),
        "tokens": tokens,
        "wall_s": round(wall_s, 4) if wall_s is not None else None,
        "tokens_per_second": round(tokens / wall_s, 2) if wall_s else None,
        "ttft_ms": percentiles([r.ttft_s for r in results if r.ttft_s is not None], scale=1e3),
        "itl_ms": percentiles([x for r in results for x in r.itl_s], scale=1e3),
        "tpot_ms": percentiles(tpot, scale=1e3),
        **acceptance(results),
    }


def format_summary(s: dict[str, Any]) -> str:
    """The summary as a few human lines."""

    def pct(d: dict[str, float | None]) -> str:
        if not d or d.get("p50") is None:
            return "n/a"
        return " ".join(f"{k}={v:.1f}" for k, v in d.items())

    acc = s.get("accepted_per_position") or []
    lines = [
        f"requests: {s['requests']} {s['finish_reasons']}",
        f"tokens: {s['tokens']} in {s['wall_s']} s ({s['tokens_per_second']} tok/s)",
        f"TTFT ms: {pct(s['ttft_ms'])}",
        f"ITL ms:  {pct(s['itl_ms'])}",
        f"TPOT ms: {pct(s['tpot_ms'])}",
        "acceptance per position: "
        + (" ".join(f"{a:.3f}" for a in acc) if acc else "n/a")
        + f"; mean accepted length {s.get('mean_accept_len')}",
    ]
    if "device" in s:
        d = s["device"]
        lines.append(
            "device: "
            + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items())
        )
    return "\n".join(lines)


# ---- import (a plain JSONL of prompts) -----------------------------------------------------


class PromptLine(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One line of a prompts file for ``spectrio trace import``."""

    prompt: str | list[int]
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    request_id: str | None = None
    arrival_s: float | None = None


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...
    def encode_prompt(self, text: str) -> list[int]: ...


def import_prompts(
    lines: Iterable[str | bytes],
    tokenizer: Tokenizer,
    *,
    name: str = "<prompts>",
    rate: float | None = None,
    seed: int = 0,
) -> list[TraceRequest]:
    """Turn a prompts JSONL (``{"prompt": text or token ids, "params": {SamplingParams
    fields}, "request_id": optional, "arrival_s": optional}`` per line) into trace
    requests. Text is tokenized with ``tokenizer``; params and token ids are checked
    with the runtime's own rules (:func:`spectrio.core.params.check_params`). A line
    without ``arrival_s`` arrives at 0, or, with ``rate`` (requests per second), at the
    next arrival of a Poisson process seeded with ``seed``."""
    import random

    from spectrio.core.params import check_params, check_prompt
    from spectrio.errors import InvalidRequest

    decoder = msgspec.json.Decoder(PromptLine)
    rng = random.Random(seed)
    clock = 0.0
    out: list[TraceRequest] = []
    ids: set[str] = set()
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            line = decoder.decode(raw)
            params = check_params(line.params, tokenizer.vocab_size)
            prompt_ids = check_prompt(
                line.prompt,
                vocab_size=tokenizer.vocab_size,
                max_model_len=2**31,  # the runtime checks its own at replay
                tokenize=tokenizer.encode_prompt,
            )
        except msgspec.DecodeError as exc:
            raise TraceError(f"{where}: {exc}") from None
        except InvalidRequest as exc:
            raise TraceError(f"{where}: {exc}") from None
        rid = line.request_id if line.request_id is not None else f"r{len(out)}"
        if rid in ids:
            raise TraceError(f"{where}: request_id {rid!r} appears twice")
        ids.add(rid)
        if line.arrival_s is not None:
            if not (math.isfinite(line.arrival_s) and line.arrival_s >= 0):
                raise TraceError(f"{where}: arrival_s must be a finite number >= 0")
            arrival = line.arrival_s
        elif rate:
            clock += rng.expovariate(rate)
            arrival = clock
        else:
            arrival = 0.0
        out.append(
            TraceRequest(
                request_id=rid,
                arrival_s=round(arrival, 6),
                prompt_ids=prompt_ids,
                prompt_text=line.prompt if isinstance(line.prompt, str) else None,
                params=params,
            )
        )
    out.sort(key=lambda r: r.arrival_s)  # stable: file order among equal arrivals
    return out


def load_tokenizer(model: str, *, strict: bool = True) -> Any:
    """The tokenizer of ``model`` ("bundled" or a checkpoint folder), without loading its
    weights (no Paddle). With ``strict=False`` a model that is not here gives None
    (a trace may name a checkpoint of another machine); else :class:`TraceError`."""
    from spectrio.models.config import BUNDLED_DIR
    from spectrio.models.tokenizer import TextTokenizer

    folder = BUNDLED_DIR if model == "bundled" else Path(model).expanduser()
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        if not strict:
            return None
        raise TraceError(f"model {model!r}: no tokenizer.json at {path}")
    return TextTokenizer.from_file(path)


# ---- the ``spectrio trace`` command ----------------------------------------------------------


def add_trace_parser(sub: Any) -> None:
    import argparse

    p = sub.add_parser("trace", help="make and inspect request traces (docs/trace.md)")
    tsub = p.add_subparsers(dest="trace_command", required=True, metavar="{import,show}")
    imp = tsub.add_parser(
        "import",
        help="a JSONL of prompts -> a trace",
        description=(
            'Each line: {"prompt": text or token ids, "params": {SamplingParams fields}, '
            '"request_id": optional, "arrival_s": optional}. Text is tokenized with '
            "--model's tokenizer; ids and params are checked with the runtime's rules."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    imp.add_argument("prompts", help="the prompts file ('-': stdin)")
    imp.add_argument("-o", "--out", required=True, help="the trace to write")
    imp.add_argument("--model", default="bundled", help="whose tokenizer tokenizes text prompts")
    imp.add_argument(
        "--rate",
        type=float,
        default=None,
        help="Poisson arrivals at this many requests per second (default: all at 0 s) "
        "for lines without arrival_s",
    )
    imp.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    imp.set_defaults(func=import_main)
    show = tsub.add_parser("show", help="summarize a trace (and its results, if any)")
    show.add_argument("trace")
    show.add_argument("--json", action="store_true", help="print one JSON object")
    show.set_defaults(func=show_main)


def import_main(args: Any) -> int:
    """Exit status 0, or 2 for an unreadable or invalid prompts file."""
    import json
    import sys

    if args.rate is not None and not args.rate > 0:
        print(f"error: --rate must be > 0, got {args.rate}", file=sys.stderr)
        return 2
    try:
        tok = load_tokenizer(args.model)
        if args.prompts == "-":
            requests = import_prompts(
                sys.stdin, tok, name="<stdin>", rate=args.rate, seed=args.seed
            )
        else:
            try:
                with open(args.prompts, "rb") as fh:
                    requests = import_prompts(
                        fh, tok, name=args.prompts, rate=args.rate, seed=args.seed
                    )
            except OSError as exc:
                raise TraceError(f"{args.prompts}: cannot read: {exc.strerror or exc}") from None
        with TraceWriter(args.out, source="import", model=args.model) as w:
            for r in requests:
                w.add_request(
                    r.request_id,
                    r.prompt_ids,
                    r.params,
                    arrival_s=r.arrival_s,
                    prompt_text=r.prompt_text,
                )
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"out": args.out, "requests": len(requests)}))
    return 0


def show_main(args: Any) -> int:
    import json
    import sys

    try:
        t = read_trace(args.trace)
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    info: dict[str, Any] = {
        "version": t.header.version,
        "source": t.header.source,
        "created": t.header.created,
        "model": t.header.model,
        "requests": len(t.requests),
        "span_s": max((r.arrival_s for r in t.requests), default=0.0),
        "prompt_tokens": sum(len(r.prompt_ids) for r in t.requests),
        "results": len(t.results),
    }
    if t.results:
        info["summary"] = summarize(
            t.ordered_results(), t.summary.wall_s if t.summary is not None else None
        )
    if args.json:
        print(json.dumps(info))
    else:
        for k, v in info.items():
            if k != "summary":
                print(f"{k}: {v}")
        if "summary" in info:
            print(format_summary(info["summary"]))
    return 0
