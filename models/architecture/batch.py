"""The packed variable-length batch a paged forward pass consumes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from itertools import accumulate, chain

import numpy as np

from spectrio.models.architecture.kv_cache import PagedKVCache
from spectrio.models.ops.paddle_setup import paddle


@dataclasses.dataclass
class PackedBatch:
    """Every sequence's new positions, packed back to back.

    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` are sequence i's rows. A sequence's positions
    are consecutive; each row attends causally to positions ``0..pos`` of its own
    sequence, read from the paged cache through ``block_tables[i]``. One layout serves
    prefill chunks (many rows), decode (one row) and verification (k+1 rows).
    """

    input_ids: np.ndarray  # int64 [N]
    positions: np.ndarray  # int64 [N]
    cu_seqlens_q: np.ndarray  # int64 [B+1]
    block_tables: list[np.ndarray]  # B arrays of block ids
    logits_indices: np.ndarray | None = None  # rows that need logits; None means all

    def __post_init__(self) -> None:
        self.input_ids = np.asarray(self.input_ids, dtype=np.int64)
        self.positions = np.asarray(self.positions, dtype=np.int64)
        self.cu_seqlens_q = np.asarray(self.cu_seqlens_q, dtype=np.int64)
        n = self.input_ids.shape[0]
        if self.input_ids.ndim != 1 or self.positions.shape != (n,):
            raise ValueError("input_ids and positions must be 1-D arrays of equal length")
        cu = self.cu_seqlens_q
        if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or cu[-1] != n or np.any(np.diff(cu) <= 0):
            raise ValueError("cu_seqlens_q must rise strictly from 0 to the number of rows")
        if len(self.block_tables) != self.num_seqs:
            raise ValueError(f"{len(self.block_tables)} block tables for {self.num_seqs} sequences")
        seq_of_row = np.repeat(np.arange(self.num_seqs), np.diff(cu))
        first = self.positions[cu[:-1]]
        step_ok = self.positions == first[seq_of_row] + (np.arange(n) - cu[:-1][seq_of_row])
        if np.any(first < 0) or not step_ok.all():
            bad = (
                int(seq_of_row[np.flatnonzero(~step_ok)[0]])
                if not step_ok.all()
                else int(np.flatnonzero(first < 0)[0])
            )
            raise ValueError(f"sequence {bad}: positions must be consecutive and non-negative")
        if self.logits_indices is not None:
            self.logits_indices = np.asarray(self.logits_indices, dtype=np.int64)

    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens_q.size - 1)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.size)

    def last_rows(self) -> np.ndarray:
        """Row index of each sequence's last new position."""
        return self.cu_seqlens_q[1:] - 1

    @classmethod
    def from_sequences(
        cls,
        token_ids: list[list[int]],
        start_positions: list[int],
        block_tables: list[np.ndarray],
        logits_indices: np.ndarray | None = None,
    ) -> PackedBatch:
        """The batch of these sequences' new tokens. Built consistent by construction, so
        it checks its arguments in plain Python and skips :meth:`__post_init__`'s array
        checks: this runs three times a speculative step, and those checks cost more than
        the building."""
        lens = [len(t) for t in token_ids]
        if not lens or len(start_positions) != len(lens) or len(block_tables) != len(lens):
            raise ValueError(
                f"{len(lens)} sequences, {len(start_positions)} start positions and "
                f"{len(block_tables)} block tables: need one of each per sequence, at least one"
            )
        if min(lens) < 1:
            raise ValueError(f"sequence {lens.index(0)} has no new tokens")
        if min(start_positions) < 0:
            bad = next(i for i, s in enumerate(start_positions) if s < 0)
            raise ValueError(f"sequence {bad}: positions must be consecutive and non-negative")
        total = sum(lens)
        if len(lens) == 1:
            input_ids = np.array(token_ids[0], dtype=np.int64)
            positions = np.arange(start_positions[0], start_positions[0] + total, dtype=np.int64)
        else:
            input_ids = np.fromiter(chain.from_iterable(token_ids), dtype=np.int64, count=total)
            positions = np.fromiter(
                chain.from_iterable(
                    range(s, s + n) for s, n in zip(start_positions, lens, strict=True)
                ),
                dtype=np.int64,
                count=total,
            )
        batch = cls.__new__(cls)
        batch.input_ids = input_ids
        batch.positions = positions
        batch.cu_seqlens_q = np.fromiter(
            accumulate(lens, initial=0), dtype=np.int64, count=len(lens) + 1
        )
        batch.block_tables = [
            t if isinstance(t, np.ndarray) and t.dtype == np.int64 else np.asarray(t, np.int64)
            for t in block_tables
        ]
        batch.logits_indices = (
            None if logits_indices is None else np.asarray(logits_indices, dtype=np.int64)
        )
        return batch


#: A single sequence with at most this many query rows (a verification, an MTP catch-up)
#: attends with K/V broadcast over its rows (:attr:`AttentionPlan.broadcast_kv`).
BROADCAST_KV_MAX_Q = 8

#: A sequence with at most this many query rows (a decode step, a verification) is not
#: padded to a prefill chunk's length when the two share a step: the batch's attention runs
#: in two groups (:attr:`AttentionPlan.groups`).
SHORT_Q = 8

#: Above this many scores per layer the mask is broadcast over KV heads instead of being
#: stored at full size (a prefill chunk), so it never costs as much memory as the scores.
FULL_MASK_LIMIT = 1 << 20


@dataclasses.dataclass
class AttentionPlan:
    """Per-step addressing shared by every layer, for one batched attention per layer.

    Sequences are padded to ``max_q`` query rows and ``max_ctx`` context positions (whole
    blocks), so a layer attends for the whole batch with two matmuls and no loop over
    sequences:

    * ``write_rows`` [N * KVH]: cache pool row of every packed row's K/V per KV head
      (:meth:`PagedKVCache.write_rows`);
    * ``context_blocks`` [B * KVH * W]: the blocks holding positions ``0..ctx_b-1`` per
      sequence and head, padded with the sequence's first block (the mask hides it);
      ``max_ctx = W * block_size``;
    * ``mask`` [B, 1, max_q, max_ctx] (numpy): additive, causal within each sequence;
      padded query rows may see position 0 only, so their softmax stays finite (they are
      dropped). :meth:`mask_for_groups` lays it out for the scores;
    * ``pad_rows`` [B * max_q] and ``unpad_rows`` [N]: packed row of each padded query row,
      and padded row of each packed row; both None when every sequence has ``max_q`` rows
      (decode and verification), where packing already is the padded layout;
    * ``groups`` and ``order``: when a step mixes short sequences (at most ``SHORT_Q``
      rows: decode, verification) with prefill chunks, one plan per kind, each padded only
      to its own longest sequence; a group's ``pad_rows`` index the whole batch's packed
      rows, and ``order`` puts the groups' concatenated outputs back in packed order (None
      when they already are). Padded to a 48-row prefill, 15 verifications of 3 rows would
      cost 16x their attention, and with speculation requests finish on different steps,
      so new ones start one at a time, beside other requests' verifications.
    """

    write_rows: paddle.Tensor
    context_blocks: paddle.Tensor
    mask: np.ndarray
    num_seqs: int
    num_kv_heads: int
    max_q: int
    max_ctx: int
    pad_rows: paddle.Tensor | None
    unpad_rows: paddle.Tensor | None
    stage: Callable[[np.ndarray], paddle.Tensor] = paddle.to_tensor
    _group_masks: dict[int, paddle.Tensor] = dataclasses.field(default_factory=dict)
    groups: list[AttentionPlan] | None = None
    order: paddle.Tensor | None = None

    @classmethod
    def build(
        cls,
        batch: PackedBatch,
        cache: PagedKVCache,
        dtype: str,
        stage: Callable[[np.ndarray], paddle.Tensor] = paddle.to_tensor,
    ) -> AttentionPlan:
        plan = cls._build(batch, cache, dtype, stage)
        if plan.pad_rows is None:  # equal rows (decode, verification): nothing to split
            return plan
        cu = batch.cu_seqlens_q
        q_lens = cu[1:] - cu[:-1]
        short = q_lens <= SHORT_Q
        if int(short.sum()) < 2 or short.all():
            return plan
        plan.groups, parts = [], []
        for seqs in (np.flatnonzero(short), np.flatnonzero(~short)):
            rows = np.concatenate([np.arange(cu[i], cu[i + 1]) for i in seqs])
            sub = PackedBatch.__new__(PackedBatch)
            sub.input_ids, sub.positions = batch.input_ids[rows], batch.positions[rows]
            sub.cu_seqlens_q = np.concatenate([[0], np.cumsum(q_lens[seqs])])
            sub.block_tables = [batch.block_tables[i] for i in seqs]
            sub.logits_indices = None
            plan.groups.append(cls._build(sub, cache, dtype, stage, rows))
            parts.append(rows)
        packed_of = np.concatenate(parts)  # packed row of each concatenated output row
        if not np.array_equal(packed_of, np.arange(packed_of.size)):
            plan.order = stage(np.argsort(packed_of))
        return plan

    @classmethod
    def _build(
        cls,
        batch: PackedBatch,
        cache: PagedKVCache,
        dtype: str,
        stage: Callable[[np.ndarray], paddle.Tensor],
        rows: np.ndarray | None = None,
    ) -> AttentionPlan:
        """The plan of one group; ``rows``: the whole batch's packed row of each of this
        batch's rows (a group of a mixed step), which ``pad_rows`` then index."""
        block_size = cache.block_size
        cu = batch.cu_seqlens_q
        b = batch.num_seqs
        positions = batch.positions
        first_pos = positions[cu[:-1]]
        q_lens = cu[1:] - cu[:-1]
        max_q = int(q_lens.max())
        uniform = b == 1 or int(q_lens.min()) == max_q  # decode and verification
        needed = _blocks_read(batch, block_size)
        table_lens = [len(t) for t in batch.block_tables]
        tables = _padded_tables(batch.block_tables)
        seq_of_row = np.repeat(np.arange(b), max_q if uniform else q_lens)
        write = tables[seq_of_row, positions // block_size] * block_size + positions % block_size
        width = int(needed.max())
        # Blocks past a sequence's table read its first block (valid; the mask hides it).
        ctx_tables = tables[:, :width]
        if min(table_lens) < width:
            ctx_tables = np.where(ctx_tables < 0, tables[:, :1], ctx_tables)
        max_ctx = width * block_size
        # Query position of padded row (b, t); rows past a sequence's end see position 0
        # only, so their softmax stays finite.
        t = np.arange(max_q)
        qpos = first_pos[:, None] + t[None, :]
        pad_rows = unpad_rows = None
        if not uniform:
            valid = t[None, :] < q_lens[:, None]
            qpos = np.where(valid, qpos, 0)
            padded = np.where(valid, cu[:-1, None] + t[None, :], 0).reshape(-1)
            pad_rows = stage(padded if rows is None else rows[padded])
            unpad_rows = stage(np.flatnonzero(valid.reshape(-1)))
        elif rows is not None:
            pad_rows = stage(rows)
        zero, minus_inf = np.array([0.0, -np.inf], dtype=dtype)
        mask = np.where(
            np.arange(max_ctx)[None, None, None, :] <= qpos[:, None, :, None], zero, minus_inf
        )
        return cls(
            write_rows=stage(cache.write_rows(write)),
            context_blocks=stage(cache.block_rows(ctx_tables)),
            mask=mask,
            num_seqs=b,
            num_kv_heads=cache.num_kv_heads,
            max_q=max_q,
            max_ctx=max_ctx,
            pad_rows=pad_rows,
            unpad_rows=unpad_rows,
            stage=stage,
        )

    @property
    def broadcast_kv(self) -> bool:
        """Whether attention keeps the query rows outside the KV heads' matrices: scores
        ``[1, max_q, KVH, G, max_ctx]`` from queries ``[1, max_q, KVH, G, D]`` against K/V
        ``[1, 1, KVH, max_ctx, D]`` broadcast over the rows, instead of transposing the
        rows into ``[1, KVH, G * max_q, D]`` and back. For one sequence and a few rows
        (batch 1: a verification, an MTP catch-up) that saves a layer two copies and two
        ops. The broadcast runs one small GEMM per row and head, so from a few sequences
        or rows (a prefill chunk) it is slower."""
        return self.num_seqs == 1 and 1 < self.max_q <= BROADCAST_KV_MAX_Q

    def mask_for_groups(self, group: int) -> paddle.Tensor:
        """The mask for scores ``[B, KVH, group * max_q, max_ctx]`` (rows query-head-major
        within a KV head), built once per group size: at full size where that is small (a
        broadcasting add cost 16x a plain one at batch 16 on CPU), else ``[B, 1, ...]`` to
        broadcast. With :attr:`broadcast_kv`, for scores ``[1, max_q, KVH, group,
        max_ctx]``."""
        cached = self._group_masks.get(group)
        if cached is None:
            b, _, q, c = self.mask.shape
            if self.broadcast_kv:
                tiled = np.empty((b, q, self.num_kv_heads, group, c), dtype=self.mask.dtype)
                tiled[...] = self.mask.reshape(b, q, 1, 1, c)
            else:
                full = self.mask.size * group * self.num_kv_heads <= FULL_MASK_LIMIT
                heads = self.num_kv_heads if full else 1
                tiled = np.empty((b, heads, group * q, c), dtype=self.mask.dtype)
                tiled.reshape(b, heads, group, q, c)[...] = self.mask.reshape(b, 1, 1, q, c)
            cached = self._group_masks[group] = self.stage(tiled)
        return cached


@dataclasses.dataclass
class LayerRows:
    """A step's rows as the native layer op addresses them (``csrc/spectrio_layer.cc``),
    shared by every layer: row r is position ``positions[r]`` of sequence ``row_seq[r]``,
    whose blocks are ``tables[row_seq[r]]`` (-1 past a table's end; the op checks every
    block a row reads), and rotates with row ``positions[r]`` of the ``rope`` tables."""

    positions: paddle.Tensor  # int64 [N]
    row_seq: paddle.Tensor  # int64 [N]
    tables: paddle.Tensor  # int64 [B, W]
    rope: tuple[paddle.Tensor, paddle.Tensor]  # cos, sin [P, head_dim / 2]

    @classmethod
    def build(
        cls,
        batch: PackedBatch,
        block_size: int,
        rope: tuple[paddle.Tensor, paddle.Tensor],
        stage: Callable[[np.ndarray], paddle.Tensor] = paddle.to_tensor,
    ) -> LayerRows:
        _blocks_read(batch, block_size)
        cu = batch.cu_seqlens_q
        b = batch.num_seqs
        row_seq = (
            np.zeros(batch.num_tokens, np.int64)
            if b == 1
            else np.repeat(np.arange(b, dtype=np.int64), np.diff(cu))
        )
        return cls(
            positions=stage(batch.positions),
            row_seq=stage(row_seq),
            tables=stage(_padded_tables(batch.block_tables)),
            rope=rope,
        )

    @property
    def as_tuple(self) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        return self.positions, self.row_seq, self.tables


def _blocks_read(batch: PackedBatch, block_size: int) -> np.ndarray:
    """The blocks each sequence's rows read (``[B]``); ``ValueError`` naming the first
    sequence whose block table is too short for them."""
    cu = batch.cu_seqlens_q
    last = batch.positions[cu[1:] - 1]
    needed = last // block_size + 1
    table_lens = [len(t) for t in batch.block_tables]
    for i, (n, have) in enumerate(zip(needed.tolist(), table_lens, strict=True)):
        if n > have:
            raise ValueError(
                f"block table of {have} blocks cannot hold position {int(last[i])} "
                f"(block_size={block_size})"
            )
    return needed


def _padded_tables(block_tables: list[np.ndarray]) -> np.ndarray:
    """Block tables as one ``[B, max_blocks]`` array (-1 past each table's end)."""
    if len(block_tables) == 1:
        return np.asarray(block_tables[0], dtype=np.int64)[None]
    width = max(len(t) for t in block_tables)
    out = np.full((len(block_tables), width), -1, dtype=np.int64)
    for i, t in enumerate(block_tables):
        out[i, : len(t)] = t
    return out
