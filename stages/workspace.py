"""The rank's workspace: the model, the target and MTP paged caches, and the device
tensors a step leaves behind for the next (the target hidden states of each sequence's
last verified rows, which the next step's MTP catch-up reads).

It holds state and hands it out by seq id; the work on it lives in the stages
(:mod:`.draft`, :mod:`.verify`, :mod:`.sampler`). Messages never carry these tensors.
Only the device worker thread (:mod:`spectrio.runtime.device_worker`) touches it.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from spectrio.models import PackedBatch, PagedKVCache, SpectrioForCausalLM
from spectrio.models.paddle_setup import paddle, use_configured_threads

#: A step's hidden states are shared unsliced by its sequences up to this many rows (a
#: decode or verify step); a sequence of a larger step (a prefill) keeps a copy of its
#: own rows, so one sequence left unscheduled cannot pin a whole prefill's tensor.
SHARE_ROWS = 256


@dataclasses.dataclass
class _StoredHidden:
    """Rows ``first .. first + count - 1`` of ``hidden`` (a step's ``[N, d]`` target hidden
    states, shared by its sequences) are positions ``start_pos ..``. Kept unsliced when
    the step is small: most are never read (no speculation, or superseded by the next
    step), and a slice is an op (and a copy)."""

    start_pos: int
    hidden: paddle.Tensor
    first: int
    count: int


class Workspace:
    def __init__(self, model: SpectrioForCausalLM, num_blocks: int, block_size: int) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.target_cache = PagedKVCache(
            cfg.num_hidden_layers,
            num_blocks,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            model.dtype,
        )
        self.mtp_cache = (
            PagedKVCache(
                1, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, model.dtype
            )
            if cfg.has_mtp
            else None
        )
        self._hidden: dict[int, _StoredHidden] = {}
        self.forward_seconds = 0.0  # wall time inside Paddle forward calls

    def warmup(self, num_tokens: int, max_seq_len: int) -> float:
        """Profile run: one target pass (and one MTP pass) over ``num_tokens`` rows, split
        into sequences of at most ``max_seq_len``. Runs before any request holds a block,
        and every later step writes a position before reading it, so the scratch K/V it
        leaves behind is never read. Returns its wall time."""
        use_configured_threads()  # run on a worker thread: OpenMP counts per thread
        cache = self.target_cache
        lens: list[int] = []
        tables: list[np.ndarray] = []
        next_block = 0
        while num_tokens > 0 and next_block < cache.num_blocks:
            n = min(max_seq_len, num_tokens, (cache.num_blocks - next_block) * self.block_size)
            blocks = -(-n // self.block_size)
            lens.append(n)
            tables.append(np.arange(next_block, next_block + blocks))
            next_block += blocks
            num_tokens -= n
        batch = PackedBatch.from_sequences([[0] * n for n in lens], [0] * len(lens), tables)
        batch.logits_indices = batch.last_rows()
        t0 = time.perf_counter()
        with self.model.step_lock, paddle.no_grad():
            out = self.model.forward(batch, cache)
            if self.mtp_cache is not None:
                self.model.mtp_forward(batch, out.hidden, self.mtp_cache)
        return time.perf_counter() - t0

    def release(self, seq_ids: list[int]) -> None:
        """Drop these sequences' stored hidden states (unknown ids are ignored). Called by
        the sampler stage for requests that finished, and by the draft stage for each
        plan's ``released`` (preemptions, aborts, and finished ones again)."""
        for seq_id in seq_ids:
            self._hidden.pop(seq_id, None)

    def holds(self, seq_id: int) -> bool:
        """Whether the workspace stores device state for this sequence."""
        return seq_id in self._hidden

    @property
    def num_states(self) -> int:
        """Sequences whose device state (hidden rows) the workspace stores."""
        return len(self._hidden)

    def store_hidden(
        self, seq_id: int, start_pos: int, hidden: paddle.Tensor, first: int, count: int
    ) -> None:
        """Keep rows ``first .. first + count - 1`` of ``hidden``, the target hidden states
        of positions ``start_pos ..``."""
        if hidden.shape[0] > SHARE_ROWS:
            hidden, first = hidden[first : first + count], 0
        self._hidden[seq_id] = _StoredHidden(start_pos, hidden, first, count)

    def hidden_rows_of(self, wanted: list[tuple[int, int, int]]) -> paddle.Tensor:
        """The stored hidden rows of positions ``start_pos .. start_pos + count - 1`` of
        each ``(seq_id, start_pos, count)``, stacked in order. When all come from one
        stored step (a decode step's shared tensor, the usual case), that is one gather,
        not a slice per sequence and a concat."""
        found = [(*self._locate(*w), w[2]) for w in wanted]  # (stored, first row, count)
        source = found[0][0].hidden
        if len(found) > 1 and all(stored.hidden is source for stored, _, _ in found):
            rows = np.concatenate([np.arange(lo, lo + n) for _, lo, n in found])
            return paddle.gather(source, self.model.staging.put(rows), axis=0)
        parts = [stored.hidden[lo : lo + n] for stored, lo, n in found]
        return parts[0] if len(parts) == 1 else paddle.concat(parts, axis=0)

    def _locate(self, seq_id: int, start_pos: int, count: int) -> tuple[_StoredHidden, int]:
        """The stored step holding these rows, and the row of ``start_pos`` in it."""
        stored = self._hidden[seq_id]
        lo = start_pos - stored.start_pos
        if lo < 0 or lo + count > stored.count:
            raise RuntimeError(
                f"seq {seq_id}: rows {start_pos}+{count} outside stored hidden rows "
                f"{stored.start_pos}+{stored.count}"
            )
        return stored, stored.first + lo
