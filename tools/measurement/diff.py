"""``spectrio diff``: compare two runs of the same trace.

Per request it finds the first token where the runs diverge (its index, both tokens and
the text around them in each run); over the run it reports the share of identical
requests and the latency (TTFT, ITL, tokens per second) and acceptance deltas (b - a).
With ``--strict`` the exit status is 1 when any request diverges, so it can gate CI.

Two requests are identical when their token ids and finish reasons are equal. A request
with a result in only one run diverges at index 0 (``missing`` names the run without it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from spectrio.tools.measurement.trace_format import Trace, TraceResult, read_trace
from spectrio.tools.measurement.trace_summary import summarize

__all__ = ["DiffReport", "Divergence", "add_diff_parser", "diff_traces", "first_divergence"]

Decode = Callable[[Sequence[int]], str]


@dataclasses.dataclass
class Divergence:
    request_id: str
    index: int  # first position where the token ids differ (or where one run stops)
    token_a: int | None  # None: run a has no token there (ended, or no result)
    token_b: int | None
    context_a: str  # text around the position in run a: before[[token]]after
    context_b: str
    finish_a: str | None
    finish_b: str | None
    missing: str | None = None  # "a" or "b": that run has no result for the request


@dataclasses.dataclass
class DiffReport:
    compared: int
    identical: int
    divergences: list[Divergence]
    deltas: dict[str, Any]

    @property
    def share_identical(self) -> float:
        return self.identical / self.compared if self.compared else 1.0

    def to_json(self) -> dict[str, Any]:
        return {
            "compared": self.compared,
            "identical": self.identical,
            "share_identical": round(self.share_identical, 4),
            "divergences": [dataclasses.asdict(d) for d in self.divergences],
            "deltas": self.deltas,
        }


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (the shorter length when one is a prefix of
    the other), or None when equal (pure)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _context(ids: Sequence[int], i: int, decode: Decode | None, width: int) -> str:
    if decode is None:
        before = " ".join(str(t) for t in ids[max(0, i - width) : i])
        at = str(ids[i]) if i < len(ids) else "<end>"
        after = " ".join(str(t) for t in ids[i + 1 : i + 1 + width])
        return f"{before} [[{at}]] {after}".strip()
    at = decode([ids[i]]) if i < len(ids) else "<end>"
    return f"{decode(ids[max(0, i - width) : i])}[[{at}]]{decode(ids[i + 1 : i + 1 + width])}"


def _delta(a: float | None, b: float | None) -> dict[str, float | None]:
    d = round(b - a, 4) if a is not None and b is not None else None
    rel = round((b - a) / a, 4) if a and b is not None else None
    return {"a": a, "b": b, "delta": d, "relative": rel}


def _run_summary(t: Trace) -> dict[str, Any]:
    wall = t.summary.wall_s if t.summary is not None else None
    return summarize(t.ordered_results(), wall)


def diff_traces(a: Trace, b: Trace, decode: Decode | None = None, width: int = 8) -> DiffReport:
    """Compare the results of two runs (pure, given ``decode``)."""
    ids = [r.request_id for r in a.requests]
    ids += [r.request_id for r in b.requests if r.request_id not in set(ids)]
    ids = [i for i in ids if i in a.results or i in b.results]
    divergences: list[Divergence] = []
    for rid in ids:
        ra: TraceResult | None = a.results.get(rid)
        rb: TraceResult | None = b.results.get(rid)
        ta = ra.token_ids if ra is not None else []
        tb = rb.token_ids if rb is not None else []
        fa = ra.finish_reason if ra is not None else None
        fb = rb.finish_reason if rb is not None else None
        at = first_divergence(ta, tb)
        missing = "a" if ra is None else "b" if rb is None else None
        if at is None and fa == fb and missing is None:
            continue
        i = at if at is not None else len(ta)
        divergences.append(
            Divergence(
                request_id=rid,
                index=i,
                token_a=ta[i] if i < len(ta) else None,
                token_b=tb[i] if i < len(tb) else None,
                context_a=_context(ta, i, decode, width),
                context_b=_context(tb, i, decode, width),
                finish_a=fa,
                finish_b=fb,
                missing=missing,
            )
        )
    sa, sb = _run_summary(a), _run_summary(b)
    deltas: dict[str, Any] = {
        "tokens_per_second": _delta(sa["tokens_per_second"], sb["tokens_per_second"]),
        "mean_accept_len": _delta(sa["mean_accept_len"], sb["mean_accept_len"]),
    }
    for key in ("ttft_ms", "itl_ms", "tpot_ms"):
        for q in ("p50", "p90", "p99"):
            deltas[f"{key[:-3]}_{q}_ms"] = _delta(sa[key].get(q), sb[key].get(q))
    pa, pb = sa["accepted_per_position"], sb["accepted_per_position"]
    deltas["accepted_per_position"] = [
        _delta(pa[i] if i < len(pa) else None, pb[i] if i < len(pb) else None)
        for i in range(max(len(pa), len(pb)))
    ]
    return DiffReport(len(ids), len(ids) - len(divergences), divergences, deltas)


def format_report(report: DiffReport, limit: int = 20) -> str:
    lines = [
        f"{report.identical}/{report.compared} requests identical ({report.share_identical:.1%})"
    ]
    for d in report.divergences[:limit]:
        if d.missing:
            lines.append(f"- {d.request_id}: no result in run {d.missing}")
            continue
        lines.append(
            f"- {d.request_id}: first divergence at token {d.index}: "
            f"{d.token_a} vs {d.token_b} (finish {d.finish_a} vs {d.finish_b})"
        )
        lines.append(f"    a: {d.context_a!r}")
        lines.append(f"    b: {d.context_b!r}")
    if len(report.divergences) > limit:
        lines.append(f"... and {len(report.divergences) - limit} more (--json lists all)")
    lines.append("deltas (b - a):")
    for key, v in report.deltas.items():
        if key == "accepted_per_position":
            if v:
                lines.append(
                    "  acceptance per position: " + "  ".join(f"{x['a']} -> {x['b']}" for x in v)
                )
        elif v["a"] is not None or v["b"] is not None:
            rel = f" ({v['relative']:+.1%})" if v["relative"] is not None else ""
            lines.append(f"  {key}: {v['a']} -> {v['b']}{rel}")
    return "\n".join(lines)


def add_diff_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "diff",
        help="compare two runs of a trace (docs/trace.md)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("a", help="a run (a trace with results), e.g. the expected one")
    p.add_argument("b", help="the run to compare with it")
    p.add_argument("--strict", action="store_true", help="exit 1 when any request diverges")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument(
        "--model",
        default=None,
        help="tokenizer for the context text (default: run a's model, else the bundled one)",
    )
    p.add_argument("--context", type=int, default=8, help="tokens of context each side")
    p.set_defaults(func=diff_main)


def diff_main(args: argparse.Namespace) -> int:
    """Exit status: 0, or 1 with ``--strict`` when a request diverges; 2 for an
    unreadable trace."""
    from spectrio.errors import SpectrioError
    from spectrio.tools.measurement.trace_command import load_tokenizer

    try:
        a, b = read_trace(args.a), read_trace(args.b)
        tok = load_tokenizer(args.model or a.header.model or "bundled", strict=bool(args.model))
    except SpectrioError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = diff_traces(a, b, tok.decode if tok is not None else None, max(0, args.context))
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print(format_report(report))
    return 1 if args.strict and report.divergences else 0
