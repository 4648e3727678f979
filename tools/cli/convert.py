"""``spectrio convert FILE.gguf OUT_DIR``: a Hugging Face folder from a GGUF file."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_convert_parser(sub: Any) -> None:
    p = sub.add_parser(
        "convert",
        help="write a Hugging Face folder (config, safetensors, tokenizer, chat template) "
        "from a GGUF file",
        description="Dequantize a GGUF file into a Hugging Face folder: config.json, "
        "model.safetensors, tokenizer.json and tokenizer_config.json (with the chat "
        "template). In float32 the folder loads bit for bit as the GGUF file does.",
    )
    p.add_argument("gguf", metavar="FILE.gguf", help="a .gguf file, or 'smollm2'")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument(
        "--dtype",
        choices=("float32", "float16"),
        default="float32",
        help="storage dtype of the weights (default: float32, exact)",
    )
    p.set_defaults(func=_convert)


def _convert(args: argparse.Namespace) -> int:
    from spectrio.errors import CheckpointError, ModelConfigError
    from spectrio.models.loading.convert import convert_gguf
    from spectrio.models.loading.loader import resolve_path

    try:
        src = resolve_path(args.gguf) if args.gguf == "smollm2" else args.gguf
        out = convert_gguf(src, args.out_dir, args.dtype)
    except (CheckpointError, ModelConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0
