"""The cost of handing work to the device thread and getting the answer back.

Compares, round trip from a Trio task, for a no-op device call:

* ``to_thread``: ``trio.to_thread.run_sync`` behind a ``CapacityLimiter(1)`` (the first
  phase paid three per step: draft, verify, sample);
* ``worker``: a persistent thread fed by a ``queue.SimpleQueue``, answering through
  ``TrioToken.run_sync_soon`` into a memory channel (what
  :class:`spectrio.runtime.device_worker.DeviceWorker` does once per step).

Run: ``python -m spectrio.tools.bench_hop [--n 5000] [--rounds 5]``. Rounds alternate the
two cases; the medians of the per-round means are reported, in microseconds.
"""

from __future__ import annotations

import argparse
import math
import queue
import statistics
import threading
import time

import trio


async def _to_thread(n: int) -> float:
    limiter = trio.CapacityLimiter(1)
    t0 = time.perf_counter()
    for _ in range(n):
        await trio.to_thread.run_sync(int, limiter=limiter)
    return (time.perf_counter() - t0) / n


async def _worker(n: int) -> float:
    jobs: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    send, receive = trio.open_memory_channel[int](math.inf)
    token = trio.lowlevel.current_trio_token()

    def run() -> None:
        while (job := jobs.get()) is not None:
            token.run_sync_soon(send.send_nowait, job)

    thread = threading.Thread(target=run)
    thread.start()
    t0 = time.perf_counter()
    for i in range(n):
        jobs.put(i)
        await receive.receive()
    elapsed = (time.perf_counter() - t0) / n
    jobs.put(None)
    thread.join()
    return elapsed


async def _main(n: int, rounds: int) -> dict[str, float]:
    got: dict[str, list[float]] = {"to_thread": [], "worker": []}
    for _ in range(rounds):
        got["to_thread"].append(await _to_thread(n))
        got["worker"].append(await _worker(n))
    return {k: statistics.median(v) * 1e6 for k, v in got.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=5000, help="round trips per case and round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    res = trio.run(_main, args.n, args.rounds)
    for name, us in res.items():
        print(f"{name:>10}: {us:7.1f} us per round trip")
    print(f"     ratio: {res['to_thread'] / res['worker']:.2f}x")


if __name__ == "__main__":
    main()
