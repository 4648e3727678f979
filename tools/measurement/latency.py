"""Latency percentiles, the one summary every measuring command prints (pure)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["percentiles"]


def percentiles(values: Sequence[float], *, scale: float = 1.0) -> dict[str, float | None]:
    """p50, p90, p99 and mean of ``values`` times ``scale`` (1000: seconds reported in
    milliseconds), by linear interpolation, rounded to 3 decimals; every entry None when
    there are no values."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    arr = np.asarray(values, dtype=np.float64) * scale
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {
        "p50": round(float(p50), 3),
        "p90": round(float(p90), 3),
        "p99": round(float(p99), 3),
        "mean": round(float(arr.mean()), 3),
    }
