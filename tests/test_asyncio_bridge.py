"""asyncio programs drive the same runtime through Trio guest mode."""

from __future__ import annotations

import asyncio

from pipeline_helpers import oracle
from spectrio import InvalidRequest, RuntimeConfig, SamplingParams
from spectrio.runtime.aio import open_runtime_asyncio


def test_asyncio_run_streams_the_reference_tokens(bundled64: object) -> None:
    prompts = [bundled64.tokenizer.encode(p) for p in ("def fib(n):", "import os\n", "class A:\n")]  # type: ignore[attr-defined]

    async def main() -> tuple[list[list[int]], str]:
        cfg = RuntimeConfig(dtype="float64", max_model_len=256)
        async with open_runtime_asyncio(cfg, encoded_channels=True) as rt:

            async def one(p: list[int]) -> list[int]:
                out: list[int] = []
                async for delta in rt.generate(p, SamplingParams(max_tokens=16)):
                    out += delta.token_ids
                return out

            results = await asyncio.gather(*(one(p) for p in prompts))
            try:
                async for _ in rt.generate("", SamplingParams()):
                    pass
                error = ""
            except InvalidRequest as exc:
                error = str(exc)
            # Breaking out early aborts the request inside the runtime.
            async for _ in rt.generate("x = 1", SamplingParams(max_tokens=100, ignore_eos=True)):
                break
            for _ in range(100):
                if rt.runtime.blocks.num_used_blocks == 0:
                    break
                await asyncio.sleep(0.05)
            assert rt.runtime.blocks.num_used_blocks == 0
            return list(results), error

    results, error = asyncio.run(asyncio.wait_for(main(), timeout=120))
    assert error.startswith("prompt:")
    for p, got in zip(prompts, results):
        assert got == oracle("float64", p, 16)
