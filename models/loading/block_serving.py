"""A serving model whose weights are a GGUF file's quantized blocks, as stored.

:func:`load_blocks` builds the model without a float32 copy of the weights it serves
from blocks: their parameters never get storage. What it does instead:

* **The layers' products** are :meth:`~spectrio.models.ops.serving_matrix.ServingMatrix.from_blocks`
  matrices that the native layer ops multiply by. q/k/v and gate/up are fused row-wise,
  which needs one block type per group: a group mixing Q4_0 or Q5_0 with Q8_0 (what
  llama.cpp's Q4_K_M and Q5_K_M mixes write for attn_v) has its narrower members
  re-stored as Q8_0, which holds each of their values exactly. q's 1/sqrt(head_dim) is
  folded into its block scales (exact when that is a power of two).
* **The embedding and the output head** stay in the file: a step's embedding rows are
  dequantized for its tokens only, the head is a block matrix (a tied head is the
  embedding's blocks), and the draft vocabulary's head rows are dequantized once.
* **Matrices are read with file reads, not through the mapping**: the tiled types are
  repacked once into 8-column tiles (:meth:`ServingMatrix.from_blocks`, the blocks'
  bytes), Q5_K is kept as stored; fused groups are concatenated first.
  Resident memory is about the file's size, and mapped pages touched while loading are
  dropped again (``madvise``).

Where a group's type has no kernel (or mixes types no lossless re-storing unifies), its
tensors are widened to float32 and served as float panels, with a warning naming each
tensor, its type and the memory it costs. Norms, biases and a trained MTP head are read
as before. F32 matrices are served as float32 panels, which is what they are.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import structlog

from spectrio.errors import CheckpointError, ConfigError
from spectrio.models.loading.checkpoint import TensorSource, fill_parameters, hf_name
from spectrio.models.loading.gguf_file import GGUFFile
from spectrio.models.ops import native_ops
from spectrio.models.ops.gguf_blocks import BLOCK_TYPES, decode_groups, scaled_blocks
from spectrio.models.ops.paddle_setup import paddle
from spectrio.models.ops.serving_matrix import ServingMatrix
from spectrio.process_memory import trim_freed_memory

if TYPE_CHECKING:
    from spectrio.models.architecture.config import ModelConfig
    from spectrio.models.architecture.model import SpectrioForCausalLM

__all__ = ["BlockPlan", "Shard", "load_blocks", "plan_blocks", "served_weight_bytes"]

log = structlog.get_logger("spectrio.models.loading.block_serving")

#: types whose every value a Q8_0 block with the same scale holds: ``d * (u - offset)``
_WIDENS_TO_Q8_0 = {"Q4_0": 8, "Q5_0": 16}

#: ``F16``: a block-served model drafts from float16 panels of its MTP pass's weights, not
#: from their Q8_0 blocks (the default: half the bytes a draft substep reads)
DRAFT_ENV = "SPECTRIO_GGUF_DRAFT"

_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")


@dataclasses.dataclass(frozen=True)
class Group:
    """Tensors served as one block matrix (Hugging Face names) and their common type."""

    names: tuple[str, ...]
    kind: str


@dataclasses.dataclass
class BlockPlan:
    """What :func:`load_blocks` serves from blocks, decided from the file's types alone."""

    groups: dict[str, Group]  # by the serving matrix's role: "3.qkv", "head", ...
    #: widened tensors: (name, type, float32 bytes)
    widened: list[tuple[str, str, int]]

    @property
    def skipped(self) -> frozenset[str]:
        """Tensor names whose parameters are never filled."""
        names = {n for g in self.groups.values() for n in g.names}
        if "head" in self.groups:  # the embedding is served from the file too
            names.add("model.embed_tokens.weight")
        return frozenset(names)

    def counts(self) -> Counter[str]:
        return Counter(g.kind for g in self.groups.values())


def _common_kind(kinds: list[str]) -> str | None:
    """The one type a group's tensors of ``kinds`` are served in, or None."""
    if not all(k in BLOCK_TYPES and BLOCK_TYPES[k].native for k in kinds):
        return None
    if len(set(kinds)) == 1:
        return kinds[0]
    if "Q8_0" in kinds and all(k == "Q8_0" or k in _WIDENS_TO_Q8_0 for k in kinds):
        return "Q8_0"
    return None


def plan_blocks(gguf: GGUFFile, cfg: ModelConfig) -> BlockPlan:
    """Which of ``gguf``'s matrices are served from blocks, and which are widened."""
    groups: dict[str, Group] = {}
    widened: list[tuple[str, str, int]] = []

    def consider(role: str, names: list[str]) -> None:
        kinds = [gguf.type_name(n) for n in names]
        if all(k == "F32" for k in kinds):
            return  # served as float32 panels: the same bytes as stored
        kind = _common_kind(kinds)
        if kind is not None and gguf.shape(names[0])[1] % BLOCK_TYPES[kind].elements:
            kind = None  # the kernels take whole blocks of a row; a file rarely lacks them
        if kind is None:
            for n, k in zip(names, kinds, strict=True):
                widened.append((n, k, int(np.prod(gguf.shape(n))) * 4))
            return
        groups[role] = Group(tuple(names), kind)

    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        consider(f"{i}.qkv", [f"{pre}{p}.weight" for p in _QKV])
        consider(f"{i}.o", [f"{pre}self_attn.o_proj.weight"])
        consider(f"{i}.gate_up", [f"{pre}{p}.weight" for p in _GATE_UP])
        consider(f"{i}.down", [f"{pre}mlp.down_proj.weight"])
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    consider("head", [head])
    return BlockPlan(groups, widened)


def served_weight_bytes(gguf: GGUFFile, cfg: ModelConfig) -> int:
    """Bytes of weights one target forward reads when ``gguf`` is served from its blocks:
    each block matrix as served (a group re-stored as Q8_0 at Q8_0's size), every other
    target tensor as float32, and no embedding but the head (a lookup reads a row)."""
    plan = plan_blocks(gguf, cfg)
    served = {n: g.kind for g in plan.groups.values() for n in g.names}
    total = 0
    for name in gguf.names():
        if name == "model.embed_tokens.weight" and not cfg.tie_word_embeddings:
            continue
        shape = gguf.shape(name)
        if name in served:
            total += shape[0] * BLOCK_TYPES[served[name]].row_bytes(shape[1])
        else:
            total += int(np.prod(shape)) * 4
    return total


def as_q8_0(rows: np.ndarray, kind: str) -> np.ndarray:
    """Blocks of ``kind`` (Q4_0 or Q5_0; uint8 ``[N, row bytes]``) re-stored as Q8_0
    blocks holding the same values: each block keeps its float16 scale, and its quants
    become ``u - offset``, which fit in int8."""
    t = BLOCK_TYPES[kind]
    blocks = rows.reshape(rows.shape[0], -1, t.bytes)
    u, _, _ = decode_groups(blocks, kind)
    out = np.empty((*blocks.shape[:2], BLOCK_TYPES["Q8_0"].bytes), dtype=np.uint8)
    out[..., :2] = blocks[..., :2]  # the float16 scale, first in both layouts
    out[..., 2:] = (u.astype(np.int16) - _WIDENS_TO_Q8_0[kind]).astype(np.int8).view(np.uint8)
    return out.reshape(rows.shape[0], -1)


@dataclasses.dataclass(frozen=True)
class Shard:
    """One tensor-parallel rank's share: ``rank`` of ``size`` (1: the whole model)."""

    rank: int = 0
    size: int = 1

    def rows(self, rows: np.ndarray) -> np.ndarray:
        """A column-parallel (or vocab-parallel) matrix's rows for this rank."""
        part = rows.shape[0] // self.size
        return rows[self.rank * part : (self.rank + 1) * part]

    def columns(self, rows: np.ndarray, kind: str, k: int, name: str) -> np.ndarray:
        """A row-parallel matrix's share of every row's ``k`` inputs: whole blocks only."""
        t = BLOCK_TYPES[kind]
        part = k // self.size
        if part % t.elements:
            raise CheckpointError(
                f"tensor {name!r} ({kind}) cannot be split across {self.size} "
                f"tensor-parallel ranks: each rank's {part} inputs of {k} are not whole "
                f"{t.elements}-element blocks (serve it widened to float32 with "
                "SPECTRIO_GGUF_BLOCKS=0, or use fewer ranks)"
            )
        width = t.row_bytes(part)
        return np.ascontiguousarray(rows[:, self.rank * width : (self.rank + 1) * width])


def _rows(gguf: GGUFFile, names: tuple[str, ...], kind: str, shard: Shard) -> np.ndarray:
    """The group's rows (this rank's, for a column-parallel group), concatenated, each in
    ``kind``: a copy, made with file reads."""
    parts = []
    for name in names:
        stored = gguf.type_name(name)
        part = shard.rows(gguf.read_blocks(name))
        parts.append(part if stored == kind else as_q8_0(part, stored))
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _embedding_rows(gguf: GGUFFile, name: str) -> Callable[[np.ndarray], np.ndarray]:
    """``rows(ids)``: float32 rows ``ids`` of the matrix ``name``, dequantized from the file."""

    def rows(ids: np.ndarray) -> np.ndarray:
        return gguf.read_rows(name, np.asarray(ids, dtype=np.int64).reshape(-1))

    return rows


def _embedding(
    gguf: GGUFFile, name: str, tied: ServingMatrix | None
) -> Callable[[paddle.Tensor], paddle.Tensor]:
    """``embed(ids)``: float32 rows ``ids`` (int64) of the embedding ``name``, computed by
    the native kernel from its blocks, which this rank's tied head holds whole (``tied``)
    or which are read once into memory; rows of a type without a kernel are dequantized
    from the file per call."""
    kind = gguf.type_name(name)
    if BLOCK_TYPES[kind].native and native_ops.native_ops_available():
        if tied is not None and tied.panels is not None:
            table, (k, n) = tied.panels, tied.shape
        else:
            blocks = gguf.read_blocks(name)
            table = paddle.utils.dlpack.from_dlpack(blocks)
            n, k = blocks.shape[0], gguf.shape(name)[1]
        ggml_id = BLOCK_TYPES[kind].ggml_id
        return lambda ids: native_ops.embed_rows(table, ids, ggml_id, n, k)
    rows = _embedding_rows(gguf, name)
    return lambda ids: paddle.to_tensor(rows(ids.numpy()))


def draft_blocks() -> str | None:
    """The GGUF type a block-served model's MTP pass drafts from (:data:`DRAFT_ENV`;
    default Q8_0), or None for float16 panels."""
    value = os.environ.get(DRAFT_ENV, "Q8_0").strip()
    if value.upper() in ("F16", "0", "OFF", "NO", "FALSE"):
        return None
    if value not in ("Q8_0",):
        raise ConfigError(f"{DRAFT_ENV}={value!r}: Q8_0 (the default) or F16 are supported")
    return value


def _inputs(cfg: ModelConfig, what: str) -> int:
    """Inputs of every row of a row-parallel matrix (o or down) of the whole model."""
    return cfg.num_attention_heads * cfg.head_dim if what == "o" else cfg.intermediate_size


def load_blocks(
    cfg: ModelConfig,
    source: TensorSource,
    gguf: GGUFFile,
    model: SpectrioForCausalLM,
    shard: Shard = Shard(),
) -> BlockPlan:
    """Fill ``model`` for serving from ``gguf``'s blocks where kernels run them and from
    ``source`` (``gguf``, with a trained head attached or not) for everything else, and
    make it ready to serve (a draft vocabulary is the caller's to set).
    ``shard``: ``model`` is a tensor-parallel rank's (:mod:`spectrio.models.architecture.parallel`),
    so it takes that rank's rows of the column-parallel and vocab-parallel matrices and
    its whole blocks of every row of the row-parallel ones. Returns the plan it
    followed."""
    plan = plan_blocks(gguf, cfg)
    for name, kind, nbytes in plan.widened:
        log.warning(
            "no block kernel for this tensor's type: widened to float32",
            tensor=name,
            type=kind,
            float32_mb=round(nbytes / 1e6, 1),
        )
    fill_parameters(model, cfg, source, "float32", shard.rank, shard.size, skip=plan.skipped)
    for name, param in model.named_parameters():  # a shard's parameters come initialised
        if hf_name(name, cfg) in plan.skipped and param._is_initialized():
            param._clear_data()
    d = cfg.hidden_size
    for role, group in plan.groups.items():
        if role == "head":
            continue
        index, what = role.split(".")
        layer = model.model.layers[int(index)]
        attn, mlp = layer.self_attn, layer.mlp
        split = shard.size > 1 and what in ("o", "down")
        rows = _rows(gguf, group.names, group.kind, Shard() if split else shard)
        if split:
            rows = shard.columns(rows, group.kind, _inputs(cfg, what), group.names[0])
        if what == "qkv":
            if attn.q_norm is None:  # the fused float path scales q; blocks scale their d
                n_q = attn.num_heads * attn.head_dim
                rows[:n_q] = scaled_blocks(rows[:n_q], group.kind, attn.scale)
            attn._qkv_weight = ServingMatrix.from_blocks(rows, group.kind, d)
        elif what == "o":
            k = attn.num_heads * attn.head_dim  # this rank's heads
            attn._o_weight = ServingMatrix.from_blocks(rows, group.kind, k)
        elif what == "gate_up":
            mlp._gate_up_weight = ServingMatrix.from_blocks(rows, group.kind, d)
        else:
            k = _inputs(cfg, what) // shard.size
            mlp._down_weight = ServingMatrix.from_blocks(rows, group.kind, k)
    head = plan.groups.get("head")
    if head is not None:
        (name,) = head.names
        matrix = ServingMatrix.from_blocks(shard.rows(gguf.read_blocks(name)), head.kind, d)
        tied = matrix if cfg.tie_word_embeddings and shard.size == 1 else None
        embed = _embedding(gguf, "model.embed_tokens.weight", tied)
        model.serve_rows_from(embed, _embedding_rows(gguf, name), matrix)
    model.eval()
    draft = draft_blocks()
    if draft is not None:
        model.draft_from_blocks(draft)
    model.prepare_serving(release=True)
    gguf.drop_mapped_pages()  # pages the load touched (the header, rows read for checks)
    trim_freed_memory()
    log.info("serving from GGUF blocks", path=gguf.where, matrices=dict(plan.counts()))
    return plan
