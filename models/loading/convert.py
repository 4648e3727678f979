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
from collections.abc import Callable
from pathlib import Path

import numpy as np
import structlog

from spectrio.errors import CheckpointError
from spectrio.models.loading.checkpoint import (
    INDEX_FILE,
    half_to_interleaved,
    is_qk_rows,
    save_safetensors,
)
from spectrio.models.loading.gguf_file import GGUFFile

log = structlog.get_logger("spectrio.models.loading.convert")

__all__ = ["CONVERT_DTYPES", "convert_gguf"]

CONVERT_DTYPES = ("float32", "float16")


def convert_gguf(
    src: str | Path, out_dir: str | Path, dtype: str = "float32", shard_bytes: int | None = None
) -> Path:
    """Write the Hugging Face folder of the GGUF file ``src`` into ``out_dir`` (created;
    files of the same names are replaced). Returns ``out_dir``.

    ``shard_bytes``: write shards of about that size with ``model.safetensors.index.json``
    (a tensor larger than it gets a shard of its own), so that at most one shard's
    tensors are held in memory at a time; None writes one ``model.safetensors``."""
    if dtype not in CONVERT_DTYPES:
        raise ValueError(f"dtype must be one of {CONVERT_DTYPES}, got {dtype!r}")
    if shard_bytes is not None and shard_bytes < 1:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes!r}")
    src, out = Path(src), Path(out_dir)
    if not src.is_file():
        raise CheckpointError(f"{src}: no such file")
    gguf = GGUFFile(src)
    cfg = gguf.config
    tokenizer = gguf.tokenizer_json()
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)

    def tensor(name: str) -> np.ndarray:
        arr = gguf.read(name)
        if cfg.rope_interleaved and is_qk_rows(name):
            arr = half_to_interleaved(arr, cfg.head_dim)  # the family's own order
        return np.ascontiguousarray(arr.astype(dtype))

    names = sorted(gguf.names())
    if shard_bytes is None:
        save_safetensors({n: tensor(n) for n in names}, out / "model.safetensors", {"format": "pt"})
    else:
        _save_shards(out, names, tensor, shard_bytes)
    raw = cfg.to_dict(dtype)
    raw.pop("num_nextn_predict_layers")  # no MTP layer: a plain Hugging Face config
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    if tokenizer is not None:
        (out / "tokenizer.json").write_text(tokenizer)
        (out / "tokenizer_config.json").write_text(
            json.dumps(gguf.tokenizer_config(), indent=2) + "\n"
        )
    log.info("converted", src=str(src), out=str(out), tensors=len(names), dtype=dtype)
    return out


def _save_shards(
    out: Path, names: list[str], tensor: Callable[[str], np.ndarray], shard_bytes: int
) -> None:
    """Shards of about ``shard_bytes`` each, then the index that maps names to them."""
    pending: dict[str, np.ndarray] = {}
    size = 0
    files: list[str] = []
    weight_map: dict[str, str] = {}
    total = 0

    def flush() -> None:
        nonlocal pending, size
        if not pending:
            return
        file = f"model-{len(files) + 1:05d}.safetensors"
        save_safetensors(pending, out / file, {"format": "pt"})
        files.append(file)
        weight_map.update(dict.fromkeys(pending, file))
        pending, size = {}, 0

    for name in names:
        arr = tensor(name)
        if pending and size + arr.nbytes > shard_bytes:
            flush()
        pending[name] = arr
        size += arr.nbytes
        total += arr.nbytes
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
