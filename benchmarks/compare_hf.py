"""Side by side with Hugging Face transformers on the same checkpoint and prompts.

1. **Equality** (float64): transformers' greedy ``generate`` and spectrio's pipeline
   (no speculation, and each ``--k``) emit the same tokens for every prompt.
2. **Speed** (float32): output tokens per second of transformers' greedy loop and of
   spectrio at each batch size, both on ``--threads`` threads, in interleaved rounds;
   medians are reported with their ratio to transformers.

The checkpoint names its target as a Llama (``model_type: llama``); transformers reads
it with ``LlamaForCausalLM`` and ignores the MTP layer's tensors. Prompts are held-out
code windows of equal length, and both sides ignore EOS, so no padding is involved.

torch and transformers are not spectrio dependencies. Run this in a scratch
environment: ``pip install torch==2.13.0`` (a CPU build), then
``pip install -e '.[compare]'`` and ``python benchmarks/compare_hf.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, cast

import trio

from spectrio.models.loading.loader import resolve_path
from spectrio.models.ops.paddle_setup import configure_paddle
from spectrio.tools.measurement.bench import bench_prompts, run_case


def _hf_model(folder: Path, dtype: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the MTP tensors are "unused weights" to transformers
    torch_dtype = {"float32": torch.float32, "float64": torch.float64}[dtype]
    model = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch_dtype)
    model.eval()
    return model


def hf_generate(
    model: Any, prompts: list[list[int]], max_tokens: int
) -> tuple[list[list[int]], float]:
    """Greedy continuation of every prompt in one batch; returns (tokens, seconds)."""
    import torch

    ids = torch.tensor(prompts, dtype=torch.long)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    seconds = time.perf_counter() - t0
    return out[:, ids.shape[1] :].tolist(), seconds


def spectrio_generate(
    model: str, dtype: str, k: int, prompts: list[list[int]], max_tokens: int
) -> tuple[list[list[int]], float]:
    row = trio.run(run_case, model, dtype, k, len(prompts), prompts, max_tokens)
    outputs = cast(list[list[int]], row["outputs"])
    return outputs, cast(float, row["seconds"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="bundled")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument(
        "--k", type=int, nargs="+", default=[0, 2], help="spectrio settings; 0 is no speculation"
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--equality-prompts", type=int, default=4)
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    configure_paddle(args.threads)
    folder = resolve_path(args.model)
    prompts = bench_prompts(
        max(max(args.batch), args.equality_prompts), args.prompt_tokens, args.model
    )
    result: dict[str, Any] = {
        "machine": f"{platform.machine()} cores={os.cpu_count()}",
        "threads": args.threads,
        "torch": torch.__version__,
        "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens,
    }

    eq_prompts = prompts[: args.equality_prompts]
    want, _ = hf_generate(_hf_model(folder, "float64"), eq_prompts, args.max_tokens)
    equal: dict[str, bool] = {}
    for k in args.k:
        got, _ = spectrio_generate(args.model, "float64", k, eq_prompts, args.max_tokens)
        equal[f"k{k}"] = got == want
        print(f"float64 greedy, k={k}: tokens equal to transformers: {equal[f'k{k}']}", flush=True)
    result["float64_tokens_equal"] = equal

    hf = _hf_model(folder, "float32")
    times: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for b in args.batch:
            batch_prompts = prompts[:b]
            _, sec = hf_generate(hf, batch_prompts, args.max_tokens)
            times.setdefault(f"hf_b{b}", []).append(b * args.max_tokens / sec)
            for k in args.k:
                _, sec = spectrio_generate(args.model, "float32", k, batch_prompts, args.max_tokens)
                times.setdefault(f"spectrio_k{k}_b{b}", []).append(b * args.max_tokens / sec)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    print(f"\n{'batch':>5} {'case':>14} {'tok/s':>9} {'vs hf':>7}")
    for b in args.batch:
        hf_tps = statistics.median(times[f"hf_b{b}"])
        result[f"hf_b{b}_tokens_per_second"] = round(hf_tps, 1)
        print(f"{b:>5} {'transformers':>14} {hf_tps:>9.1f} {1.0:>7.2f}")
        for k in args.k:
            tps = statistics.median(times[f"spectrio_k{k}_b{b}"])
            result[f"spectrio_k{k}_b{b}_tokens_per_second"] = round(tps, 1)
            result[f"spectrio_k{k}_b{b}_vs_hf"] = round(tps / hf_tps, 3)
            label = "spectrio k=off" if k == 0 else f"spectrio k={k}"
            print(f"{b:>5} {label:>14} {tps:>9.1f} {tps / hf_tps:>7.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if all(equal.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
