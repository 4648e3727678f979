"""An MTP head kept beside a model that ships none (what ``spectrio train-mtp`` writes).

The head is one DeepSeek-V3-style MTP layer in its own safetensors file, under the names
it would have inside the checkpoint (``model.layers.{num_hidden_layers}.*``), so a folder
holding it reads exactly like a checkpoint that shipped the layer. The file's metadata
names the target it was trained on (:func:`target_fingerprint`): a head is a function
of the target's hidden states, so a head for another model would only draft noise, and
it is refused rather than loaded.

Where a head is looked for (:func:`head_path_for`, then :func:`shipped_head_for`):
- a folder ``DIR``: ``DIR/mtp.safetensors``;
- a GGUF file ``X.gguf``: ``X.mtp.safetensors`` beside it;
- a named model: the head the package ships for it (:data:`SHIPPED_HEADS`);
- where none lies beside the model: the shipped head whose recorded target fingerprint
  is this model's, so ``smollm2`` loaded by its file's path (or from the folder
  ``spectrio convert`` writes from it) gets its head too. Only the heads' metadata is
  read to find it.

A shipped head is checked against its recorded SHA-256 when it is opened.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from safetensors import SafetensorError, safe_open

from spectrio.errors import CheckpointError
from spectrio.models.loading.checkpoint import HEAD_FILE, TensorSource, read_float_slice

if TYPE_CHECKING:
    from spectrio.models.architecture.config import ModelConfig

FORMAT = "spectrio-mtp-head/1"
HEADS_DIR = Path(__file__).resolve().parents[1] / "heads"  # models/heads
DRAFT_VOCAB = "spectrio.draft_vocab"
"""The head file's optional int32 tensor of the token ids to draft from
(:meth:`~spectrio.models.architecture.model.SpectrioForCausalLM.set_draft_vocab`)."""

SHIPPED_HEADS = {"smollm2": HEADS_DIR / "smollm2" / HEAD_FILE}
"""Heads the package ships, by model name; each has a ``.sha256`` file beside it."""


def head_path_for(model_path: Path, name: str | None = None) -> Path:
    """Where the head of the model at ``model_path`` lives (it may not exist yet)."""
    if name is not None and name in SHIPPED_HEADS:
        return SHIPPED_HEADS[name]
    if model_path.is_dir():
        return model_path / HEAD_FILE
    return model_path.with_name(model_path.stem + ".mtp.safetensors")


def head_target(path: Path) -> str | None:
    """The target fingerprint a head file records (its ``target`` metadata), reading only
    the file's header; None for a missing or unreadable file, or one spectrio did not
    write."""
    try:
        with safe_open(str(path), framework="numpy") as handle:
            metadata = dict(handle.metadata() or {})
    except (SafetensorError, OSError, ValueError):
        return None
    target = metadata.get("target") if metadata.get("format") == FORMAT else None
    return target if isinstance(target, str) else None


def shipped_head_for(fingerprint: str) -> Path | None:
    """The head the package ships for the target ``fingerprint``
    (:func:`target_fingerprint`), or None; decided from the heads' metadata alone (the
    checksum is checked when the head is opened, :func:`open_head`)."""
    for path in SHIPPED_HEADS.values():
        if path.is_file() and head_target(path) == fingerprint:
            return path
    return None


def target_fingerprint(cfg: ModelConfig, source: TensorSource) -> str:
    """What identifies the target a head was trained on: its architecture (the config
    without the MTP layer count) and the final norm's weights, which any fine-tune of a
    checkpoint moves."""
    fields = dict(cfg.to_dict())
    fields.pop("num_nextn_predict_layers", None)
    fields.pop("torch_dtype", None)
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
    norm = np.ascontiguousarray(source.read("model.norm.weight"), dtype=np.float32)
    digest.update(norm.tobytes())
    return digest.hexdigest()[:32]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class HeadFile:
    """A head file's tensors, checked against the target it is attached to."""

    path: Path
    metadata: dict[str, str]


def open_head(path: Path, cfg: ModelConfig, fingerprint: str) -> HeadSource:
    """Read the head at ``path`` for the target ``cfg`` (whose fingerprint is
    ``fingerprint``); raises :class:`CheckpointError` for a corrupt file, a checksum that
    does not match, a head made for another model, or a tensor outside the MTP layer."""
    sha_file = path.with_name(path.name + ".sha256")
    if sha_file.is_file():
        want = sha_file.read_text().split()[0]
        got = file_sha256(path)
        if got != want:
            raise CheckpointError(
                f"{path}: SHA-256 {got} does not match {sha_file.name} ({want}): the head "
                "file is damaged or was replaced"
            )
    try:
        handle = safe_open(str(path), framework="numpy")
        metadata = dict(handle.metadata() or {})
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: corrupt or unreadable MTP head ({exc})") from exc
    if metadata.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: not an MTP head written by spectrio train-mtp (metadata format "
            f"{metadata.get('format')!r}, expected {FORMAT!r})"
        )
    if metadata.get("target") != fingerprint:
        raise CheckpointError(
            f"{path}: this MTP head was trained for another model (target fingerprint "
            f"{metadata.get('target')}, this model's is {fingerprint}); retrain it with "
            "spectrio train-mtp or remove the file"
        )
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    for key in handle.keys():
        if not key.startswith(prefix) and key != DRAFT_VOCAB:
            raise CheckpointError(
                f"{path}: tensor {key!r} is not part of the MTP layer ({prefix}*)"
            )
    return HeadSource(HeadFile(path, metadata), handle)


class HeadSource:
    """The head's tensors, read like a checkpoint's."""

    def __init__(self, head: HeadFile, handle: object) -> None:
        self.head = head
        self.where = str(head.path)
        self._handle = handle

    def names(self) -> set[str]:
        return set(self._handle.keys()) - {DRAFT_VOCAB}  # type: ignore[attr-defined]

    @property
    def draft_vocab(self) -> np.ndarray | None:
        """The token ids the head drafts from, when its file names them."""
        if DRAFT_VOCAB not in self._handle.keys():  # type: ignore[attr-defined]
            return None
        return np.asarray(self._handle.get_tensor(DRAFT_VOCAB), dtype=np.int64)  # type: ignore[attr-defined]

    def shape(self, name: str) -> list[int]:
        return list(self._handle.get_slice(name).get_shape())  # type: ignore[attr-defined]

    def read(self, name: str, axis: int | None = None, lo: int = 0, hi: int = 0) -> np.ndarray:
        return read_float_slice(self._handle.get_slice(name), axis, lo, hi)  # type: ignore[attr-defined]


class WithHead:
    """A target checkpoint's tensors plus a head's: the MTP layer's names come from the
    head, everything else from the target."""

    def __init__(self, target: TensorSource, head: HeadSource) -> None:
        self._target = target
        self.head = head
        self._head_names = head.names()
        self.where = target.where

    @property
    def target(self) -> TensorSource:
        """The target checkpoint's own tensors, without the head."""
        return self._target

    def names(self) -> set[str]:
        return self._target.names() | self._head_names

    def _source(self, name: str) -> TensorSource:
        return self.head if name in self._head_names else self._target

    def read_order(self, name: str) -> int:
        """The target's file order (:meth:`SafetensorsSource.read_order`); the head last."""
        order = getattr(self._target, "read_order", None)
        if name in self._head_names or order is None:
            return 1 << 30
        return int(order(name))

    def shape(self, name: str) -> list[int]:
        return self._source(name).shape(name)

    def read(self, name: str, axis: int | None = None, lo: int = 0, hi: int = 0) -> np.ndarray:
        return self._source(name).read(name, axis, lo, hi)


def attached_head(source: object) -> Path | None:
    """The head file attached to the tensors ``source`` (a :class:`WithHead`), or None."""
    return source.head.head.path if isinstance(source, WithHead) else None


def save_head(
    model: object,
    path: Path,
    fingerprint: str,
    dtype: str = "float16",
    draft_vocab: np.ndarray | None = None,
    **meta: str,
) -> str:
    """Write ``model``'s MTP layer to ``path`` as a head for the target ``fingerprint``
    (with the token ids it drafts from, when ``draft_vocab`` is given), with its SHA-256
    in ``path.sha256``; returns the checksum. ``meta`` rides along in the file's metadata
    (what trained it)."""
    from spectrio.models.architecture.model import SpectrioForCausalLM
    from spectrio.models.loading.checkpoint import save_safetensors
    from spectrio.models.loading.loader import state_dict_hf

    assert isinstance(model, SpectrioForCausalLM)
    prefix = f"model.layers.{model.config.num_hidden_layers}."
    tensors = state_dict_hf(model, dtype, prefix)
    if not tensors:
        raise ValueError("the model has no MTP layer to save")
    if draft_vocab is not None:
        tensors[DRAFT_VOCAB] = np.asarray(draft_vocab, dtype=np.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_safetensors(tensors, tmp, {"format": FORMAT, "target": fingerprint, **meta})
    tmp.replace(path)  # a reader never sees half a file
    checksum = file_sha256(path)
    path.with_name(path.name + ".sha256").write_text(f"{checksum}  {path.name}\n")
    return checksum
