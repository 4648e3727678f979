"""``spectrio trace import|show``: a trace from a plain JSONL of prompts, and a trace's
summary."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import msgspec

from spectrio.core.params import SamplingParams
from spectrio.tools.measurement.trace_format import (
    TraceError,
    TraceRequest,
    TraceWriter,
    read_trace,
)
from spectrio.tools.measurement.trace_summary import format_summary, summarize

__all__ = ["PromptLine", "add_trace_parser", "import_prompts", "load_tokenizer"]

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
    from spectrio.models.architecture.config import BUNDLED_DIR
    from spectrio.models.text.tokenizer import TextTokenizer

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
