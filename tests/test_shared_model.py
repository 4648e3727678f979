"""Runtimes sharing one loaded checkpoint (``open_runtime(..., loaded=...)``, as
``spectrio bench --interleave`` runs its cases): running at the same time, each still
produces the oracle's greedy output (float64), and a preloaded model that does not fit
the config is refused with a typed error."""

from __future__ import annotations

import pytest
import trio
from pipeline_helpers import collect, oracle, prompts
from pipeline_helpers import float64_config as config

from spectrio import RuntimeConfig, SamplingParams, open_runtime
from spectrio.core.config import ConfigError
from spectrio.models import load

MAX_TOKENS = 24


async def test_runtimes_on_one_loaded_model_run_side_by_side_unchanged() -> None:
    loaded = load("bundled", "float64")
    batch = prompts(loaded.tokenizer)[:4]
    configs = [config(k=3), config(k=4, adaptive=True, overlap=True), config(k=2)]
    results: list[list[list[int]]] = [[[] for _ in batch] for _ in configs]
    with trio.fail_after(300):
        async with (
            open_runtime(configs[0], loaded=loaded) as a,
            open_runtime(configs[1], loaded=loaded) as b,
            open_runtime(configs[2], loaded=loaded) as c,
        ):
            runtimes = [a, b, c]
            assert all(rt.loaded is loaded for rt in runtimes)

            async def one(r: int, i: int) -> None:
                results[r][i] = await collect(
                    runtimes[r], batch[i], SamplingParams(max_tokens=MAX_TOKENS)
                )

            async with trio.open_nursery() as nursery:
                for r in range(len(runtimes)):
                    for i in range(len(batch)):
                        nursery.start_soon(one, r, i)
            assert all(rt.num_steps > 0 for rt in runtimes)
    want = [oracle("float64", p, MAX_TOKENS) for p in batch]
    assert results == [want] * len(configs)


async def test_a_preloaded_model_of_another_dtype_is_refused() -> None:
    loaded = load("bundled", "float32")
    with trio.fail_after(60), pytest.raises(ConfigError, match="float32"):
        async with open_runtime(config(k=3), loaded=loaded):
            pass


async def test_a_preloaded_model_is_refused_for_a_tensor_parallel_group() -> None:
    loaded = load("bundled", "float64")
    cfg = RuntimeConfig(dtype="float64", tensor_parallel_size=2)
    with trio.fail_after(60), pytest.raises(ConfigError, match="one rank"):
        async with open_runtime(cfg, loaded=loaded):
            pass
