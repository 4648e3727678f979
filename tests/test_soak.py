"""The soak benchmark at a small N (issue 15, item 9): memory per request and collector
pauses stay bounded. The bound is loose on purpose (a shared CI machine, a short run);
the benchmark figure is ``python benchmarks/soak.py --n 1000``."""

from __future__ import annotations

import trio
from soak import slope_per_request, soak

from spectrio import RuntimeConfig


def test_slope_is_per_request_growth_over_the_second_half() -> None:
    got = slope_per_request([100, 5000, 9000, 10_000, 10_100, 10_200, 10_300, 10_400])
    assert abs(got - 100.0) < 1e-6
    assert slope_per_request([7]) == 0.0


async def test_a_short_soak_keeps_memory_and_pauses_bounded(bundled: object) -> None:
    with trio.fail_after(600):
        res = await soak(
            RuntimeConfig(max_model_len=128), 160, concurrency=4, warmup=40, max_tokens=8
        )
    assert res["bytes_per_request"] < 8 * 1024, res
    assert res["gc_max_pause_ms"] < 200, res
