"""The rank's workspace: the model, the target and MTP paged caches, and the device
tensors a step leaves behind (hidden states per sequence, logits per step).

Stages never serialise these; messages refer to them by step, slot and seq id. Every
method is blocking Paddle work, meant for ``trio.to_thread.run_sync`` behind the
device's ``CapacityLimiter(1)``.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import paddle

from spectrio.core.messages import StepPlan
from spectrio.models import PackedBatch, PagedKVCache, SpectrioForCausalLM


@dataclasses.dataclass
class _StoredHidden:
    start_pos: int
    rows: paddle.Tensor  # [n, d] target hidden states of positions start_pos..start_pos+n-1


@dataclasses.dataclass
class _StepLogits:
    logits: paddle.Tensor  # [M, V], the sampled rows of every sampling slot
    offsets: dict[int, tuple[int, int]]  # slot -> (first row, row count)


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
        self._logits: dict[int, _StepLogits] = {}
        self.forward_seconds = 0.0  # wall time inside Paddle forward calls

    def warmup(self, num_tokens: int, max_seq_len: int) -> float:
        """Profile run: one target pass (and one MTP pass) over ``num_tokens`` rows, split
        into sequences of at most ``max_seq_len``. Runs before any request holds a block,
        and every later step writes a position before reading it, so the scratch K/V it
        leaves behind is never read. Returns its wall time."""
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
        with paddle.no_grad():
            out = self.model.forward(batch, cache)
            if self.mtp_cache is not None:
                self.model.mtp_forward(batch, out.hidden, self.mtp_cache)
        return time.perf_counter() - t0

    def release(self, seq_ids: list[int]) -> None:
        """Drop these sequences' stored hidden states (unknown ids are ignored). Called by
        the sampler stage for requests that finished, by the scheduler actor for aborted
        ones, and by the draft stage for each plan's ``released`` (preemptions, and the
        rest again). Each call is a handful of dict pops, atomic under the GIL."""
        for seq_id in seq_ids:
            self._hidden.pop(seq_id, None)

    def holds(self, seq_id: int) -> bool:
        """Whether the workspace stores device state for this sequence."""
        return seq_id in self._hidden

    @property
    def num_states(self) -> int:
        """Sequences whose device state (hidden rows) the workspace stores."""
        return len(self._hidden)

    # ---- draft: MTP catch-up over the last pass's accepted rows, then substeps -------

    def draft(self, plan: StepPlan) -> StepPlan:
        """Fill ``drafts`` for every sequence that wants them; writes real MTP entries."""
        self.release(plan.released)
        catch_up = [w for w in plan.seqs if w.mtp_token_ids]
        if not catch_up:
            return plan
        if self.mtp_cache is None:
            raise RuntimeError("speculation needs a checkpoint with an MTP layer")
        prev_rows = []
        for w in catch_up:
            stored = self._hidden[w.seq_id]
            lo = w.mtp_start - stored.start_pos
            hi = lo + len(w.mtp_token_ids)
            if lo < 0 or hi > stored.rows.shape[0]:
                raise RuntimeError(
                    f"seq {w.seq_id}: MTP catch-up {w.mtp_start}+{len(w.mtp_token_ids)} outside "
                    f"stored hidden rows {stored.start_pos}+{stored.rows.shape[0]}"
                )
            prev_rows.append(stored.rows[lo:hi])
        batch = PackedBatch.from_sequences(
            [w.mtp_token_ids for w in catch_up],
            [w.mtp_start for w in catch_up],
            [np.asarray(w.block_table) for w in catch_up],
        )
        wanting = [i for i, w in enumerate(catch_up) if w.num_drafts > 0]
        batch.logits_indices = batch.last_rows()[wanting]
        t0 = time.perf_counter()
        with paddle.no_grad():
            out = self.model.mtp_forward(batch, paddle.concat(prev_rows, axis=0), self.mtp_cache)
            active = [catch_up[i] for i in wanting]
            hidden = (
                paddle.gather(out.hidden, paddle.to_tensor(batch.logits_indices), axis=0)
                if active
                else None
            )
            logits = out.logits
            substep = 0
            while active:
                tokens = paddle.argmax(logits, axis=-1).numpy().tolist()
                for w, tok in zip(active, tokens, strict=True):
                    w.drafts.append(int(tok))
                substep += 1
                keep = [i for i, w in enumerate(active) if w.num_drafts > substep]
                if not keep:
                    break
                active = [active[i] for i in keep]
                assert hidden is not None
                hidden = paddle.gather(
                    hidden, paddle.to_tensor(np.asarray(keep, dtype=np.int64)), axis=0
                )
                step_batch = PackedBatch.from_sequences(
                    [[w.drafts[-1]] for w in active],
                    [w.mtp_start + len(w.mtp_token_ids) - 1 + substep for w in active],
                    [np.asarray(w.block_table) for w in active],
                )
                out = self.model.mtp_forward(step_batch, hidden, self.mtp_cache)
                hidden, logits = out.hidden, out.logits
        self.forward_seconds += time.perf_counter() - t0
        return plan

    # ---- verify: one target pass over prefill chunks and [last token, drafts...] -----

    def verify(self, plan: StepPlan) -> None:
        if not plan.seqs:  # a step that only reports aborts: nothing to run
            self._logits[plan.step] = _StepLogits(paddle.zeros([0]), {})
            return
        rows = [w.token_ids + (w.drafts if w.sample else []) for w in plan.seqs]
        batch = PackedBatch.from_sequences(
            rows, [w.start_pos for w in plan.seqs], [np.asarray(w.block_table) for w in plan.seqs]
        )
        ends = batch.cu_seqlens_q[1:]
        picks: list[np.ndarray] = []
        offsets: dict[int, tuple[int, int]] = {}
        n = 0
        for w, end in zip(plan.seqs, ends, strict=True):
            if w.sample:
                count = len(w.drafts) + 1
                picks.append(np.arange(end - count, end))
                offsets[w.slot] = (n, count)
                n += count
        batch.logits_indices = np.concatenate(picks) if picks else np.zeros(0, dtype=np.int64)
        t0 = time.perf_counter()
        with paddle.no_grad():
            out = self.model.forward(batch, self.target_cache)
        self.forward_seconds += time.perf_counter() - t0
        cu = batch.cu_seqlens_q
        for i, w in enumerate(plan.seqs):
            self._hidden[w.seq_id] = _StoredHidden(
                w.start_pos, out.hidden[int(cu[i]) : int(cu[i + 1])]
            )
        self._logits[plan.step] = _StepLogits(out.logits, offsets)

    # ---- sampler access ---------------------------------------------------------------

    def take_logits(self, step: int) -> dict[int, np.ndarray]:
        """Every sampling slot's verify logits as a host float64 array ``[m + 1, V]``
        (rows ``[last token, d1..dm]``); frees the step's device logits."""
        stored = self._logits.pop(step)
        if not stored.offsets:
            return {}
        host = stored.logits.numpy().astype(np.float64, copy=False)
        return {slot: host[lo : lo + count] for slot, (lo, count) in stored.offsets.items()}
