"""GGUF block products (``models/ops/csrc/block_kernels.h``) against the float32 panel product.

For each block type and row count, ``spectrio_block_matmul`` over a weight kept as GGUF
blocks the way the serving matrices keep them (``ServingMatrix.from_blocks``: the tiled
layout of 8 columns for all but Q5_K), over the same blocks as stored (the kernel
Q5_K runs, ``stored``), and ``spectrio_panel_matmul`` over the same shape
in float32 panels, cycling over
enough copies of each weight (``--copies-mb``) that they come from memory, not the cache,
as in a forward over every layer. The cases alternate within each round; medians over
``--rounds`` are printed, one JSON object per case, after the read bandwidth probed in the
same run (``models/ops/memory_floor.py``), which is the memory floor at one row:

* ``block_gb_s`` / ``panel_gb_s``: weight bytes read per second, and ``*_of_bw`` that as a
  fraction of the probed bandwidth (1.0: at the memory floor);
* ``block_mac_cycle`` / ``panel_mac_cycle``: multiply-adds per cycle per thread, at the
  clock ``/proc/cpuinfo`` reports (a nominal figure: boost clocks make it a ratio, not an
  absolute);
* ``block_over_panel``: the panel product's time over the block product's (above 1: the
  blocks are faster); ``block_over_stored``: the stored blocks' time over the serving
  layout's (1.0 for Q5_K, which is served as stored).

Run: ``python benchmarks/bench_block_kernels.py [--types Q4_0 Q4_K ...] [--rows 1 4 16]
[--shapes 576x960 576x3072 576x49152 1536x576] [--threads 2]``. The shapes (``KxN``) are
SmolLM2-135M's fused q/k/v, fused gate|up, LM head and down; a K-quant's K is rounded up
to whole 256-element super-blocks (576 → 768: ``k_asked`` says so), and its panel product
is timed at that K too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

SHAPES = ["576x960", "576x3072", "576x49152", "1536x576"]


def _mhz() -> float:
    """The clock ``/proc/cpuinfo`` reports (MHz), or 1000 where it reports none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return float(line.partition(":")[2])
    except OSError:
        pass
    return 1000.0


def _ms_per_call(matrices: Sequence[Any], x: Any, calls: int) -> float:
    """Milliseconds per ``x @ matrix``, cycling over ``matrices``."""
    t0 = time.perf_counter()
    for i in range(calls):
        matrices[i % len(matrices)].matmul(x)
    return (time.perf_counter() - t0) / calls * 1e3


class _Stored:
    """Blocks as the file stores them, multiplied by the same op (its stored-layout
    kernel)."""

    def __init__(self, raw: np.ndarray, ggml_id: int) -> None:
        from spectrio.models.ops.paddle_setup import paddle

        self._w, self._type, self._n = paddle.to_tensor(raw), ggml_id, raw.shape[0]

    def matmul(self, x: Any) -> Any:
        from spectrio.models.ops.native_ops import block_matmul

        return block_matmul(x, self._w, self._type, self._n)


def _copies(nbytes: int, budget_mb: int) -> int:
    return max(2, (budget_mb << 20) // max(1, nbytes))


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--types", nargs="+", default=None, help="block types (default: all native)")
    p.add_argument("--shapes", nargs="+", default=SHAPES)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--copies-mb", type=int, default=96, help="weight copies to cycle over, MB")
    args = p.parse_args()

    from spectrio.models.ops import gguf_blocks as gb
    from spectrio.models.ops.memory_floor import read_bandwidth
    from spectrio.models.ops.native_ops import native_ops_available
    from spectrio.models.ops.paddle_setup import configure_paddle, paddle
    from spectrio.models.ops.serving_matrix import ServingMatrix

    configure_paddle(args.threads)
    if not native_ops_available():
        raise SystemExit("spectrio's native kernels are not available here")
    types = args.types or [t.name for t in gb.BLOCK_TYPES.values() if t.native]
    bw = read_bandwidth(256 << 20, passes=6, threads=args.threads)
    print(json.dumps({"bandwidth_gb_s": bw.best_gb_s, "median_gb_s": bw.median_gb_s,
                      "threads": args.threads, "mhz": _mhz()}), flush=True)  # fmt: skip
    hz = _mhz() * 1e6 * args.threads
    rng = np.random.default_rng(0)
    paddle.disable_static()
    with paddle.no_grad():
        for shape in args.shapes:
            k0, n = map(int, shape.split("x"))
            panels: dict[int, list[Any]] = {}
            for name in types:
                t = gb.BLOCK_TYPES[name]
                k = -(-k0 // t.elements) * t.elements  # K-quants: whole super-blocks
                if k not in panels:
                    panels[k] = [
                        ServingMatrix(rng.standard_normal((k, n), dtype=np.float32))
                        for _ in range(_copies(4 * k * n, args.copies_mb))
                    ]
                nbytes = n * t.row_bytes(k)
                raws = [
                    gb.synthetic_blocks(name, n, k, rng)
                    for _ in range(_copies(nbytes, args.copies_mb))
                ]
                blocks = [ServingMatrix.from_blocks(raw, name, k) for raw in raws]
                stored = [_Stored(raw, t.ggml_id) for raw in raws]
                for rows in args.rows:
                    x = paddle.to_tensor(rng.standard_normal((rows, k), dtype=np.float32))
                    cases: dict[str, Sequence[Any]] = {
                        "block": blocks,
                        "stored": stored,
                        "panel": panels[k],
                    }
                    times: dict[str, list[float]] = {c: [] for c in cases}
                    for _ in range(args.rounds):
                        for c, matrices in cases.items():
                            times[c].append(_ms_per_call(matrices, x, args.calls))
                    b_ms, s_ms, p_ms = (statistics.median(times[c]) for c in cases)
                    macs = rows * k * n
                    b_gb, p_gb = nbytes / b_ms / 1e6, 4 * k * n / p_ms / 1e6
                    print(json.dumps({
                        "type": name, "k": k, "n": n, "rows": rows, "k_asked": k0,
                        "block_ms": round(b_ms, 4), "stored_ms": round(s_ms, 4),
                        "panel_ms": round(p_ms, 4),
                        "block_gb_s": round(b_gb, 2), "panel_gb_s": round(p_gb, 2),
                        "block_of_bw": round(b_gb / bw.best_gb_s, 2),
                        "panel_of_bw": round(p_gb / bw.best_gb_s, 2),
                        "block_mac_cycle": round(macs / (b_ms * 1e-3) / hz, 2),
                        "panel_mac_cycle": round(macs / (p_ms * 1e-3) / hz, 2),
                        "block_over_panel": round(p_ms / b_ms, 2),
                        "block_over_stored": round(s_ms / b_ms, 2),
                    }), flush=True)  # fmt: skip
                del blocks, stored, raws
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
