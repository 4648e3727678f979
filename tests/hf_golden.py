"""Golden greedy tokens from Hugging Face transformers, the independent implementation
spectrio's architectures are checked against (tests/test_architectures.py,
tests/test_smollm2.py).

Run it in a scratch environment, never spectrio's (torch and transformers are not
dependencies)::

    python -m venv /work/scratch-hf && . /work/scratch-hf/bin/activate
    pip install torch==2.13.0 transformers gguf safetensors numpy
    python tests/hf_golden.py tiny            # writes tests/data/archs/
    python tests/hf_golden.py smollm2 FILE.gguf [--converted DIR]

``tiny`` makes one small random checkpoint per architecture case, deterministically
(numpy's generator with a fixed seed; the weights are drawn large enough that logits
are far from uniform), writes each as a Hugging Face folder, and records
transformers' float64 greedy continuation of fixed prompts in
``tests/data/archs/golden.json``.

``smollm2`` loads SmolLM2-135M-Instruct from its GGUF file through transformers' own
GGUF support (its own dequantization and q/k un-permutation), renders 5 chat prompts
with the file's template, and records the prompt ids and 48 greedy tokens each, in
float64, in ``tests/data/smollm2_golden.json``. With ``--converted DIR`` (a folder
``spectrio convert`` wrote) it also loads that folder with transformers and checks the
tokens are the same.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ARCH_DIR = HERE / "data" / "archs"
SMOLLM2_GOLDEN = HERE / "data" / "smollm2_golden.json"

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 96, 32, 2, 4, 2, 64
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79], [2, 71, 82, 81, 82, 84], [11, 12, 13, 14, 15]]
NEW_TOKENS = 24

# name -> (config.json, storage dtype, shards)
CASES: dict[str, tuple[dict[str, Any], str, int]] = {
    "llama": (
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
         "tie_word_embeddings": True},
        "float32", 1,
    ),
    "llama_bias_llama3": (
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
         "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False,
         "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
        "float32", 1,
    ),
    "llama_linear": (
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
         "tie_word_embeddings": True, "rope_scaling": {"type": "linear", "factor": 2.0}},
        "float16", 1,
    ),
    "llama_dynamic": (
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
         "tie_word_embeddings": True, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
        "float32", 1,
    ),
    "qwen2": (
        {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
         "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 4096,
         "max_window_layers": 2},
        "bfloat16", 3,
    ),
    "qwen3": (
        {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 16,
         "attention_bias": False, "tie_word_embeddings": True, "use_sliding_window": False},
        "float32", 2,
    ),
    "ernie4_5": (
        {"architectures": ["Ernie4_5ForCausalLM"], "model_type": "ernie4_5", "head_dim": 16,
         "use_bias": True, "tie_word_embeddings": True, "rope_theta": 500000.0},
        "float32", 1,
    ),
}  # fmt: skip


def tiny_config(extra: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "intermediate_size": FFN,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    cfg.update(extra)
    return cfg


def tiny_tensors(cfg: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Hugging Face tensors ([out, in]) for ``cfg``, drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    d, f = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    arch = cfg["architectures"][0]
    qkv_bias = cfg.get("attention_bias") or cfg.get("use_bias") or arch == "Qwen2ForCausalLM"
    o_bias = cfg.get("attention_bias") or cfg.get("use_bias")
    mlp_bias = cfg.get("mlp_bias") or cfg.get("use_bias")

    def w(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.4, size=shape)

    def norm(n: int) -> np.ndarray:
        return 1.0 + rng.normal(0.0, 0.1, size=n)

    out: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.normal(0.0, 0.3, (VOCAB, d))}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = norm(d)
        out[p + "post_attention_layernorm.weight"] = norm(d)
        for name, rows, cols in (("q", q, d), ("k", kv, d), ("v", kv, d), ("o", d, q)):
            out[p + f"self_attn.{name}_proj.weight"] = w(rows, cols)
            if (name != "o" and qkv_bias) or (name == "o" and o_bias):
                out[p + f"self_attn.{name}_proj.bias"] = rng.normal(0.0, 0.1, rows)
        if arch == "Qwen3ForCausalLM":
            out[p + "self_attn.q_norm.weight"] = norm(hd)
            out[p + "self_attn.k_norm.weight"] = norm(hd)
        for name, rows, cols in (("gate", f, d), ("up", f, d), ("down", d, f)):
            out[p + f"mlp.{name}_proj.weight"] = w(rows, cols)
            if mlp_bias:
                out[p + f"mlp.{name}_proj.bias"] = rng.normal(0.0, 0.1, rows)
    out["model.norm.weight"] = norm(d)
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = w(VOCAB, d)
    return out


def write_folder(folder: Path, cfg: dict[str, Any], tensors: dict[str, np.ndarray],
                 dtype: str, shards: int) -> None:  # fmt: skip
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.safetensors*"):
        old.unlink()
    tdtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    stored = {k: torch.from_numpy(v).to(tdtype[dtype]).contiguous() for k, v in tensors.items()}
    (folder / "config.json").write_text(json.dumps({**cfg, "torch_dtype": dtype}, indent=2) + "\n")
    if shards == 1:
        save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(stored)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: stored[n] for n in names[s::shards]}
        save_file(part, str(folder / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def hf_greedy(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt, one at a time (no padding), EOS ignored."""
    import torch

    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], dtype=torch.long)
        with torch.inference_mode():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        outs.append(gen[0, len(prompt) :].tolist())
    return outs


def tiny(_: argparse.Namespace) -> int:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    golden: dict[str, Any] = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "prompts": PROMPTS,
        "new_tokens": NEW_TOKENS,
        "cases": {},
    }
    for seed, (name, (extra, dtype, shards)) in enumerate(sorted(CASES.items())):
        cfg = tiny_config(extra)
        folder = ARCH_DIR / name
        write_folder(folder, cfg, tiny_tensors(cfg, seed), dtype, shards)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float64)
        model.eval()
        golden["cases"][name] = hf_greedy(model, PROMPTS, NEW_TOKENS)
        print(name, golden["cases"][name][0][:10], flush=True)
    (ARCH_DIR / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    return 0


SMOLLM2_CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a prime number is in one sentence.",
    "List three uses for a paperclip.",
    "How do I reverse a list in Python?",
]
SMOLLM2_NEW_TOKENS = 48


def smollm2(args: argparse.Namespace) -> int:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(args.file).resolve()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    prompts = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                return_dict=False,
            )
        )
        for text in SMOLLM2_CHATS
    ]  # fmt: skip
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        for text in SMOLLM2_CHATS
    ]
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float64
    )
    model.eval()
    outs = hf_greedy(model, prompts, SMOLLM2_NEW_TOKENS)
    for text, out in zip(SMOLLM2_CHATS, outs, strict=True):
        print(repr(text), "->", repr(tok.decode(out)), flush=True)
    if args.converted:
        conv = AutoModelForCausalLM.from_pretrained(args.converted, dtype=torch.float64)
        conv.eval()
        same = hf_greedy(conv, prompts, SMOLLM2_NEW_TOKENS) == outs
        print("converted folder under transformers gives the same tokens:", same)
        if not same:
            return 1
    SMOLLM2_GOLDEN.write_text(
        json.dumps(
            {
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "file": gguf.name,
                "chats": SMOLLM2_CHATS,
                "prompt_texts": texts,
                "prompt_ids": prompts,
                "new_tokens": SMOLLM2_NEW_TOKENS,
                "token_ids": outs,
            },
            indent=1,
        )
        + "\n"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("tiny").set_defaults(func=tiny)
    s = sub.add_parser("smollm2")
    s.add_argument("file")
    s.add_argument("--converted", default=None)
    s.set_defaults(func=smollm2)
    args = p.parse_args(argv)
    torch_threads = 2
    import torch

    torch.set_num_threads(torch_threads)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
