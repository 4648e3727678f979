"""A run's summary from its trace results (pure): the figures ``bench`` reports, and
the few lines ``replay`` and ``trace show`` print."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from spectrio.tools.measurement.latency import percentiles
from spectrio.tools.measurement.trace_format import TraceResult

__all__ = ["acceptance", "format_summary", "summarize"]


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
