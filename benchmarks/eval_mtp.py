"""MTP draft quality on held-out files: agreement with the target's own greedy tokens.

For random contexts cut from the held-out split, the target picks its greedy
continuation g1, g2, ... and the MTP layer drafts d2, d3, ... (substep j feeds its own
hidden state and token into substep j+1). Reported per substep:

- ``agreement``: share of contexts where d_j equals the target's g_j;
- ``accepted``: share where every draft up to j matched (what greedy verification keeps).

``num_model_steps = n`` uses substeps 1..n; ``mean_accept_len`` is the expected tokens
emitted per verify step with n drafts (accepted drafts plus the target's own token).

``--cost`` measures instead what a draft substep costs next to a target forward: the
paged serving forward at batch 1, one decode row after ``--cost-context`` tokens, median
of interleaved repetitions. ``--model-json`` measures a randomly initialised model of that
shape instead of a checkpoint (sizing a new target).

Run: ``python benchmarks/eval_mtp.py [--model bundled] [--contexts 512]`` or
``python benchmarks/eval_mtp.py --cost [--model bundled | --model-json '{...}']``.
Set ``OMP_NUM_THREADS`` in the environment: Paddle pins it to 1 at import otherwise,
and importing spectrio imports Paddle.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import cast

import numpy as np
from tqdm import tqdm

from spectrio.models import SpectrioForCausalLM, load, reference
from spectrio.models.architecture.config import DType
from spectrio.tools.cli.logging_setup import configure_logging
from spectrio.tools.training.corpus import held_out_contexts


def evaluate(
    model_name: str, dtype: str, count: int, length: int, max_steps: int, batch: int, seed: int
) -> dict[str, object]:
    loaded = load(model_name, dtype=cast(DType, dtype))
    contexts = held_out_contexts(loaded.tokenizer, count, length, seed)
    matches = []
    t0 = time.perf_counter()
    for start in tqdm(range(0, count, batch), desc="eval", unit="batch"):
        target, drafts = reference.greedy_mtp_drafts(
            loaded.model, contexts[start : start + batch].tolist(), max_steps
        )
        matches.append(drafts == target[:, 1:])
    hits = np.concatenate(matches)  # [count, max_steps]
    prefix = np.cumprod(hits, axis=1)
    by_steps = {}
    for n in range(1, max_steps + 1):
        by_steps[str(n)] = {
            "agreement": [round(float(x), 4) for x in hits[:, :n].mean(0)],
            "accepted": [round(float(x), 4) for x in prefix[:, :n].mean(0)],
            "mean_accept_len": round(1.0 + float(prefix[:, :n].sum(1).mean()), 4),
        }
    return {
        "model": str(loaded.path),
        "dtype": dtype,
        "contexts": count,
        "context_len": length,
        "seconds": round(time.perf_counter() - t0, 1),
        "num_model_steps": by_steps,
    }


def draft_cost(model: SpectrioForCausalLM, context: int = 64, reps: int = 300) -> dict[str, object]:
    """Median seconds of a batch-1 target decode forward and of one MTP substep (paged)."""
    from spectrio.models import PackedBatch, PagedKVCache
    from spectrio.models.ops.paddle_setup import paddle

    cfg = model.config
    block = 16
    blocks = context // block + 2
    target_cache = PagedKVCache(
        cfg.num_hidden_layers, blocks, block, cfg.num_key_value_heads, cfg.head_dim, model.dtype
    )
    mtp_cache = PagedKVCache(1, blocks, block, cfg.num_key_value_heads, cfg.head_dim, model.dtype)
    table = [np.arange(blocks)]

    def row() -> PackedBatch:
        b = PackedBatch.from_sequences([[5]], [context], table)
        b.logits_indices = b.last_rows()
        return b

    with paddle.no_grad():
        prefill = PackedBatch.from_sequences([list(range(1, context + 1))], [0], table)
        hidden = model.forward(prefill, target_cache).hidden
        model.mtp_forward(prefill, hidden, mtp_cache)
        last = hidden[-1:]
        target_s, mtp_s = [], []
        for i in range(reps + 20):  # interleaved, so load on a shared machine hits both
            t0 = time.perf_counter()
            model.forward(row(), target_cache)
            t1 = time.perf_counter()
            model.mtp_forward(row(), last, mtp_cache)
            t2 = time.perf_counter()
            if i >= 20:
                target_s.append(t1 - t0)
                mtp_s.append(t2 - t1)
    t, m = float(np.median(target_s)), float(np.median(mtp_s))
    return {
        "machine": f"{platform.machine()} cores={os.cpu_count()} "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}",
        "layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "context": context,
        "reps": reps,
        "target_forward_ms": round(t * 1e3, 3),
        "mtp_substep_ms": round(m * 1e3, 3),
        "substep_over_target": round(m / t, 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="bundled")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    p.add_argument("--contexts", type=int, default=512)
    p.add_argument("--context-len", type=int, default=96)
    p.add_argument("--max-steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cost", action="store_true", help="measure substep cost / target forward instead"
    )
    p.add_argument("--cost-context", type=int, default=64)
    p.add_argument("--cost-reps", type=int, default=300)
    p.add_argument(
        "--model-json", default=None, help="with --cost: a random model with these fields"
    )
    args = p.parse_args(argv)
    configure_logging("warning")
    if args.cost:
        if args.model_json:
            from spectrio.models import ModelConfig, build_model

            fields = {"vocab_size": 4096, "eos_token_id": 0, **json.loads(args.model_json)}
            model = build_model(ModelConfig(**fields), args.dtype, seed=0)
        else:
            model = load(args.model, dtype=args.dtype).model
        print(json.dumps(draft_cost(model, args.cost_context, args.cost_reps), indent=2))
        return 0
    result = evaluate(
        args.model,
        args.dtype,
        args.contexts,
        args.context_len,
        args.max_steps,
        args.batch,
        args.seed,
    )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
