"""The step record's cost per step: the NumPy path, the GPU paths and the copy floor.

    python benchmarks/bench_record.py [--json out.json] [--batch 1 16 256 1024] [--k 3 8]

For each batch, k and logprob setting (none, top-20), every slot emitting k + 1 tokens
(the largest record), it times per step, host clock around the whole call:

* ``numpy``: the CPU path, :func:`spectrio.cuda_kernels.reference.pack_step_record` on host arrays;
* ``wrapped``: ``speculate_save_any`` + ``pack_topk_any`` on torch tensors handed over
  through DLPack every step (the ad-hoc device path);
* ``graph`` / ``raw``: :class:`~spectrio.cuda_kernels.RecordWriter`, mapped pinned
  output, replaying its captured graph / launching the kernel directly;
* ``copy``: the writer in copy mode (device buffer, then one bounded pinned copy), graph;
* ``graph_4sm``: ``graph`` with the grid capped at 4 blocks per multiprocessor
  instead of 2;
* ``floor``: one launch of an empty kernel, one pinned copy of a record of the same size
  from device memory, one sync.

Variants alternate within each round; each figure is the median over every round's
steps, and ``ratio`` is a variant's median over the floor's. Every GPU variant's bytes
are checked against the NumPy record first. Without a GPU it times the NumPy path and
says why there is no GPU path. ``--sanitize`` runs each writer variant on a few small
steps with no timing, for compute-sanitizer.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from spectrio.core.config import BASE_CAPTURE_SIZES
from spectrio.cuda_kernels import (
    KIND_TARGET,
    RecordInputs,
    RecordWriter,
    pack_topk_any,
    record_capture_sizes,
    speculate_save_any,
)
from spectrio.cuda_kernels.record_layout import compact_rows
from spectrio.cuda_kernels.reference import (
    HEADER_WORDS,
    expand_per_token,
    pack_step_record,
    record_width,
)

TOP = 20
W_MAX = TOP + 1


def _gpu() -> tuple[Any, str]:
    """(cupy, "") when a device is usable, else (None, why not)."""
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - any failure means no GPU path
        return None, f"CuPy cannot be imported ({exc})"
    try:
        if not cupy.cuda.is_available():
            return None, "CuPy finds no CUDA device"
    except Exception as exc:  # noqa: BLE001
        return None, f"CuPy cannot reach a device ({exc})"
    return cupy, ""


def make_step(bsz: int, k: int, logprobs: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    cols = k + 1
    return {
        "accepted_tokens": rng.integers(0, 49152, size=(bsz, cols)).astype(np.int32),
        "accept_counts": np.full(bsz, cols, dtype=np.int32),
        "preempted": np.zeros(bsz, dtype=bool),
        "seq_lens_decoder": np.full(bsz, 64, dtype=np.int32),
        "prompt_lens": np.full(bsz, 48, dtype=np.int32),
        "topn": np.full(bsz, TOP if logprobs else -1, dtype=np.int32),
        "topk_ids": rng.integers(0, 49152, size=(bsz, cols, W_MAX)).astype(np.int32),
        "topk_vals": (-rng.exponential(3.0, size=(bsz, cols, W_MAX))).astype(np.float32),
        "ranks": rng.integers(1, 100, size=(bsz, cols)).astype(np.int32),
    }


HEAD = ("accepted_tokens", "accept_counts", "preempted", "seq_lens_decoder", "prompt_lens")


def numpy_record(step: dict[str, np.ndarray]) -> bytes:
    """The CPU path: candidates arrive in record order, as the host sampler gives them."""
    lp = int(step["topn"].max(initial=-1)) >= 0
    accept = np.maximum(step["accept_counts"], 0)
    return pack_step_record(
        *(step[n] for n in HEAD),
        kind=KIND_TARGET,
        logprobs=step["topn"] if lp else None,
        topk_ids=compact_rows(step["topk_ids"], accept) if lp else None,
        topk_vals=compact_rows(step["topk_vals"], accept) if lp else None,
        ranks=compact_rows(step["ranks"], accept) if lp else None,
    )


def time_calls(fn: Callable[[], Any], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1000.0)
    return out


class GpuCase:
    """Every GPU variant for one (batch, k, logprobs) case, over the same device data."""

    def __init__(self, cp: Any, step: dict[str, np.ndarray], expected: bytes) -> None:
        self.cp = cp
        self.stream = cp.cuda.Stream(non_blocking=True)
        bsz, cols = step["accepted_tokens"].shape
        self.bsz, self.cols = bsz, cols
        self.width = record_width(step["topn"])
        self.expected = expected
        with self.stream:
            self.dev = {name: cp.asarray(arr) for name, arr in step.items()}
        self.stream.synchronize()
        sizes = record_capture_sizes(BASE_CAPTURE_SIZES, bsz)
        inputs = RecordInputs(**self.dev)
        self.writers = {
            "graph": RecordWriter(inputs, stream=self.stream, capture_sizes=sizes),
            "raw": RecordWriter(inputs, stream=self.stream, capture_sizes=sizes, graphs=False),
            "copy": RecordWriter(inputs, stream=self.stream, capture_sizes=sizes, mode="copy"),
            "graph_4sm": RecordWriter(
                inputs, stream=self.stream, capture_sizes=sizes, blocks_per_sm=4
            ),
        }
        try:
            if os.environ.get("BENCH_RECORD_NO_TORCH"):
                raise ImportError("torch left out")
            import torch

            self.torch: dict[str, Any] | None = {
                n: torch.from_dlpack(a) for n, a in self.dev.items()
            }
            accept = np.maximum(step["accept_counts"], 0)
            self.torch_rows = {
                n: torch.from_numpy(compact_rows(step[n], accept)).cuda()
                for n in ("topk_ids", "topk_vals", "ranks")
            }
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - the wrapped path then takes CuPy arrays
            self.torch = None
            self.torch_rows = {
                n: cp.asarray(compact_rows(step[n], np.maximum(step["accept_counts"], 0)))
                for n in ("topk_ids", "topk_vals", "ranks")
            }
        self.topn_host = step["topn"]
        nbytes = len(expected)
        self.floor_src = cp.zeros(max(nbytes // 4, 1), dtype=cp.int32)
        self.floor_dst = cp.cuda.alloc_pinned_memory(max(nbytes, 4))
        self.nbytes = nbytes
        self.noop = cp.RawKernel('extern "C" __global__ void noop() {}', "noop")

    def run(self, name: str) -> bytes | memoryview | None:
        if name in self.writers:
            rec = self.writers[name].write(
                self.bsz, cols=self.cols, kind=KIND_TARGET, width=self.width
            )
            rec.release()
            return rec.data
        if name == "wrapped":
            return self._wrapped()
        if name == "floor":
            self._floor()
            return None
        raise KeyError(name)

    def check(self, name: str) -> None:
        if name in self.writers:
            rec = self.writers[name].write(
                self.bsz, cols=self.cols, kind=KIND_TARGET, width=self.width
            )
            got = rec.data.tobytes()
            rec.release()
        else:
            got = self._wrapped()
        if got != self.expected:
            raise AssertionError(f"{name}: record differs from the NumPy path")

    def _wrapped(self) -> bytes:
        src = self.torch if self.torch is not None else self.dev
        head = speculate_save_any(
            *(src[n] for n in HEAD), kind=KIND_TARGET, width=self.width, stream=self.stream
        )
        if self.width == 0:
            return head.tobytes()
        bsz = int(head[2])
        topn = expand_per_token(self.topn_host, head[HEADER_WORDS : HEADER_WORDS + bsz])
        rows = self.torch_rows
        block = pack_topk_any(
            rows["topk_ids"],
            rows["topk_vals"],
            rows["ranks"],
            topn,
            self.width,
            stream=self.stream,
        )
        return b"".join([head.tobytes(), *(b.tobytes() for b in block)])

    def _floor(self) -> None:
        cp, stream = self.cp, self.stream
        with stream:
            self.noop((1,), (32,), ())
        cp.cuda.runtime.memcpyAsync(
            self.floor_dst.ptr,
            self.floor_src.data.ptr,
            self.nbytes,
            cp.cuda.runtime.memcpyDeviceToHost,
            stream.ptr,
        )
        stream.synchronize()

    def close(self) -> None:
        for w in self.writers.values():
            w.close()


def machine(cp: Any) -> dict[str, Any]:
    info: dict[str, Any] = {"host": platform.node(), "python": platform.python_version()}
    if cp is not None:
        props = cp.cuda.runtime.getDeviceProperties(0)
        name = props["name"]
        info.update(
            gpu=name.decode() if isinstance(name, bytes) else str(name),
            cupy=cp.__version__,
            cuda_runtime=cp.cuda.runtime.runtimeGetVersion(),
            driver=cp.cuda.runtime.driverGetVersion(),
        )
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 256, 1024])
    parser.add_argument("--k", type=int, nargs="+", default=[3, 8])
    parser.add_argument("--reps", type=int, default=300, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--sanitize", action="store_true", help="a few untimed steps")
    args = parser.parse_args(argv)

    cp, why = _gpu()
    gpu_variants = ["wrapped", "graph", "raw", "copy", "graph_4sm", "floor"]
    if args.sanitize:
        # The writer's paths only: the wrapped path copies its whole capacity buffer,
        # which initcheck reports by design of that path.
        args.batch, args.k, args.reps, args.rounds = [1, 16, 300], [3], 2, 1
        gpu_variants = ["graph", "raw", "copy", "graph_4sm", "floor"]
    variants = ["numpy"] + (gpu_variants if cp else [])
    results: list[dict[str, Any]] = []
    for bsz in args.batch:
        for k in args.k:
            for logprobs in (False, True):
                step = make_step(bsz, k, logprobs)
                expected = numpy_record(step)
                case = GpuCase(cp, step, expected) if cp else None
                if case is not None:
                    for name in gpu_variants:
                        if name != "floor":
                            case.check(name)
                times: dict[str, list[float]] = {v: [] for v in variants}
                for _ in range(args.rounds):
                    for v in variants:
                        fn: Callable[[], Any]
                        if v == "numpy":
                            fn = functools.partial(numpy_record, step)
                        else:
                            assert case is not None
                            fn = functools.partial(case.run, v)
                        time_calls(fn, max(args.reps // 10, 1))  # warm
                        times[v] += time_calls(fn, args.reps)
                if case is not None:
                    case.close()
                med = {v: statistics.median(ts) for v, ts in times.items()}
                row: dict[str, Any] = {
                    "batch": bsz,
                    "k": k,
                    "logprobs": f"top-{TOP}" if logprobs else "none",
                    "record_bytes": len(expected),
                    "median_us": {v: round(m, 2) for v, m in med.items()},
                }
                if "floor" in med:
                    row["ratio_to_floor"] = {
                        v: round(m / med["floor"], 3) for v, m in med.items() if v != "floor"
                    }
                results.append(row)
                print(
                    f"batch {bsz:5d} k {k} {row['logprobs']:>6} {len(expected):>9,d} B  "
                    + "  ".join(f"{v} {m:8.1f}" for v, m in med.items()),
                    file=sys.stderr,
                    flush=True,
                )
    out = {
        "machine": machine(cp),
        "gpu_path": bool(cp),
        "why_no_gpu": why or None,
        "reps": args.reps,
        "rounds": args.rounds,
        "results": results,
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    print(json.dumps(out, indent=1))
    if not cp:
        print(f"no GPU path: {why}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
