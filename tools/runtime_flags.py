"""The command-line flags that build a RuntimeConfig, shared by ``generate`` and ``serve``."""

from __future__ import annotations

import argparse

from spectrio.core.config import RuntimeConfig, SpeculativeConfig


def add_runtime_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="bundled",
        help="'bundled', a checkpoint folder or 'synthetic:...' (models/synthetic.py)",
    )
    p.add_argument("--k", type=int, default=2, help="speculative tokens per step (1..5)")
    p.add_argument(
        "--num-model-steps", type=int, default=None, help="MTP substeps (1..k; default k)"
    )
    p.add_argument("--no-spec", action="store_true", help="turn speculation off")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU math threads (default: every core this process may use)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks in the tensor-parallel group (started here as follower processes, "
        "or by `python -m paddle.distributed.launch`; docs/tensor_parallel.md)",
    )
    p.add_argument(
        "--config",
        type=str,
        default=None,
        help="RuntimeConfig as a TOML or JSON file (replaces the flags above)",
    )


def runtime_config(args: argparse.Namespace) -> RuntimeConfig:
    """The config the flags describe; raises ConfigError naming the bad field."""
    if args.config:
        from spectrio.runtime.config_file import load_config

        return load_config(args.config)
    spec = (
        SpeculativeConfig(method=None)
        if args.no_spec
        else SpeculativeConfig(num_speculative_tokens=args.k, num_model_steps=args.num_model_steps)
    )
    return RuntimeConfig(
        model=args.model,
        dtype=args.dtype,
        speculative=spec,
        max_model_len=args.max_model_len,
        num_threads=args.threads,
        tensor_parallel_size=args.tensor_parallel_size,
    )
