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
import time
from pathlib import Path

import numpy as np
import structlog

from spectrio.models.ops.paddle_setup import configure_paddle, paddle  # first: imports Paddle

# isort: split
import paddle.distributed as dist
import paddle.nn.functional as F
from paddle import nn

from spectrio.errors import ConfigError
from spectrio.models.architecture.config import DType, ModelConfig
from spectrio.models.architecture.layers import MLP, Attention, DecoderLayer, RMSNorm
from spectrio.models.architecture.model import SpectrioForCausalLM
from spectrio.models.architecture.mtp_layer import MTPLayer, SharedHead
from spectrio.models.loading.loader import (
    LoadedModel,
    blocks_run,
    fill_model,
    loaded_model,
    open_checkpoint,
    read_config,
    resolve_path,
)

log = structlog.get_logger("spectrio.models.architecture.parallel")

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
    """Attention over this rank's ``H/n`` query and ``KVH/n`` KV heads (and their q/k/v
    biases); the o projection's partial sums are all-reduced, then its replicated bias
    added once."""

    def __init__(self, cfg: ModelConfig, tp: TPShard) -> None:
        super().__init__(cfg, tp.size)
        self.tp = tp

    def _reduce(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.tp.all_reduce(x)


class ParallelMLP(MLP):
    """SwiGLU over this rank's ``F/n`` columns; the down projection is all-reduced, then
    its replicated bias added once."""

    def __init__(self, cfg: ModelConfig, tp: TPShard) -> None:
        super().__init__(cfg, tp.size)
        self.tp = tp

    def _reduce(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.tp.all_reduce(x)


def _init_block(layer: DecoderLayer, cfg: ModelConfig, tp: TPShard) -> None:
    """The attributes :class:`DecoderLayer` sets, with the sharded attention and MLP (built
    directly, so no full-size weight is ever allocated)."""
    layer.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    layer.self_attn = ParallelAttention(cfg, tp)
    layer.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    layer.mlp = ParallelMLP(cfg, tp)


class ParallelDecoderLayer(DecoderLayer):
    partial_sums = True

    def __init__(self, cfg: ModelConfig, tp: TPShard) -> None:
        nn.Layer.__init__(self)
        _init_block(self, cfg, tp)


class ParallelMTPLayer(MTPLayer):
    partial_sums = True

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

    def compute_draft_logits(
        self, hidden: paddle.Tensor
    ) -> tuple[paddle.Tensor, np.ndarray | None]:
        # Each rank holds a slice of the vocabulary: a shard drafts over all of it.
        return self.compute_logits(hidden), None

    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """Local vocab shard's logits, gathered to the full vocabulary on every rank."""
        return self.tp.all_gather_last(super().compute_logits(hidden))

    def _embed(self, ids: np.ndarray) -> paddle.Tensor:
        if self._embed_rows is not None:  # every rank reads whole rows from the file
            return self._embed_rows(self.staging.put(np.asarray(ids, dtype=np.int64)))
        return self.model.embed_tokens(self.staging.put(ids))  # masked lookup, all-reduce


# ---- loading --------------------------------------------------------------------------


def build_sharded(cfg: ModelConfig, tp: TPShard, dtype: DType = "float32") -> ParallelCausalLM:
    """An uninitialised-for-serving shard (weights are set by :func:`load_sharded`)."""
    model = ParallelCausalLM(cfg, tp)
    if dtype != "float32":
        model.to(dtype=dtype)
    model.eval()
    return model


def load_sharded(
    path_or_name: str | Path, tp: TPShard, dtype: DType = "float32", serving: bool = False
) -> LoadedModel:
    """This rank's shard of the checkpoint at ``path_or_name``: every split tensor is read
    over this rank's rows or columns only (``get_slice`` from safetensors; a GGUF tensor
    is dequantized whole, then sliced); replicated ones (norms, row-parallel biases,
    ``eh_proj``) whole. Shapes are checked against the full model, and a missing,
    misshapen or unexpected tensor raises :class:`CheckpointError` as
    :func:`spectrio.models.load` does; an indivisible model raises :class:`ConfigError`.
    ``serving`` as for :func:`spectrio.models.load`."""
    t0 = time.perf_counter()
    path = resolve_path(path_or_name)
    check_divisible(read_config(path), tp.size)
    blocks = serving and dtype == "float32" and path.is_file() and blocks_run()
    cfg, source, tokenizer, template = open_checkpoint(path, str(path_or_name), blocks=blocks)
    model = build_sharded(cfg, tp, dtype)
    fill_model(
        model, cfg, source, dtype, serving=serving, blocks=blocks, rank=tp.rank, size=tp.size
    )
    loaded = loaded_model(model, cfg, source, tokenizer, path, template, t0)
    log.info(
        "model shard loaded",
        path=str(path),
        rank=tp.rank,
        size=tp.size,
        seconds=loaded.load_seconds,
    )
    return loaded
