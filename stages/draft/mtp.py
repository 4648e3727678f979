"""MTP drafting: the checkpoint's multi-token-prediction layer as a :class:`Proposer`.

Everything MTP lives here: the MTP layer's paged KV cache (it shares the target's block
table, so the scheduler's reservation for the verify rows covers the substeps too), the
target hidden rows each speculative sequence's last verify left behind, and each
sequence's catch-up position.

The MTP layer reads, at position ``p``, the target hidden state of ``p`` and the token at
``p + 1``. Per sequence, positions below its *catch-up position* hold real MTP KV. Each
step first catches up: it runs the layer over positions ``catch-up .. start_pos - 1``
(whose hidden rows the previous step's verify stored, and whose next tokens the history
holds), then sets the catch-up position to ``start_pos``. The last catch-up row's logits
give draft 1; substep ``i + 1`` reads substep ``i``'s output hidden state and draft at
the next position. Substep KV entries past ``start_pos`` are speculative, and the next
step's catch-up overwrites them. A sequence drafting 0 this step still catches up, so
its cache stays complete whatever k the adaptive policy picks.

Catch-up rows beyond ``k_max + 1`` a sequence (a request's first decode step reads its
whole last prompt chunk) are the draft side's extra rows for the adaptive policy.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

import numpy as np

from spectrio.core.messages import SeqWork, StepPlan
from spectrio.models import ForwardOutput, PackedBatch, PagedKVCache, SpectrioForCausalLM
from spectrio.models.paddle_setup import paddle
from spectrio.stages.draft.base import Proposal, TokenHistory

__all__ = ["CatchUp", "HiddenStore", "MTPProposer", "SHARE_ROWS", "extra_rows"]

#: A step's hidden states are shared unsliced by its sequences up to this many rows (a
#: decode or verify step); a sequence of a larger step (a prefill) keeps a copy of its
#: own rows, so one sequence left unscheduled cannot pin a whole prefill's tensor.
SHARE_ROWS = 256


def extra_rows(catch_up_counts: Iterable[int], k_max: int) -> int:
    """Catch-up rows beyond the ``k_max + 1`` a decoding sequence brings every step: the
    draft side's rows whose cost does not depend on the step's k."""
    return sum(max(0, n - (k_max + 1)) for n in catch_up_counts)


class CatchUp:
    """Per sequence, the first position whose MTP KV is not real (pure)."""

    def __init__(self) -> None:
        self._pos: dict[int, int] = {}

    def advance(
        self, seq_id: int, start_pos: int, tokens: list[int], cached: int = 0
    ) -> tuple[int, list[int]]:
        """The catch-up of a step whose rows start at ``start_pos``: its first position
        and the token at ``p + 1`` of each position ``p`` (``tokens`` is the sequence's
        history through ``start_pos``). The position moves to ``start_pos``. A sequence
        seen for the first time starts at ``cached``: the positions of a prefix-cache
        hit, whose MTP KV came cached with their blocks."""
        first = self._pos.get(seq_id, cached)
        if first > start_pos:
            raise RuntimeError(f"seq {seq_id}: MTP caught up to {first}, step starts {start_pos}")
        self._pos[seq_id] = start_pos
        return first, tokens[first + 1 : start_pos + 1]

    def release(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._pos.pop(seq_id, None)

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._pos


@dataclasses.dataclass
class _StoredHidden:
    """Rows ``first .. first + count - 1`` of ``hidden`` (a step's ``[N, d]`` target hidden
    states, shared by its sequences) are positions ``start_pos ..``. Kept unsliced when
    the step is small: most are never read (superseded by the next step), and a slice is
    an op (and a copy)."""

    start_pos: int
    hidden: paddle.Tensor
    first: int
    count: int


class HiddenStore:
    """The target hidden rows of each speculative sequence's last verified rows."""

    def __init__(self, model: SpectrioForCausalLM) -> None:
        self.model = model
        self._rows: dict[int, _StoredHidden] = {}

    def store(
        self, seq_id: int, start_pos: int, hidden: paddle.Tensor, first: int, count: int
    ) -> None:
        """Keep rows ``first .. first + count - 1`` of ``hidden``, the target hidden states
        of positions ``start_pos ..``."""
        if hidden.shape[0] > SHARE_ROWS:
            hidden, first = hidden[first : first + count], 0
        self._rows[seq_id] = _StoredHidden(start_pos, hidden, first, count)

    def rows_of(self, wanted: list[tuple[int, int, int]]) -> paddle.Tensor:
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
        stored = self._rows[seq_id]
        lo = start_pos - stored.start_pos
        if lo < 0 or lo + count > stored.count:
            raise RuntimeError(
                f"seq {seq_id}: rows {start_pos}+{count} outside stored hidden rows "
                f"{stored.start_pos}+{stored.count}"
            )
        return stored, stored.first + lo

    def release(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._rows.pop(seq_id, None)

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._rows


class MTPProposer:
    """Drafts with the checkpoint's MTP layer (``num_model_steps`` substeps at most)."""

    method = "mtp"
    wants_hidden = True

    def __init__(
        self,
        model: SpectrioForCausalLM,
        num_blocks: int,
        block_size: int,
        *,
        k_max: int,
        num_kv_heads: int | None = None,
    ) -> None:
        cfg = model.config
        if model.mtp is None:
            raise RuntimeError("speculation needs a checkpoint with an MTP layer")
        self.model = model
        self.k_max = k_max
        kvh = cfg.num_key_value_heads if num_kv_heads is None else num_kv_heads
        self.cache = PagedKVCache(1, num_blocks, block_size, kvh, cfg.head_dim, model.dtype)
        self.hidden = HiddenStore(model)
        self.catch_up = CatchUp()

    def warmup(self, batch: PackedBatch, hidden: paddle.Tensor) -> None:
        self.model.mtp_forward(batch, hidden, self.cache)

    def release(self, seq_ids: Iterable[int]) -> None:
        ids = list(seq_ids)
        self.hidden.release(ids)
        self.catch_up.release(ids)

    def holds(self, seq_id: int) -> bool:
        return self.hidden.holds(seq_id) or self.catch_up.holds(seq_id)

    def keep_hidden(self, plan: StepPlan, hidden: paddle.Tensor, row_starts: np.ndarray) -> None:
        for i, w in enumerate(plan.seqs):
            if w.speculative:
                first = int(row_starts[i])
                self.hidden.store(
                    w.seq_id, w.start_pos, hidden, first, int(row_starts[i + 1]) - first
                )

    def propose(self, plan: StepPlan, history: TokenHistory) -> Proposal:
        """Catch every speculative sequence up, then run the substeps for those with
        draft slots. Writes real MTP cache entries for the catch-up positions."""
        work: list[tuple[SeqWork, int, list[int]]] = []  # (work, first position, tokens)
        for w in plan.seqs:
            if w.speculative:
                first, tokens = self.catch_up.advance(
                    w.seq_id, w.start_pos, history.tokens(w.seq_id), len(w.cached_ids)
                )
                if tokens:
                    work.append((w, first, tokens))
        if not work:
            return Proposal({})
        extra = extra_rows((len(tokens) for _, _, tokens in work), self.k_max)
        t0 = time.perf_counter()
        drafts = self._run(work)
        return Proposal(drafts, extra_rows=extra, forward_seconds=time.perf_counter() - t0)

    def _run(self, work: list[tuple[SeqWork, int, list[int]]]) -> dict[int, list[int]]:
        model = self.model
        prev = self.hidden.rows_of([(w.seq_id, first, len(tokens)) for w, first, tokens in work])
        batch = PackedBatch.from_sequences(
            [tokens for _, _, tokens in work],
            [first for _, first, _ in work],
            [np.asarray(w.block_table) for w, _, _ in work],
        )
        wanting = [i for i, (w, _, _) in enumerate(work) if w.num_drafts > 0]
        batch.logits_indices = batch.last_rows()[wanting]
        drafts: dict[int, list[int]] = {}
        with paddle.no_grad():
            out = model.mtp_forward(batch, prev, self.cache, draft_vocab=True)
            # (work, position of its last catch-up row)
            active = [(work[i][0], work[i][1] + len(work[i][2]) - 1) for i in wanting]
            hidden = _picked(model, out, batch.logits_indices) if active else None
            logits, vocab_ids = out.logits, out.vocab_ids
            substep = 0
            while active:
                best = paddle.argmax(logits, axis=-1).numpy()
                tokens = (best if vocab_ids is None else vocab_ids[best]).tolist()
                for (w, _), tok in zip(active, tokens, strict=True):
                    drafts.setdefault(w.slot, []).append(int(tok))
                substep += 1
                keep = [i for i, (w, _) in enumerate(active) if w.num_drafts > substep]
                if not keep:
                    break
                assert hidden is not None
                if len(keep) < len(active):
                    active = [active[i] for i in keep]
                    hidden = paddle.gather(
                        hidden, model.staging.put(np.asarray(keep, dtype=np.int64)), axis=0
                    )
                step_batch = PackedBatch.from_sequences(
                    [[drafts[w.slot][-1]] for w, _ in active],
                    [last + substep for _, last in active],
                    [np.asarray(w.block_table) for w, _ in active],
                )
                out = model.mtp_forward(step_batch, hidden, self.cache, draft_vocab=True)
                hidden, logits, vocab_ids = out.hidden, out.logits, out.vocab_ids
        return drafts


def _picked(model: SpectrioForCausalLM, out: ForwardOutput, rows: np.ndarray) -> paddle.Tensor:
    """The MTP hidden states of ``rows`` (the ones with logits): gathered by the pass
    already where it could."""
    if out.picked_hidden is not None:
        return out.picked_hidden
    return paddle.gather(out.hidden, model.staging.put(rows), axis=0)
