"""Requests that end at their first token, over a shared prefix: the prefix cache's worst
case before prompt blocks were registered in the step that wrote them.

A shared system prompt of ``--prefix-tokens`` held-out tokens (plus each request's own
``--suffix-tokens``) is warmed by one request with ``max_tokens=1``, which ends in its
prefill step. Then ``--requests`` requests over it arrive at once, and each closes its
stream as soon as its first token arrives (a classifier, or a client that disconnects).
The runtime is the default one for ``--model`` (adaptive MTP speculation), with the prefix
cache on and off, alternated round by round, each case on a fresh runtime.

Reported per case: TTFT p50 and p90 of the burst (seconds from its arrival), the prefix
cache's hit tokens and cached blocks after the burst, and the pooled off / on ratio of
TTFT p50 per round.

Run: ``python benchmarks/bench_prefix_first_token.py [--model smollm2] [--rounds 2]
[--prefix-tokens 600] [--requests 16]``. Prints one JSON object per case, then the
ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import trio

from spectrio import RuntimeConfig, SamplingParams, open_runtime
from spectrio.tools.measurement.bench_prefix import prefix_prompts
from spectrio.tools.measurement.latency import percentiles


async def run_case(
    model: str, prompts: list[list[int]], caching: bool, max_tokens: int
) -> dict[str, Any]:
    """Warm with prompt 0 (``max_tokens=1``), then the rest at once, each closed after its
    first token."""
    cfg = RuntimeConfig(
        model=model,
        enable_prefix_caching=caching,
        max_num_seqs=len(prompts),
        max_model_len=max(map(len, prompts)) + max_tokens + 1,
    )
    greedy = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    async with open_runtime(cfg) as rt:
        async for _ in rt.generate(prompts[0], SamplingParams(max_tokens=1)):
            pass
        await rt.wait_idle()
        ttfts: list[float] = []
        t0 = time.perf_counter()

        async def first_token(prompt: list[int]) -> None:
            async with rt.generate(prompt, greedy) as stream:
                async for delta in stream:
                    if delta.token_ids:
                        ttfts.append(time.perf_counter() - t0)
                        return

        async with trio.open_nursery() as nursery:
            for prompt in prompts[1:]:
                nursery.start_soon(first_token, prompt)
        await rt.wait_idle()
        stats = rt.stats()
    pct = percentiles(ttfts)
    return {
        "caching": caching,
        "requests": len(ttfts),
        "ttft_p50_s": pct["p50"],
        "ttft_p90_s": pct["p90"],
        "prefix_cache_hits": stats.prefix_cache_hits,
        "cached_kv_blocks": stats.cached_kv_blocks,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prefix-tokens", type=int, default=600)
    ap.add_argument("--suffix-tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    prompts = prefix_prompts(args.requests + 1, args.prefix_tokens, args.suffix_tokens, args.model)[
        "shared"
    ]
    ratios = []
    for r in range(args.rounds):
        rows = {}
        for caching in (True, False) if r % 2 == 0 else (False, True):
            row = trio.run(run_case, args.model, prompts, caching, args.max_tokens)
            rows[caching] = row
            print(json.dumps({"round": r, **row}), flush=True)
        ratios.append(rows[False]["ttft_p50_s"] / rows[True]["ttft_p50_s"])
    print(
        f"TTFT p50 off / on: {statistics.mean(ratios):.2f} "
        f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
