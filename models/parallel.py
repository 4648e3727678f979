"""Tensor parallelism: the model sharded across a group of ranks, on plain collectives.

Megatron-style splits, written on ``paddle.distributed.all_reduce`` / ``all_gather``
(fleet's parallel layers do not run on CPU with gloo; the plain collectives do):

* q/k/v and gate/up are column-parallel: each rank holds ``H/n`` query heads, ``KVH/n``
  KV heads and ``F/n`` MLP columns, so attention and SwiGLU run rank-locally. The
  fused serving matrices (:meth:`Attention.fuse_qkv`, :meth:`MLP.fuse`) are built from
  the local slices, so the folded norm weight (a full ``[d]`` row scale) and the q
  pre-scale stay consistent with no special case.
* o and down are row-parallel: each rank's partial ``[N, d]`` output is summed with one
  ``all_reduce``.
* The embedding and the LM head are vocab-parallel: rank r holds rows
  ``[r V/n, (r+1) V/n)``; a lookup is masked and all-reduced, and logits are
  all-gathered to the full vocabulary, so every rank sees bit-identical logits (the
  draft argmax never diverges between ranks).
* The MTP layer's block is sharded the same way; its small ``eh_proj`` and norms are
  replicated. The paged KV caches hold ``KVH/n`` heads per rank.

Each rank reads only its slice of every tensor from safetensors (``get_slice``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import structlog
from safetensors import SafetensorError, safe_open

from spectrio.models.paddle_setup import configure_paddle, paddle  # first: imports Paddle

# isort: split
import paddle.distributed as dist
import paddle.nn.functional as F
from paddle import nn

from spectrio.errors import CheckpointError, ConfigError
from spectrio.models.batch import AttentionPlan
from spectrio.models.config import DType, ModelConfig, ModelConfigError
from spectrio.models.kv_cache import PagedKVCache
from spectrio.models.layers import KV, MLP, Attention, DecoderLayer, RMSNorm, RopeRows
from spectrio.models.loader import (
    LoadedModel,
    hf_name,
    is_linear,
    refuse_unexpected,
    resolve_path,
    tokenizer_of,
)
from spectrio.models.model import MTPLayer, SharedHead, SpectrioForCausalLM

log = structlog.get_logger("spectrio.models.parallel")

__all__ = [
    "ParallelCausalLM",
    "TPShard",
    "check_divisible",
    "load_sharded",
]


@dataclasses.dataclass(frozen=True)
class TPShard:
    """This rank's place in the group: ``rank`` of ``size``. The collectives run on
    Paddle's default process group, which the caller has initialised."""

    rank: int
    size: int

    def span(self, total: int) -> tuple[int, int]:
        """This rank's contiguous share ``[lo, hi)`` of ``total`` (divisible by size)."""
        part = total // self.size
        return self.rank * part, (self.rank + 1) * part

    def all_reduce(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.size > 1 and x.size:
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: paddle.Tensor) -> paddle.Tensor:
        """Concatenate every rank's ``x`` along the last axis, in rank order."""
        if self.size == 1:
            return x
        if not x.size:
            return paddle.zeros([*x.shape[:-1], x.shape[-1] * self.size], dtype=x.dtype)
        parts: list[paddle.Tensor] = []
        dist.all_gather(parts, x)
        return paddle.concat(parts, axis=-1)


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """Refuse a group size that does not split the heads, KV heads, MLP columns and vocab
    evenly, naming the numbers."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(cfg, name)
        if value % size:
            raise ConfigError(
                f"tensor_parallel_size: the model's {name} ({value}) is not divisible by "
                f"tensor_parallel_size ({size})"
            )


# ---- layers ---------------------------------------------------------------------------


class ParallelAttention(Attention):
    """Attention over this rank's ``H/n`` query and ``KVH/n`` KV heads; the o projection's
    partial sums are all-reduced."""

    def __init__(self, cfg: ModelConfig, tp: TPShard) -> None:
        nn.Layer.__init__(self)
        self.tp = tp
        self.num_heads = cfg.num_attention_heads // tp.size
        self.num_kv_heads = cfg.num_key_value_heads // tp.size
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.scale = 1.0 / math.sqrt(self.head_dim)
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias_attr=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias_attr=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias_attr=False)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias_attr=False)
        self._qkv_weight = self._o_weight = None

    def forward_dense(
        self,
        x: paddle.Tensor,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        mask: paddle.Tensor,
        past: KV | None = None,
    ) -> tuple[paddle.Tensor, KV]:
        out, present = super().forward_dense(x, cos, sin, mask, past)
        return self.tp.all_reduce(out), present

    def forward_paged(
        self,
        x: paddle.Tensor,
        rope: RopeRows,
        plan: AttentionPlan,
        cache: PagedKVCache,
        layer: int,
    ) -> paddle.Tensor:
        return self.tp.all_reduce(super().forward_paged(x, rope, plan, cache, layer))


class ParallelMLP(MLP):
    """SwiGLU over this rank's ``F/n`` columns; the down projection is all-reduced."""

    def __init__(self, cfg: ModelConfig, tp: TPShard) -> None:
        nn.Layer.__init__(self)
        self.tp = tp
        d, f = cfg.hidden_size, cfg.intermediate_size // tp.size
        self.gate_proj = nn.Linear(d, f, bias_attr=False)
        self.up_proj = nn.Linear(d, f, bias_attr=False)
        self.down_proj = nn.Linear(f, d, bias_attr=False)
        self._gate_up_weight = self._down_weight = None

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.tp.all_reduce(super().forward(x))

    def forward_fused(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.tp.all_reduce(super().forward_fused(x))


def _init_block(layer: DecoderLayer, cfg: ModelConfig, tp: TPShard) -> None:
    """The attributes :class:`DecoderLayer` sets, with the sharded attention and MLP (built
    directly, so no full-size weight is ever allocated)."""
    layer.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    layer.self_attn = ParallelAttention(cfg, tp)
    layer.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    layer.mlp = ParallelMLP(cfg, tp)


class ParallelDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, tp: TPShard) -> None:
        nn.Layer.__init__(self)
        _init_block(self, cfg, tp)


class ParallelMTPLayer(MTPLayer):
    def __init__(self, cfg: ModelConfig, tp: TPShard) -> None:
        nn.Layer.__init__(self)
        _init_block(self, cfg, tp)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias_attr=False)
        self.shared_head = SharedHead(cfg)


class VocabParallelEmbedding(nn.Layer):
    """Rows ``[lo, hi)`` of the embedding; a token outside them contributes zeros, and the
    all-reduce assembles each row from the one rank that holds it."""

    def __init__(self, cfg: ModelConfig, tp: TPShard) -> None:
        super().__init__()
        self.tp = tp
        self.lo, self.hi = tp.span(cfg.vocab_size)
        self.weight = self.create_parameter(
            [self.hi - self.lo, cfg.hidden_size],
            default_initializer=nn.initializer.Normal(0.0, 0.02),
        )

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        inside = paddle.logical_and(ids >= self.lo, ids < self.hi)
        local = paddle.where(inside, ids - self.lo, paddle.zeros_like(ids))
        rows = F.embedding(local, self.weight) * inside.unsqueeze(-1).astype(self.weight.dtype)
        return self.tp.all_reduce(rows)


class _ParallelDecoderModel(nn.Layer):
    def __init__(self, cfg: ModelConfig, tp: TPShard) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg, tp)
        self.layers = nn.LayerList(
            [ParallelDecoderLayer(cfg, tp) for _ in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class ParallelCausalLM(SpectrioForCausalLM):
    """:class:`SpectrioForCausalLM` with this rank's shard of every split weight. The
    forward passes are the parent's; only the layers and the logits differ. ``config``
    is the full model's."""

    def __init__(self, cfg: ModelConfig, tp: TPShard) -> None:
        nn.Layer.__init__(self)
        check_divisible(cfg, tp.size)
        configure_paddle()
        self.config = cfg
        self.tp = tp
        self.model = _ParallelDecoderModel(cfg, tp)  # type: ignore[assignment]
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size // tp.size, bias_attr=False)
        )
        self.mtp = ParallelMTPLayer(cfg, tp) if cfg.has_mtp else None
        self._init_serving_state()

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank's caches hold."""
        return self.config.num_key_value_heads // self.tp.size

    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """Local vocab shard's logits, gathered to the full vocabulary on every rank."""
        return self.tp.all_gather_last(super().compute_logits(hidden))

    def _embed(self, ids: paddle.Tensor) -> paddle.Tensor:
        return self.model.embed_tokens(ids)  # masked lookup and all-reduce


# ---- loading --------------------------------------------------------------------------

# Which axis of the Hugging Face tensor ([out, in] for linears) each parameter splits on.
_ROW_SPLIT = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight")
_ROW_SPLIT_MORE = ("up_proj.weight", "embed_tokens.weight", "lm_head.weight")
_COL_SPLIT = ("o_proj.weight", "down_proj.weight")


def _split_axis(name: str) -> int | None:
    if name.endswith(_ROW_SPLIT + _ROW_SPLIT_MORE):
        return 0
    if name.endswith(_COL_SPLIT):
        return 1
    return None


def build_sharded(cfg: ModelConfig, tp: TPShard, dtype: DType = "float32") -> ParallelCausalLM:
    """An uninitialised-for-serving shard (weights are set by :func:`load_sharded`)."""
    model = ParallelCausalLM(cfg, tp)
    if dtype != "float32":
        model.to(dtype=dtype)
    model.eval()
    return model


def load_sharded(path_or_name: str | Path, tp: TPShard, dtype: DType = "float32") -> LoadedModel:
    """This rank's shard of the checkpoint at ``path_or_name``: every split tensor is read
    with ``safe_open(...).get_slice`` over this rank's rows or columns only; replicated
    ones (norms, ``eh_proj``) whole. Shapes are checked against the full model, and a
    missing, misshapen or unexpected tensor raises :class:`CheckpointError` as
    :func:`spectrio.models.load` does; an indivisible model raises :class:`ConfigError`."""
    t0 = time.perf_counter()
    folder = resolve_path(path_or_name)
    try:
        cfg = ModelConfig.from_json(folder / "config.json")
    except ModelConfigError as exc:
        raise CheckpointError(f"{folder / 'config.json'}: {exc}") from exc
    check_divisible(cfg, tp.size)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files")
    handles: dict[str, Any] = {}
    where: dict[str, Any] = {}
    try:
        for f in files:
            h = safe_open(str(f), framework="numpy")
            handles[str(f)] = h
            for key in h.keys():
                if key in where:
                    raise CheckpointError(f"{f}: tensor {key!r} appears in more than one file")
                where[key] = h
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{folder}: corrupt or unreadable safetensors file ({exc})") from exc
    model = build_sharded(cfg, tp, dtype)
    expected: set[str] = set()
    with paddle.no_grad():
        for name, param in model.named_parameters():
            hf = hf_name(name, cfg)
            expected.add(hf)
            local = list(param.shape)
            local_hf = local[::-1] if is_linear(param, name) else local
            axis = _split_axis(name)
            want = list(local_hf)
            if axis is not None:
                want[axis] *= tp.size
            if hf not in where:
                raise CheckpointError(f"{folder}: missing tensor {hf!r} (expected shape {want})")
            sl = where[hf].get_slice(hf)
            shape = list(sl.get_shape())
            if shape != want:
                raise CheckpointError(f"{folder}: tensor {hf!r} has shape {shape}, expected {want}")
            if axis is None:
                arr = sl[:]
            else:
                lo, hi = tp.span(want[axis])
                arr = sl[lo:hi] if axis == 0 else sl[:, lo:hi]
            if not np.issubdtype(arr.dtype, np.floating):
                raise CheckpointError(f"{folder}: tensor {hf!r} has non-float dtype {arr.dtype}")
            value = arr.T if is_linear(param, name) else arr
            param.set_value(np.ascontiguousarray(value).astype(dtype))
    refuse_unexpected(folder, cfg, set(where) - expected)
    model.eval()
    tokenizer = tokenizer_of(folder, cfg)
    seconds = time.perf_counter() - t0
    log.info("model shard loaded", path=str(folder), rank=tp.rank, size=tp.size, seconds=seconds)
    return LoadedModel(
        model=model, config=cfg, tokenizer=tokenizer, path=folder, load_seconds=seconds
    )
