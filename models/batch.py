"""The packed variable-length batch a paged forward pass consumes."""

from __future__ import annotations

import dataclasses

import numpy as np
import paddle

from spectrio.models.kv_cache import slots_for_positions


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
            raise ValueError(
                f"{len(self.block_tables)} block tables for {self.num_seqs} sequences"
            )
        for i in range(self.num_seqs):
            pos = self.positions[cu[i] : cu[i + 1]]
            if pos[0] < 0 or np.any(np.diff(pos) != 1):
                raise ValueError(f"sequence {i}: positions must be consecutive and non-negative")
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
        lens = [len(t) for t in token_ids]
        return cls(
            input_ids=np.concatenate([np.asarray(t, dtype=np.int64) for t in token_ids]),
            positions=np.concatenate(
                [np.arange(s, s + n, dtype=np.int64) for s, n in zip(start_positions, lens)]
            ),
            cu_seqlens_q=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
            block_tables=[np.asarray(b, dtype=np.int64) for b in block_tables],
            logits_indices=logits_indices,
        )


@dataclasses.dataclass
class SeqAttention:
    rows: slice
    context_slots: paddle.Tensor  # flat cache slots of positions 0..last
    mask: paddle.Tensor  # additive, [q, ctx]


@dataclasses.dataclass
class AttentionPlan:
    """Per-step addressing shared by every layer: where to write, what to read, the mask."""

    write_slots: paddle.Tensor
    seqs: list[SeqAttention]

    @classmethod
    def build(cls, batch: PackedBatch, block_size: int, dtype: str) -> AttentionPlan:
        cu = batch.cu_seqlens_q
        write: list[np.ndarray] = []
        seqs: list[SeqAttention] = []
        for i in range(batch.num_seqs):
            pos = batch.positions[cu[i] : cu[i + 1]]
            table = batch.block_tables[i]
            write.append(slots_for_positions(table, pos, block_size))
            ctx = int(pos[-1]) + 1
            ctx_slots = slots_for_positions(table, np.arange(ctx), block_size)
            seqs.append(
                SeqAttention(
                    rows=slice(int(cu[i]), int(cu[i + 1])),
                    context_slots=paddle.to_tensor(ctx_slots),
                    mask=causal_mask(pos, ctx, dtype),
                )
            )
        return cls(write_slots=paddle.to_tensor(np.concatenate(write)), seqs=seqs)


def causal_mask(query_positions: np.ndarray, context_len: int, dtype: str) -> paddle.Tensor:
    """Additive mask: row i may see keys at positions ``<= query_positions[i]``."""
    allowed = np.arange(context_len)[None, :] <= np.asarray(query_positions)[:, None]
    return paddle.to_tensor(np.where(allowed, 0.0, -np.inf).astype(dtype))
