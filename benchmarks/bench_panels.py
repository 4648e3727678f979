"""One weight product, MKL's SGEMM against spectrio's panel kernel, per row count.

Each case multiplies ``rows`` inputs by a ``[K, N]`` float32 weight through Paddle's
``matmul`` (MKL) and through :class:`spectrio.models.ops.serving_matrix.ServingMatrix` (the
panel kernel), cycling over ``--copies`` copies of the weight so that, as in a forward
over every layer, the weights come from memory rather than the cache. Cases alternate
within each round; the medians over ``--rounds`` are printed, one JSON object per case.

Run: ``python benchmarks/bench_panels.py [--shapes 576x960 576x576 576x3072 1536x576
576x49152] [--rows 1 2 4 8 16 64] [--threads 2]``. The shapes are SmolLM2's fused q/k/v,
o, fused gate/up, down and its LM head.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shapes", nargs="+", default=["576x960", "576x576", "576x3072", "1536x576",
                                                   "576x49152"])  # fmt: skip
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=24)
    p.add_argument("--copies-mb", type=int, default=96, help="weight copies to cycle over, MB")
    args = p.parse_args()

    from spectrio.models.ops import fast_ops as fo
    from spectrio.models.ops.native_ops import native_ops_available
    from spectrio.models.ops.paddle_setup import configure_paddle, paddle
    from spectrio.models.ops.serving_matrix import ServingMatrix

    configure_paddle(args.threads)
    if not native_ops_available():
        raise SystemExit("spectrio's native kernels are not available here")
    rng = np.random.default_rng(0)
    for shape in args.shapes:
        k, n = map(int, shape.split("x"))
        copies = max(1, (args.copies_mb << 20) // (4 * k * n))
        weights = [rng.standard_normal((k, n), dtype=np.float32) for _ in range(copies)]
        plain = [paddle.to_tensor(w) for w in weights]
        packed = [ServingMatrix(w) for w in weights]
        for rows in args.rows:
            x = paddle.to_tensor(rng.standard_normal((rows, k), dtype=np.float32))
            times: dict[str, list[float]] = {"mkl": [], "panels": []}
            with paddle.no_grad():
                for _ in range(args.rounds):
                    t0 = time.perf_counter()
                    for i in range(args.calls):
                        fo.matmul(x, plain[i % copies])
                    times["mkl"].append((time.perf_counter() - t0) / args.calls * 1e3)
                    t0 = time.perf_counter()
                    for i in range(args.calls):
                        packed[i % copies].matmul(x)
                    times["panels"].append((time.perf_counter() - t0) / args.calls * 1e3)
            mkl, panels = (statistics.median(times[c]) for c in ("mkl", "panels"))
            print(json.dumps({"k": k, "n": n, "rows": rows, "copies": copies,
                              "mkl_ms": round(mkl, 3), "panels_ms": round(panels, 3),
                              "mkl_over_panels": round(mkl / panels, 2)}), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
