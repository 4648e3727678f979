"""GGUF to a Hugging Face folder: ``spectrio convert FILE.gguf OUT_DIR``.

The folder holds ``config.json`` (the family's Hugging Face config), ``model.safetensors``
(every tensor dequantized, under Hugging Face names and layouts, q/k rows in the order
the family's Hugging Face implementation expects), ``tokenizer.json`` (the vocabulary
rebuilt with ``tokenizers``) and ``tokenizer_config.json`` (special tokens and the chat
template). Stored in float32 the weights are exactly the dequantized values, so the
folder loads bit for bit as the GGUF file does.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import structlog
from safetensors.numpy import save_file

from spectrio.errors import CheckpointError
from spectrio.models.checkpoint import half_to_interleaved, is_qk_rows
from spectrio.models.gguf_file import GGUFFile

log = structlog.get_logger("spectrio.models.convert")

__all__ = ["CONVERT_DTYPES", "convert_gguf"]

CONVERT_DTYPES = ("float32", "float16")


def convert_gguf(src: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write the Hugging Face folder of the GGUF file ``src`` into ``out_dir`` (created;
    files of the same names are replaced). Returns ``out_dir``."""
    if dtype not in CONVERT_DTYPES:
        raise ValueError(f"dtype must be one of {CONVERT_DTYPES}, got {dtype!r}")
    src, out = Path(src), Path(out_dir)
    if not src.is_file():
        raise CheckpointError(f"{src}: no such file")
    gguf = GGUFFile(src)
    cfg = gguf.config
    tokenizer = gguf.tokenizer_json()
    tensors: dict[str, np.ndarray] = {}
    for name in sorted(gguf.names()):
        arr = gguf.read(name)
        if cfg.rope_interleaved and is_qk_rows(name):
            arr = half_to_interleaved(arr, cfg.head_dim)  # the family's own order
        tensors[name] = np.ascontiguousarray(arr.astype(dtype))
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    raw = cfg.to_dict(dtype)
    raw.pop("num_nextn_predict_layers")  # no MTP layer: a plain Hugging Face config
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        (out / "tokenizer.json").write_text(tokenizer)
        (out / "tokenizer_config.json").write_text(
            json.dumps(gguf.tokenizer_config(), indent=2) + "\n"
        )
    log.info("converted", src=str(src), out=str(out), tensors=len(tensors), dtype=dtype)
    return out
