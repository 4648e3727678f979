"""What speculation buys, per batch size, from one ``spectrio bench`` run's cases.

For every batch size (and logprob setting) with a no-speculation case (``k = 0``) and at
least one fixed ``k``:

* **best fixed k ÷ none**: the fixed k with the highest median tokens/s, over no
  speculation's median;
* **adaptive ÷ better**: the ``auto`` case's median over the better of those two (the
  best fixed k or no speculation), which is what a policy that always chose right would
  match.

The machine moves a case by several percent between rounds, so each ratio also comes
per round: the same two cases of one round ran back to back (the bench alternates the
cases within each round), which cancels a slow stretch that a ratio of medians keeps.
The per-round figures compare with the k that won on medians, not with each round's own
fastest k: picking the maximum of several noisy figures every round would bias the
ratio down even for a policy that always chose right. Their median is the *paired*
ratio (``..._paired``). A ratio of medians may divide figures from two different rounds:
in one run at batch 16 (5 rounds, interleaved) k = 2's median came from round 1 and the
adaptive case's from round 2, while no speculation drew 892 to 1255 tokens/s across the
rounds; the ratio of medians read 0.945 where the rounds read 0.91, 0.98, 0.97, 0.98 and
1.12 (paired: 0.983). Both are reported; neither replaces the other.

**Pooled, with a standard error.** Each row also carries its samples (``samples``:
``[tokens, seconds]`` per turn with ``--interleave``, per round otherwise), and a case's
pooled rate is all its tokens over all its seconds, with the ratio estimator's standard
error (:func:`pooled_rate`). Two runtimes doing identical work side by side (fixed k = 4
four times at batch 16, 0.5 s turns, 2-core AMD EPYC host) gave per-turn rates whose
ratio to each other had a standard deviation of 15-17%, and whole cases differing by up
to 4.6% after 54 turns each: a difference of 2% between two cases is resolved only
where the interval says so. ``..._pooled`` is the ratio of pooled rates and ``..._se``
its standard error, from the two cases' errors as if independent (turns of two cases in
one cycle share some of the machine's drift, so this errs wide; so does the workload's
own shape, since a turn of prompts or of a draining batch runs at another rate than a
steady one, and that spread is counted as noise).

Pure functions of the bench's rows
(:func:`spectrio.tools.measurement.bench_report.median_run`): no I/O.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["Z_95", "Speedup", "format_speedups", "pooled_rate", "speedups"]

Z_95 = 1.96
"""Standard errors in a 95% interval's half-width (normal approximation)."""


@dataclasses.dataclass(frozen=True)
class Speedup:
    batch: int
    logprobs: int | str  # "off" or N, as in the bench's rows
    best_k: int  # the fixed k with the highest median tokens/s
    best_over_none: float  # ratio of medians
    best_over_none_rounds: list[float]  # the same, round by round
    best_over_none_paired: float  # the median of the rounds' ratios
    better: int  # the better of best_k and 0 (no speculation)
    auto_over_better: float | None  # None without an "auto" case
    auto_over_better_rounds: list[float]
    auto_over_better_paired: float | None
    best_over_none_pooled: float | None = None  # None where the rows carry no samples
    best_over_none_se: float | None = None
    auto_over_better_pooled: float | None = None
    auto_over_better_se: float | None = None

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def pooled_rate(samples: Sequence[Sequence[float]]) -> tuple[float, float | None]:
    """Tokens per second over all ``samples`` (``(tokens, seconds)`` pairs) and the
    standard error of that ratio (the ratio estimator's, to first order:
    ``sqrt(sum((t_i - R s_i)^2) / (n (n - 1))) / mean(s)``); None with fewer than two
    samples. Samples of unequal length weigh by their seconds, as the pooled rate does."""
    pairs = [(float(t), float(s)) for t, s in samples if s > 0]
    seconds = sum(s for _, s in pairs)
    if seconds <= 0:
        raise ValueError("pooled_rate needs a sample with positive seconds")
    rate = sum(t for t, _ in pairs) / seconds
    n = len(pairs)
    if n < 2:
        return rate, None
    spread = sum((t - rate * s) ** 2 for t, s in pairs) / (n * (n - 1))
    return rate, spread**0.5 / (seconds / n)


def _pooled_ratio(
    num: Sequence[Sequence[float]] | None, den: Sequence[Sequence[float]] | None
) -> tuple[float | None, float | None]:
    """Ratio of two cases' pooled rates and its standard error (independent errors)."""
    if not num or not den:
        return None, None
    (a, sa), (b, sb) = pooled_rate(num), pooled_rate(den)
    if b <= 0:
        return None, None
    ratio = a / b
    if sa is None or sb is None or a <= 0:
        return ratio, None
    return ratio, ratio * ((sa / a) ** 2 + (sb / b) ** 2) ** 0.5


def _per_round(num: Sequence[float], den: Sequence[float]) -> list[float]:
    return [a / b for a, b in zip(num, den, strict=False) if b > 0]


def speedups(rows: Sequence[dict[str, Any]]) -> list[Speedup]:
    """One :class:`Speedup` per (batch, logprobs) that has ``k = 0`` and a fixed k.

    Each row needs ``batch``, ``k`` (0, a positive int, or ``"auto"``), ``logprobs`` and
    ``tokens_per_second_runs`` (one figure per round, in round order); ``samples`` (see
    :func:`pooled_rate`) where it has them."""
    groups: dict[tuple[int, int | str], dict[int | str, list[float]]] = {}
    samples: dict[tuple[int, int | str, int | str], list[list[float]]] = {}
    for r in rows:
        runs = [float(x) for x in r["tokens_per_second_runs"]]
        groups.setdefault((r["batch"], r["logprobs"]), {})[r["k"]] = runs
        if r.get("samples"):
            samples[(r["batch"], r["logprobs"], r["k"])] = r["samples"]
    out = []
    for (batch, lp), cases in groups.items():
        none = cases.get(0)
        fixed = {k: v for k, v in cases.items() if isinstance(k, int) and k > 0}
        if none is None or not fixed:
            continue
        best_k = max(fixed, key=lambda k: (_median(fixed[k]), -k))
        best = fixed[best_k]
        better, better_runs = (best_k, best) if _median(best) >= _median(none) else (0, none)
        auto = cases.get("auto")
        best_rounds = _per_round(best, none)
        auto_rounds = [] if auto is None else _per_round(auto, better_runs)
        best_pooled, best_se = _pooled_ratio(
            samples.get((batch, lp, best_k)), samples.get((batch, lp, 0))
        )
        auto_pooled, auto_se = _pooled_ratio(
            samples.get((batch, lp, "auto")), samples.get((batch, lp, better))
        )
        out.append(
            Speedup(
                batch=batch,
                logprobs=lp,
                best_k=best_k,
                best_over_none=_median(best) / _median(none),
                best_over_none_rounds=best_rounds,
                best_over_none_paired=_median(best_rounds),
                better=better,
                auto_over_better=None if auto is None else _median(auto) / _median(better_runs),
                auto_over_better_rounds=auto_rounds,
                auto_over_better_paired=_median(auto_rounds) if auto_rounds else None,
                best_over_none_pooled=best_pooled,
                best_over_none_se=best_se,
                auto_over_better_pooled=auto_pooled,
                auto_over_better_se=auto_se,
            )
        )
    return sorted(out, key=lambda s: (s.batch, -1 if s.logprobs == "off" else int(s.logprobs)))


def _spread(rounds: Sequence[float], unit: str, digits: int) -> str:
    if len(rounds) < 2:
        return ""
    paired = f"paired {_median(rounds):.{digits}f}{unit}, "
    return f" ({paired}rounds {min(rounds):.2f}-{max(rounds):.2f}{unit})"


def _pooled_text(ratio: float | None, se: float | None, unit: str, digits: int) -> str:
    if ratio is None or se is None:
        return ""
    return f" [pooled {ratio:.{digits}f}{unit} ± {Z_95 * se:.{digits}f}]"


def format_speedups(items: Sequence[Speedup]) -> str:
    """Lines for the bench's output; empty when no batch size has the cases to compare."""
    if not items:
        return ""
    lines = [
        "speculation: best fixed k ÷ no speculation; adaptive ÷ the better of the two"
        " (ratios of medians; paired: the median of the rounds' ratios;"
        " pooled: all tokens over all seconds, ± its 95% interval)"
    ]
    for s in items:
        lp = "" if s.logprobs == "off" else f" lp={s.logprobs}"
        line = (
            f"  batch={s.batch}{lp}: k={s.best_k} {s.best_over_none:.2f}×"
            f"{_spread(s.best_over_none_rounds, '×', 2)}"
            f"{_pooled_text(s.best_over_none_pooled, s.best_over_none_se, '×', 2)}"
        )
        if s.auto_over_better is not None:
            vs = "none" if s.better == 0 else f"k={s.better}"
            line += (
                f"; auto ÷ {vs} {s.auto_over_better:.3f}{_spread(s.auto_over_better_rounds, '', 3)}"
                f"{_pooled_text(s.auto_over_better_pooled, s.auto_over_better_se, '', 3)}"
            )
        lines.append(line)
    return "\n".join(lines)
