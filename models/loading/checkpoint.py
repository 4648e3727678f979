"""Where a checkpoint's tensors come from, under Hugging Face names and layouts.

A :class:`TensorSource` answers three questions for the loader: which tensors exist,
what shape each has, and the float values of (a row or column range of) one, in
Hugging Face layout (linear weights ``[out, in]``) and with q/k rows in the decoder's
rotate-half order. Two sources exist: safetensors folders (one file, several, or a
``model.safetensors.index.json`` with its shards; float32, float16 or bfloat16) and GGUF
files (:mod:`spectrio.models.loading.gguf_file`).

:func:`fill_parameters` copies a source into a built model (a whole one or one
tensor-parallel rank's shard), checking every name and shape first. The MTP layer's
names and its one permuted tensor come from :mod:`spectrio.models.loading.mtp_layout`, per the
layout the config records.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from spectrio.errors import CheckpointError
from spectrio.models.architecture.config import ModelConfig
from spectrio.models.loading import mtp_layout
from spectrio.models.ops.paddle_setup import paddle

__all__ = [
    "SafetensorsSource",
    "TensorSource",
    "fill_parameters",
    "hf_name",
    "interleaved_to_half",
    "is_linear",
    "read_float_slice",
    "save_safetensors",
    "split_axis",
]

INDEX_FILE = "model.safetensors.index.json"
HEAD_FILE = "mtp.safetensors"
"""A ``spectrio train-mtp`` head kept in the checkpoint's folder: not one of its shards
(:mod:`spectrio.models.loading.mtp_head` reads it)."""

_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def read_float_slice(sl: Any, axis: int | None, lo: int, hi: int) -> np.ndarray:
    """A safetensors slice ``sl`` read whole (``axis`` None) or rows / columns ``lo:hi``
    of axis 0 / 1, bfloat16 widened to float32 (exactly: bfloat16 is float32's top half).

    NumPy reads bfloat16 only once ``ml_dtypes`` has registered the type, and importing
    ``ml_dtypes`` costs about a second of start-up, most of a GGUF file's first token;
    it is imported here, for the first bfloat16 tensor, never at start-up."""
    bf16 = sl.get_dtype() == "BF16"
    if bf16:
        import ml_dtypes  # noqa: F401  # registers numpy's "bfloat16"
    arr = sl[:] if axis is None else (sl[lo:hi] if axis == 0 else sl[:, lo:hi])
    return np.asarray(arr.astype(np.float32) if bf16 else arr)


def save_safetensors(
    tensors: dict[str, np.ndarray], path: str | Path, metadata: dict[str, str]
) -> None:
    """Write ``tensors`` to ``path`` as a safetensors file, readable as any file this
    process creates is (a file already there keeps its mode). ``safetensors`` leaves
    what it writes at mode 0600: a converted model or a trained head would be unreadable
    to the other users and services that load it. The mode comes from creating the file
    first, not from reading the umask, which takes setting it: process-wide, under any
    other thread that creates a file meanwhile."""
    path = Path(path)
    path.touch()
    mode = stat.S_IMODE(path.stat().st_mode)
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, mode)


class TensorSource(Protocol):
    """A checkpoint's tensors under Hugging Face names ([out, in] linears, rotate-half
    q/k rows)."""

    where: str  # the folder or file, for messages

    def names(self) -> set[str]: ...

    def shape(self, name: str) -> list[int]: ...

    def read(self, name: str, axis: int | None = None, lo: int = 0, hi: int = 0) -> np.ndarray:
        """The tensor's values (rows ``lo:hi`` when ``axis`` is 0, columns when 1, whole
        when None) as a float array of the stored precision or wider."""
        ...


def interleaved_to_half(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """Reorder the rows of a q or k projection (weight ``[out, in]`` or bias ``[out]``)
    whose heads rotate adjacent pairs ``(2i, 2i+1)`` into rotate-half order, where pair i
    is ``(i, i + head_dim/2)``: row ``2i`` of a head goes to ``i``, ``2i+1`` to
    ``head_dim/2 + i``. Attention scores are unchanged (q and k move alike), so the
    decoder's rotate-half RoPE then computes what the interleaved one did. This undoes
    llama.cpp's q/k permutation for its "normal" RoPE, and maps ERNIE 4.5's layout."""
    rest = rows.shape[1:]
    heads = rows.shape[0] // head_dim
    grouped = rows.reshape(heads, head_dim // 2, 2, *rest)
    return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(rows.shape))


def half_to_interleaved(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """The inverse of :func:`interleaved_to_half`."""
    rest = rows.shape[1:]
    heads = rows.shape[0] // head_dim
    grouped = rows.reshape(heads, 2, head_dim // 2, *rest)
    return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(rows.shape))


def is_qk_rows(name: str) -> bool:
    """A tensor whose rows are q or k head dimensions (weights and biases)."""
    return name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias"))


class SafetensorsSource:
    """The ``*.safetensors`` files of a folder; with ``model.safetensors.index.json``,
    exactly the shards it lists, each holding exactly the tensors it maps to them."""

    def __init__(self, folder: Path, cfg: ModelConfig) -> None:
        self.where = str(folder)
        self._cfg = cfg
        self._handles: dict[str, Any] = {}
        self._file_of: dict[str, int] = {}
        files = self._files(folder)
        self._paths = [str(f) for f in files]
        # Values are read through a second handle on one file at a time: a handle maps its
        # whole file, and every page a read touches counts as resident until the mapping
        # goes, so reading all tensors through the handles above would hold the whole
        # checkpoint resident beside the model until the load ends.
        self._reading: tuple[int, Any] | None = None
        try:
            for i, f in enumerate(files):
                handle = safe_open(str(f), framework="numpy")
                for key in handle.keys():
                    if key in self._handles:
                        raise CheckpointError(f"{f}: tensor {key!r} appears in more than one file")
                    self._handles[key] = handle
                    self._file_of[key] = i
        except (SafetensorError, OSError, ValueError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{f}: corrupt or unreadable safetensors file ({exc})") from exc
        if self._index is not None:
            self._check_index(folder)

    def _files(self, folder: Path) -> list[Path]:
        self._index: dict[str, str] | None = None
        index = folder / INDEX_FILE
        if index.exists():
            try:
                raw = json.loads(index.read_text())
                weight_map = raw["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: unreadable index ({exc})") from exc
            self._index = {str(k): str(v) for k, v in weight_map.items()}
            files = [folder / name for name in sorted(set(self._index.values()))]
            for f in files:
                if not f.is_file():
                    raise CheckpointError(f"{index}: lists shard {f.name!r}, which is missing")
            return files
        files = sorted(f for f in folder.glob("*.safetensors") if f.name != HEAD_FILE)
        if not files:
            raise CheckpointError(f"{folder}: no *.safetensors files")
        return files

    def _check_index(self, folder: Path) -> None:
        assert self._index is not None
        for name, file in sorted(self._index.items()):
            handle = self._handles.get(name)
            if handle is None:
                raise CheckpointError(
                    f"{folder / INDEX_FILE}: maps {name!r} to {file!r}, which does not hold it"
                )
        for name in sorted(set(self._handles) - set(self._index)):
            raise CheckpointError(f"{folder}: tensor {name!r} is not in {INDEX_FILE}")

    def names(self) -> set[str]:
        return set(self._handles)

    def shape(self, name: str) -> list[int]:
        return list(self._handles[name].get_slice(name).get_shape())

    def read_order(self, name: str) -> int:
        """Which file holds ``name``: reading a file's tensors together keeps one file
        mapped at a time."""
        return self._file_of[name]

    def _reader(self, name: str) -> Any:
        index = self._file_of[name]
        if self._reading is None or self._reading[0] != index:
            self._reading = None  # unmap the previous file before mapping the next
            self._reading = (index, safe_open(self._paths[index], framework="numpy"))
        return self._reading[1]

    def read(self, name: str, axis: int | None = None, lo: int = 0, hi: int = 0) -> np.ndarray:
        sl = self._reader(name).get_slice(name)
        dtype = sl.get_dtype()
        if dtype not in _FLOAT_DTYPES:
            raise CheckpointError(f"{self.where}: tensor {name!r} has non-float dtype {dtype}")
        try:
            arr = read_float_slice(sl, axis, lo, hi)
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{self.where}: cannot read tensor {name!r} ({exc})") from exc
        if self._cfg.rope_interleaved and is_qk_rows(name):
            arr = interleaved_to_half(arr, self._cfg.head_dim)
        return np.asarray(arr)


# ---- from a source into a model --------------------------------------------------------


def hf_name(paddle_name: str, cfg: ModelConfig) -> str:
    """The Hugging Face tensor name of a parameter; the MTP layer's as ``cfg.mtp_layout``
    stores it (DeepSeek-V3's: layer ``L``)."""
    if paddle_name.startswith("mtp."):
        return mtp_layout.hf_name(paddle_name, cfg)
    return paddle_name


def is_linear(param: paddle.Tensor, name: str) -> bool:
    """Whether a parameter is a linear weight (Paddle ``[in, out]``, Hugging Face ``[out, in]``)."""
    return param.ndim == 2 and not name.endswith("embed_tokens.weight")


# Which axis of the Hugging Face tensor ([out, in] for linears) a tensor-parallel rank
# splits: column-parallel outputs (and their biases) and the vocabulary on 0, row-parallel
# inputs on 1. Row-parallel biases, norms and eh_proj are replicated.
_SPLIT_ROWS = (
    "q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight",
    "q_proj.bias", "k_proj.bias", "v_proj.bias", "gate_proj.bias", "up_proj.bias",
    "embed_tokens.weight", "lm_head.weight",
)  # fmt: skip
_SPLIT_COLS = ("o_proj.weight", "down_proj.weight")


def split_axis(name: str) -> int | None:
    if name.endswith(_SPLIT_ROWS):
        return 0
    if name.endswith(_SPLIT_COLS):
        return 1
    return None


def refuse_unexpected(where: str, cfg: ModelConfig, unexpected: set[str]) -> None:
    """Raise :class:`CheckpointError` for a stored tensor the architecture does not have
    (DeepSeek-V3's in-layer copies of the shared weights and RoPE buffers are tolerated).
    One in the MTP layer's namespace is something spectrio's MTP layer cannot hold (a
    bias on the input projection, a second layer): loading without it would draft with
    another layer than the one stored, so it is refused too."""
    for name in sorted(unexpected):
        if mtp_layout.tolerated(name, cfg) or name.endswith("rotary_emb.inv_freq"):
            continue
        if cfg.has_mtp and mtp_layout.is_layout_tensor(name, cfg):
            raise CheckpointError(
                f"{where}: unexpected MTP tensor {name!r} (spectrio's MTP layer, read in "
                f"the {cfg.mtp_layout} layout, has no such part)"
            )
        raise CheckpointError(
            f"{where}: unexpected tensor {name!r} (not part of this architecture)"
        )


def fill_parameters(
    model: paddle.nn.Layer,
    cfg: ModelConfig,
    source: TensorSource,
    dtype: str,
    rank: int = 0,
    size: int = 1,
    skip: frozenset[str] = frozenset(),
) -> None:
    """Set every parameter of ``model`` (rank ``rank`` of ``size``'s shard when ``size`` >
    1) from ``source``, widened to ``dtype``. Every name and full shape is checked before
    any value is read, so a wrong checkpoint fails fast and names the first problem:
    missing, misshapen, unexpected, or non-float. Tensors named (Hugging Face names) in
    ``skip`` are checked but not read: their parameters stay without storage, for a
    caller that serves them from elsewhere (a GGUF file's blocks)."""
    names = source.names()
    plan: list[tuple[paddle.Tensor, str, str, int | None, list[int]]] = []
    for name, param in model.named_parameters():
        hf = hf_name(name, cfg)
        local = list(param.shape)
        want = local[::-1] if is_linear(param, name) else list(local)
        axis = split_axis(name) if size > 1 else None
        if axis is not None:
            want[axis] *= size
            # A permuted tensor is permuted whole; a rank's slice of it would mix halves.
            assert not mtp_layout.transforms(name, cfg), name
        if hf not in names:
            raise CheckpointError(f"{source.where}: missing tensor {hf!r} (expected shape {want})")
        shape = source.shape(hf)
        if shape != want:
            raise CheckpointError(
                f"{source.where}: tensor {hf!r} has shape {shape}, expected {want}"
            )
        plan.append((param, name, hf, axis, want))
    refuse_unexpected(source.where, cfg, names - {p[2] for p in plan})
    plan = [item for item in plan if item[2] not in skip]
    order = getattr(source, "read_order", None)  # a source in several files: file by file
    if order is not None:
        plan.sort(key=lambda item: order(item[2]))
    with paddle.no_grad():
        for param, name, hf, axis, want in plan:
            if axis is None:
                arr = source.read(hf)
            else:
                part = want[axis] // size
                arr = source.read(hf, axis, rank * part, (rank + 1) * part)
            if not np.issubdtype(arr.dtype, np.floating):
                raise CheckpointError(
                    f"{source.where}: tensor {hf!r} has non-float dtype {arr.dtype}"
                )
            arr = mtp_layout.convert(name, arr, cfg)
            value = arr.T if is_linear(param, name) else arr
            # Widen (float16, bfloat16 or dequantized storage) before the model sees it:
            # compute runs in dtype. One copy at most (a transpose and a widening happen
            # in the same one): the embedding alone is over 100 MB on a real model, and
            # every extra copy of it raised the load's peak memory.
            param.set_value(np.ascontiguousarray(value, dtype=dtype))
            del arr, value
