"""The bench's speculation summary (:mod:`spectrio.tools.measurement.bench_speedup`) on
hand-made rows."""

from __future__ import annotations

from typing import Any

import pytest

from spectrio.tools.measurement.bench_speedup import format_speedups, pooled_rate, speedups


def _row(batch: int, k: int | str, runs: list[float], lp: int | str = "off") -> dict[str, Any]:
    return {"batch": batch, "k": k, "logprobs": lp, "tokens_per_second_runs": runs}


def test_best_fixed_k_and_adaptive_against_the_better_of_the_two() -> None:
    rows = [
        _row(1, 0, [100.0, 110.0, 90.0]),
        _row(1, 1, [150.0, 150.0, 150.0]),
        _row(1, 2, [180.0, 170.0, 175.0]),
        _row(1, "auto", [171.5, 176.0, 180.0]),
    ]
    (s,) = speedups(rows)
    assert (s.batch, s.logprobs, s.best_k, s.better) == (1, "off", 2, 2)
    assert s.best_over_none == pytest.approx(175.0 / 100.0)
    # Round by round: the same round's two cases, not a ratio of medians.
    assert s.best_over_none_rounds == pytest.approx([1.8, 170.0 / 110.0, 175.0 / 90.0])
    assert s.auto_over_better == pytest.approx(176.0 / 175.0)
    assert s.auto_over_better_rounds == pytest.approx([171.5 / 180.0, 176.0 / 170.0, 180.0 / 175.0])
    # Paired: the median of the rounds' ratios, which here differs from the ratio of
    # medians (auto's median, 176, ran in round 2; k = 2's, 175, in round 3).
    assert s.best_over_none_paired == pytest.approx(1.8)
    assert s.auto_over_better_paired == pytest.approx(180.0 / 175.0)
    text = format_speedups([s])
    assert (
        "batch=1: k=2 1.75× (paired 1.80×, rounds 1.55-1.94×);"
        " auto ÷ k=2 1.006 (paired 1.029, rounds 0.95-1.04)"
    ) in text


def test_where_no_speculation_wins_adaptive_is_compared_with_it() -> None:
    rows = [
        _row(64, 0, [2400.0]),
        _row(64, 1, [2300.0]),
        _row(64, 2, [2200.0]),
        _row(64, "auto", [2376.0]),
    ]
    (s,) = speedups(rows)
    assert s.best_k == 1 and s.better == 0
    assert s.best_over_none == pytest.approx(2300.0 / 2400.0)
    assert s.auto_over_better == pytest.approx(0.99)
    assert s.auto_over_better_paired == pytest.approx(0.99)
    # One round: no spread to show.
    assert format_speedups([s]).splitlines()[1] == "  batch=64: k=1 0.96×; auto ÷ none 0.990"


def test_ties_go_to_the_smaller_k_and_groups_need_both_cases() -> None:
    rows = [
        _row(4, 0, [100.0]),
        _row(4, 3, [120.0]),
        _row(4, 2, [120.0]),
        _row(16, 2, [300.0]),  # no k = 0 at batch 16: nothing to compare with
        _row(16, "auto", [310.0]),
        _row(32, 0, [500.0]),  # only no speculation and auto at batch 32
        _row(32, "auto", [490.0]),
        _row(4, 0, [90.0], lp=5),  # another logprob setting is its own group
        _row(4, 1, [99.0], lp=5),
    ]
    got = speedups(rows)
    assert [(s.batch, s.logprobs, s.best_k) for s in got] == [(4, "off", 2), (4, 5, 1)]
    assert got[0].auto_over_better is None and got[0].auto_over_better_rounds == []
    assert got[0].auto_over_better_paired is None
    assert "lp=5" in format_speedups(got) and "auto" not in format_speedups(got)
    assert speedups([]) == [] and format_speedups([]) == ""


def test_pooled_rate_and_its_standard_error() -> None:
    # Equal turns: the rate is the mean rate and the error the standard error of the mean.
    rate, se = pooled_rate([[100, 1.0], [120, 1.0], [110, 1.0], [90, 1.0]])
    assert rate == pytest.approx(105.0)
    rates = [100.0, 120.0, 110.0, 90.0]
    sd = (sum((x - 105.0) ** 2 for x in rates) / 3) ** 0.5
    assert se == pytest.approx(sd / 4**0.5)
    # Unequal turns weigh by their seconds; turns at one rate have no spread.
    rate, se = pooled_rate([[50, 0.5], [200, 2.0], [100, 1.0]])
    assert rate == pytest.approx(100.0) and se == pytest.approx(0.0, abs=1e-9)
    rate, _ = pooled_rate([[50, 0.5], [300, 2.0], [150, 1.0]])
    assert rate == pytest.approx(500 / 3.5)  # not the mean of the turns' rates (133.3)
    # Whatever the spread, the interval tightens as the samples grow.
    noisy = [[100 + (7 * i) % 23 - 11, 1.0] for i in range(16)]
    assert pooled_rate(noisy * 4)[1] < pooled_rate(noisy)[1]  # type: ignore[operator]
    assert pooled_rate([[10, 2.0]]) == (5.0, None)
    assert pooled_rate([[10, 2.0], [0, 0.0]]) == (5.0, None)  # an empty turn is no sample
    with pytest.raises(ValueError, match="positive seconds"):
        pooled_rate([[0, 0.0]])


def _relative_se(samples: list[list[float]]) -> float:
    rate, se = pooled_rate(samples)
    assert se is not None
    return se / rate


def test_pooled_ratios_come_from_the_samples() -> None:
    def row(k: int | str, turns: list[list[float]]) -> dict[str, Any]:
        rate = sum(t for t, _ in turns) / sum(s for _, s in turns)
        return {**_row(16, k, [rate]), "samples": turns}

    rows = [
        row(0, [[100, 1.0], [110, 1.0], [90, 1.0]]),
        row(2, [[150, 1.0], [165, 1.0], [135, 1.0]]),
        row("auto", [[140, 1.0], [160, 1.0], [150, 1.0]]),
    ]
    (s,) = speedups(rows)
    assert s.best_over_none_pooled == pytest.approx(1.5)
    assert s.auto_over_better_pooled == pytest.approx(1.0)
    # Relative errors add in quadrature: none at 100, k = 2 at 150, auto at 150 tokens/s.
    e_none, e_k2, e_auto = (_relative_se(r["samples"]) for r in rows)
    assert s.best_over_none_se == pytest.approx(1.5 * (e_k2**2 + e_none**2) ** 0.5)
    assert s.auto_over_better_se == pytest.approx((e_auto**2 + e_k2**2) ** 0.5)
    text = format_speedups([s])
    assert f"[pooled 1.50× ± {1.96 * s.best_over_none_se:.2f}]" in text
    assert f"auto ÷ k=2 1.000 [pooled 1.000 ± {1.96 * s.auto_over_better_se:.3f}]" in text
    # Rows without samples (an older bench's JSON) have no pooled figures.
    (old,) = speedups([{k: v for k, v in r.items() if k != "samples"} for r in rows])
    assert old.auto_over_better_pooled is None and old.auto_over_better_se is None
    assert "pooled 1" not in format_speedups([old])
