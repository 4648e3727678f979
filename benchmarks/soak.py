"""Soak benchmark: does a long-running embedding keep its memory and its latency?

Runs ``--n`` requests through one runtime (``--concurrency`` at a time) after a warm-up
of ``--warmup`` requests, and reports:

* resident memory (RSS) after each request, and its growth per request: a robust slope
  through the second half of the run (the first half settles caches and arenas);
* the longest pause of Python's garbage collector (``gc.callbacks``), and how many
  collections ran.

Run: ``python benchmarks/soak.py --n 1000 [--concurrency 4] [--max-tokens 16]
[--json out.json]``. The issue's bar: under 1 KB per request at N = 1,000, and no
collector pause over 50 ms. CI runs it at a small N with a loose bound
(``tests/test_soak.py``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time
from typing import Any

import numpy as np
import trio

from spectrio.core.config import RuntimeConfig
from spectrio.core.params import SamplingParams

PROMPTS = ("def fib(n):", "import os\nimport sys\n", "class Stack:\n", "for i in range(10):")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class GcPauses:
    """Wall time of every collection, through ``gc.callbacks``."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._t0)

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def slope_per_request(rss: list[int]) -> float:
    """Bytes per request over the second half of ``rss``: the Theil-Sen slope (median of
    the slopes between every pair of points), which a one-off jump (an arena doubling, the
    allocator returning memory) does not move, where a least-squares line would."""
    half = np.asarray(rss[len(rss) // 2 :], dtype=np.float64)
    if half.size < 2:
        return 0.0
    i, j = np.triu_indices(half.size, k=1)
    return float(np.median((half[j] - half[i]) / (j - i)))


async def soak(
    config: RuntimeConfig, n: int, *, concurrency: int = 1, warmup: int = 20, max_tokens: int = 16
) -> dict[str, Any]:
    from spectrio.runtime.api import open_runtime

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rss: list[int] = []
    async with open_runtime(config) as rt:

        async def one(i: int) -> None:
            async for _ in rt.generate(PROMPTS[i % len(PROMPTS)], params):
                pass

        async def run(count: int, record: bool) -> None:
            done = 0
            limit = trio.Semaphore(concurrency)

            async def guarded(i: int) -> None:
                nonlocal done
                async with limit:
                    await one(i)
                done += 1
                if record:
                    rss.append(rss_bytes())

            async with trio.open_nursery() as nursery:
                for i in range(count):
                    await limit.acquire()  # admit one more only when a slot is free
                    limit.release()
                    nursery.start_soon(guarded, i)

        await run(warmup, False)
        gc.collect()
        rss0 = rss_bytes()
        t0 = time.perf_counter()
        with GcPauses() as pauses:
            await run(n, True)
        wall = time.perf_counter() - t0
    return {
        "machine": platform.machine(),
        "n": n,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "wall_s": round(wall, 3),
        "rss_start_mb": round(rss0 / 2**20, 2),
        "rss_end_mb": round(rss[-1] / 2**20, 2) if rss else None,
        "bytes_per_request": round(slope_per_request(rss), 1),
        "gc_collections": len(pauses.pauses),
        "gc_max_pause_ms": round(max(pauses.pauses, default=0.0) * 1000, 2),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="bundled")
    ap.add_argument("--n", type=int, default=1000, help="requests measured")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    cfg = RuntimeConfig(model=args.model, max_model_len=256)
    res = trio.run(
        lambda: soak(
            cfg,
            args.n,
            concurrency=args.concurrency,
            warmup=args.warmup,
            max_tokens=args.max_tokens,
        )
    )
    for key, value in res.items():
        print(f"{key:>18}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
