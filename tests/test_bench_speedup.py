"""The bench's speculation summary (:mod:`spectrio.tools.bench_speedup`) on hand-made rows."""

from __future__ import annotations

from typing import Any

import pytest

from spectrio.tools.bench_speedup import format_speedups, speedups


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
