"""Model-level figures: µs and Paddle ops per serving forward (target and one MTP
substep), checkpoint load time, and optionally the reference generator's speed.

Run: ``python benchmarks/bench_models.py [--model bundled] [--rows 1 4 16 64]
[--threads N] [--reference]``.

Each forward case is a decode step as the verify stage runs it: ``rows`` sequences with
64 tokens of context in the paged cache, one new row each, logits for every row. The
MTP case is one draft substep over the same rows, as the proposer runs it (over the
draft vocabulary where the model has one, with the draft side's float16 weights), and
``mtp_f32`` the same with float32 draft weights.
Cases alternate in rounds and the median is reported, so a busy machine slows every case
alike. Ops are counted with ``paddle.profiler`` (top-level operator events per forward),
plus spectrio's custom ops, which the profiler does not record.
``--paddle-layers`` adds each target case with its layers run op by op in Paddle
(``paddle_target_rowsN``, the path before the native layer op), alternated with the rest.
``--reference`` adds the oracle's speed (dense attention, one token at a time, batch 1).
Each target case is also read against its memory floor (``spectrio.models.ops.memory_floor``):
the bytes it reads (weights, and each row's KV) at the read bandwidth probed in this run,
before and after the timed rounds (the best pass of either); ``target_rowsN_over_floor``
is the forward's median time over that floor.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np

CONTEXT = 64
BLOCK = 16


def _count_ops(fn: Callable[[], object], calls: int = 5) -> int:
    """Top-level ops per call of ``fn``: Paddle's, from its profiler, and spectrio's
    custom ops (which the profiler does not record), counted at their entry point."""
    from spectrio.models.ops import native_ops
    from spectrio.models.ops.paddle_setup import paddle

    real = native_ops._C_OPS
    custom = 0

    class Counting:
        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

        def _run_custom_op(self, *args: object) -> object:
            nonlocal custom
            custom += 1
            return real._run_custom_op(*args)

    profiler = paddle.profiler
    native_ops._C_OPS = Counting()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            prof = profiler.Profiler(
                targets=[profiler.ProfilerTarget.CPU],
                on_trace_ready=profiler.export_chrome_tracing(tmp),
            )
            prof.start()
            for _ in range(calls):
                fn()
            prof.stop()
            with open(max(glob.glob(f"{tmp}/*.json"), key=os.path.getmtime)) as fh:
                events = json.load(fh)
    finally:
        native_ops._C_OPS = real
    events = events["traceEvents"] if isinstance(events, dict) else events
    ops = sorted(
        (e for e in events if e.get("cat") == "Operator" and e.get("ph") == "X"),
        key=lambda e: (e["tid"], e["ts"]),
    )
    top = 0
    end_by_tid: dict[int, float] = collections.defaultdict(lambda: -1.0)
    for e in ops:  # nested ops (inside another op on the same thread) do not count
        if e["ts"] >= end_by_tid[e["tid"]]:
            top += 1
            end_by_tid[e["tid"]] = e["ts"] + e.get("dur", 0.0)
    return round((top + custom) / calls)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="bundled")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=30, help="forwards per case per round")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--reference", action="store_true", help="also time the reference generator")
    p.add_argument(
        "--paddle-layers",
        action="store_true",
        help="also time each target case with its layers op by op in Paddle (paddle_target_*)",
    )
    p.add_argument("--max-tokens", type=int, default=128, help="reference tokens per prompt")
    args = p.parse_args(argv)

    from spectrio.models import PackedBatch, PagedKVCache, load
    from spectrio.models.ops.paddle_setup import configure_paddle, paddle
    from spectrio.tools.cli.logging_setup import configure_logging

    configure_logging("warning")
    from spectrio.core.config import RuntimeConfig

    threads = configure_paddle(RuntimeConfig(num_threads=args.threads).resolve_num_threads())
    t0 = time.perf_counter()
    # A runtime's own load (a GGUF file served from its blocks), unless the op-by-op
    # Paddle path is timed too, which needs the float weights.
    loaded = load(args.model, serving=not args.paddle_layers)
    load_seconds = time.perf_counter() - t0
    model = loaded.model
    cfg = model.config
    rng = np.random.default_rng(0)
    cases: dict[str, Callable[[], object]] = {}
    for rows in args.rows:
        per_seq = -(-(CONTEXT + 1) // BLOCK)
        cache = PagedKVCache(
            cfg.num_hidden_layers,
            rows * per_seq + 1,
            BLOCK,
            cfg.num_key_value_heads,
            cfg.head_dim,
            model.dtype,
        )
        mtp_cache = PagedKVCache(
            1, rows * per_seq + 1, BLOCK, cfg.num_key_value_heads, cfg.head_dim, model.dtype
        )
        tables = [np.arange(1 + i * per_seq, 1 + (i + 1) * per_seq) for i in range(rows)]
        ctx = rng.integers(1, cfg.vocab_size, size=(rows, CONTEXT))
        nxt = rng.integers(1, cfg.vocab_size, size=rows)
        with paddle.no_grad():
            model.forward(
                PackedBatch.from_sequences([list(r) for r in ctx], [0] * rows, tables), cache
            )

        def target(
            cache: PagedKVCache = cache, tables: list = tables, nxt: np.ndarray = nxt
        ) -> object:
            batch = PackedBatch.from_sequences(
                [[int(t)] for t in nxt], [CONTEXT] * len(nxt), tables
            )
            with paddle.no_grad():
                return model.forward(batch, cache).logits

        hidden = paddle.randn([rows, cfg.hidden_size]).astype(model.dtype)

        def mtp(
            cache: PagedKVCache = mtp_cache,
            tables: list = tables,
            nxt: np.ndarray = nxt,
            hidden: object = hidden,
        ) -> object:
            batch = PackedBatch.from_sequences(
                [[int(t)] for t in nxt], [CONTEXT] * len(nxt), tables
            )
            with paddle.no_grad():
                out = model.mtp_forward(batch, hidden, cache, draft_vocab=True)  # type: ignore[arg-type]
                return out.logits

        cases[f"target_rows{rows}"] = target
        if args.paddle_layers:

            def op_by_op(target: Callable[[], object] = target) -> object:
                model.native_layers = False
                try:
                    return target()
                finally:
                    model.native_layers = True

            cases[f"paddle_target_rows{rows}"] = op_by_op
        if model.mtp is not None:
            cases[f"mtp_rows{rows}"] = mtp
            if model.draft_half and not model.serving_only:  # repacking needs the weights
                cases[f"mtp_f32_rows{rows}"] = mtp  # run with float32 draft weights
    half = model.draft_half

    def precision_for(name: str) -> None:
        """The draft weights' precision an MTP case runs with (repacked on a change, and
        outside the timing: the pass right after packs them)."""
        want = half and not name.startswith("mtp_f32")
        if name.startswith("mtp") and model.draft_half != want:
            model.set_draft_precision(want)
            cases[name]()  # the first pass after a change packs the weights

    for name, fn in cases.items():
        precision_for(name)
        for _ in range(5):
            fn()
    from spectrio.models.ops.memory_floor import floor_us, forward_bytes, read_bandwidth

    probes = [read_bandwidth(threads=threads or 1)]
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            precision_for(name)
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            times[name].append((time.perf_counter() - t0) / args.calls * 1e6)
    probes.append(read_bandwidth(threads=threads or 1))
    bandwidth = max(probes, key=lambda b: b.best_gb_s)
    result: dict[str, object] = {
        "machine": f"{platform.machine()} cores={os.cpu_count()}",
        "paddle": paddle.__version__,
        "threads": threads,
        "model": args.model,
        "layers": cfg.num_hidden_layers,
        "params": sum(int(np.prod(p.shape)) for p in model.parameters()),
        "load_seconds": round(load_seconds, 3),
        "read_gb_s": [b.best_gb_s for b in probes],
        "read_method": bandwidth.method,
    }
    for name, fn in cases.items():
        precision_for(name)
        result[f"{name}_us"] = round(statistics.median(times[name]), 1)
        result[f"{name}_ops"] = _count_ops(fn)
    weight_bytes = np.dtype(model.dtype).itemsize
    served = _served_block_bytes(loaded)
    result["weights_read_bytes"] = served or forward_bytes(cfg, [], weight_bytes=weight_bytes)
    for rows in args.rows:
        read = forward_bytes(
            cfg,
            [CONTEXT + 1] * rows,
            weight_bytes=weight_bytes,
            kv_bytes=weight_bytes,
            weights_total=served,
        )
        floor = floor_us(read, bandwidth)
        result[f"target_rows{rows}_bytes"] = read
        result[f"target_rows{rows}_floor_us"] = round(floor, 1)
        result[f"target_rows{rows}_over_floor"] = round(
            result[f"target_rows{rows}_us"] / floor,  # type: ignore[operator]
            3,
        )
    for rows in args.rows:
        if f"mtp_rows{rows}_us" in result:
            ratio = result[f"mtp_rows{rows}_us"] / result[f"target_rows{rows}_us"]  # type: ignore[operator]
            result[f"mtp_over_target_rows{rows}"] = round(ratio, 3)
    if args.reference:
        result.update(_reference_speed(args.model, args.max_tokens))
    print(json.dumps(result, indent=1))
    return 0


def _served_block_bytes(loaded: object) -> int | None:
    """Weight bytes a forward reads when ``loaded`` serves a GGUF file's blocks."""
    from spectrio.models.loading.block_serving import served_weight_bytes
    from spectrio.models.loading.gguf_file import GGUFFile

    model = loaded.model  # type: ignore[attr-defined]
    path = loaded.path  # type: ignore[attr-defined]
    if not model.serving_only or not path.is_file():
        return None
    if not model.model.layers[0].mlp._down_weight.blocks:
        return None
    return served_weight_bytes(GGUFFile(path), loaded.config)  # type: ignore[attr-defined]


def _reference_speed(model_name: str, max_tokens: int) -> dict[str, float]:
    from spectrio.models import load, reference

    prompts = ["def fib(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n"]
    out: dict[str, float] = {}
    for dtype in ("float32", "float64"):
        loaded = load(model_name, dtype=dtype)
        assert loaded.tokenizer is not None
        tokens, t0 = 0, time.perf_counter()
        for prompt in prompts:
            run = reference.greedy_generate(
                loaded.model, loaded.tokenizer.encode(prompt), max_tokens
            )
            tokens += len(run.token_ids)
        out[f"reference_tokens_per_second_{dtype}"] = round(tokens / (time.perf_counter() - t0), 1)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
