"""The statistics ``benchmarks/bench_http.py`` reports its paired TTFT with."""

from __future__ import annotations

import numpy as np
from bench_http import _paired, median_interval


def test_the_median_interval_covers_the_true_median_95_percent_of_the_time() -> None:
    rng = np.random.default_rng(0)
    for n in (12, 48, 200):
        hits = 0
        for _ in range(2000):
            # skewed, as latencies are: the interval must not lean on a normal shape
            xs = rng.lognormal(0.0, 1.0, size=n).tolist()
            _, lo, hi = median_interval(xs)
            hits += lo <= 1.0 <= hi  # the lognormal's median is e^0
        assert 0.93 <= hits / 2000 <= 0.995, (n, hits)


def test_the_median_interval_orders_and_holds_the_median() -> None:
    mid, lo, hi = median_interval([float(x) for x in range(48, 0, -1)])
    assert lo < mid < hi and mid == 24.5
    assert median_interval([3.0]) == (3.0, 3.0, 3.0)


def test_pairs_are_differences_in_order() -> None:
    got = _paired([10.0, 20.0, 30.0], [9.0, 21.0, 27.0])
    assert got is not None and got["median"] == 1.0 and got["pairs"] == 3
    assert _paired([], []) is None
