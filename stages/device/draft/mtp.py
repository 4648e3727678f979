"""MTP drafting: the checkpoint's multi-token-prediction layer as a :class:`Proposer`.

Everything MTP lives here: the MTP layer's paged KV cache (it shares the target's block
table, so the scheduler's reservation for the verify rows covers the substeps too), the
target hidden rows each speculative sequence's last verify left behind, and each
sequence's catch-up position.

The MTP layer reads, at position ``p``, the target hidden state of ``p`` and the token at
``p + 1``. Per sequence, positions below its *catch-up position* hold real MTP KV. A
decode step first catches up: it runs the layer over positions ``catch-up .. start_pos -
1`` (whose hidden rows earlier verifies stored, and whose next tokens the history holds),
then sets the catch-up position to ``start_pos``. The last catch-up row's logits give
draft 1; substep ``i + 1`` reads substep ``i``'s output hidden state and draft at the
next position. Substep KV entries past ``start_pos`` are speculative, and the next step's
catch-up overwrites them.

A prompt chunk (any work that is not a decode step) is caught up after its own verify,
in the same step (:meth:`MTPProposer.after_verify`): every row's next token but the
last one's is known before the step runs, so the step that writes a prompt block's target
KV writes its MTP KV too, and the scheduler registers the block when that step returns,
whatever becomes of the request afterwards (``stages/planning/scheduler.py``, *Registration*).
The chunk's last position waits for the next token: the next chunk's, or the sampled one.

A sequence drafting 0 this step may defer its catch-up (:meth:`CatchUp.may_defer`): its
hidden rows are kept until a step that drafts for it (or the lag limit) catches up on
all of them at once, so a run that the policy keeps at k = 0 does not pay for the MTP
layer on every step. Its prompt is always caught up first: a prompt block registered in
the prefix cache carries real MTP KV (``stages/planning/scheduler.py``, *Registration*), and only
positions past the prompt ever lag. Every rank defers the same way, from the plan alone.

A prompt chunk's catch-up rows, and a decode step's beyond ``k_max + 1`` a sequence
(a deferred catch-up), are the draft side's extra rows for the adaptive policy.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

import numpy as np

from spectrio.core.messages import SeqWork, StepPlan
from spectrio.models import ForwardOutput, PackedBatch, PagedKVCache, SpectrioForCausalLM
from spectrio.models.ops.paddle_setup import paddle
from spectrio.stages.device.draft.base import Proposal, TokenHistory
from spectrio.stages.device.grammar_book import GrammarBook

__all__ = ["CatchUp", "HiddenStore", "MTPProposer", "SHARE_ROWS", "extra_rows"]

#: A step's hidden states are shared unsliced by its sequences up to this many rows (a
#: decode or verify step); a sequence of a larger step (a prefill) keeps a copy of its
#: own rows, so one sequence left unscheduled cannot pin a whole prefill's tensor.
SHARE_ROWS = 256

#: Bounds of a deferred catch-up (:meth:`CatchUp.may_defer`): the hidden rows all
#: lagging sequences hold stay within LAG_BYTES, each lagging MIN_LAG to MAX_LAG
#: positions.
LAG_BYTES = 32 << 20
MIN_LAG, MAX_LAG = 8, 1024


def extra_rows(catch_up_counts: Iterable[int], k_max: int) -> int:
    """Catch-up rows beyond the ``k_max + 1`` a decoding sequence brings every step: the
    draft side's rows whose cost does not depend on the step's k (MTP's and a draft
    model's decode catch-ups alike)."""
    return sum(max(0, n - (k_max + 1)) for n in catch_up_counts)


class CatchUp:
    """Per sequence, the first position whose draft KV is not real (pure). The KV at
    position ``p`` reads the tokens through ``p + lookahead``: 1 for the MTP layer (the
    token after ``p``), 0 for a draft model's own layers (:mod:`.draft_model`)."""

    def __init__(self, lookahead: int = 1) -> None:
        self.lookahead = lookahead
        self._pos: dict[int, int] = {}

    def advance(
        self, seq_id: int, end: int, tokens: list[int], cached: int = 0
    ) -> tuple[int, list[int]]:
        """The catch-up up to position ``end`` (exclusive): its first position and the
        token at ``p + lookahead`` of each position ``p`` (``tokens`` is the sequence's
        history through ``end - 1 + lookahead``). The position moves to ``end``. A
        sequence seen for the first time starts at ``cached``: the positions of a
        prefix-cache hit, whose draft KV came cached with their blocks."""
        first = self._pos.get(seq_id, cached)
        if first > end:
            raise RuntimeError(f"seq {seq_id}: draft KV caught up to {first}, step needs {end}")
        self._pos[seq_id] = end
        return first, tokens[first + self.lookahead : end + self.lookahead]

    def may_defer(self, work: SeqWork, max_lag: int) -> bool:
        """Whether ``work``'s catch-up can wait for a later step: it drafts nothing, the
        sequence's prompt is caught up (``context_len - num_output`` positions), and it
        would lag at most ``max_lag`` positions behind the step's (``start_pos + 1 -
        lookahead``)."""
        first = self._pos.get(work.seq_id)
        return (
            work.num_drafts == 0
            and first is not None
            and first >= work.context_len - work.num_output
            and work.start_pos + 1 - self.lookahead - first <= max_lag
        )

    def position(self, seq_id: int) -> int | None:
        """The sequence's first position without real draft KV (None: not seen yet)."""
        return self._pos.get(seq_id)

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
    """The target hidden rows of each speculative sequence's verified rows not caught up
    on yet: the last step's, and those of the steps whose catch-up was deferred.

    Per sequence the stored steps are in position order, and a later step supersedes an
    earlier one from its ``start_pos`` on (the rows past a step's accepted drafts were
    never real), so position ``p`` is read from the last stored step starting at or
    before ``p``."""

    def __init__(self, model: SpectrioForCausalLM) -> None:
        self.model = model
        self._rows: dict[int, list[_StoredHidden]] = {}

    def store(
        self, seq_id: int, start_pos: int, hidden: paddle.Tensor, first: int, count: int
    ) -> None:
        """Keep rows ``first .. first + count - 1`` of ``hidden``, the target hidden states
        of positions ``start_pos ..``, after the rows kept before ``start_pos``."""
        if hidden.shape[0] > SHARE_ROWS:
            hidden, first = hidden[first : first + count], 0
        kept = [r for r in self._rows.get(seq_id, ()) if r.start_pos < start_pos]
        kept.append(_StoredHidden(start_pos, hidden, first, count))
        self._rows[seq_id] = kept

    def drop_before(self, seq_id: int, pos: int) -> None:
        """Forget the stored steps that hold nothing at or after ``pos`` (caught up)."""
        stored = self._rows.get(seq_id)
        if stored:
            # A step is superseded where the next one starts: it holds nothing needed
            # once the next one starts at or before ``pos``.
            keep = 0
            while keep + 1 < len(stored) and stored[keep + 1].start_pos <= pos:
                keep += 1
            del stored[:keep]

    def rows_of(self, wanted: list[tuple[int, int, int]]) -> paddle.Tensor:
        """The stored hidden rows of positions ``start_pos .. start_pos + count - 1`` of
        each ``(seq_id, start_pos, count)``, stacked in order. When all come from one
        stored step (a decode step's shared tensor, the usual case), that is one gather,
        not a slice per sequence and a concat; rows from several steps (a deferred
        catch-up) are gathered from the concatenation of the steps' tensors."""
        found = [piece for w in wanted for piece in self._locate(*w)]  # (tensor, row, n)
        sources: dict[int, tuple[paddle.Tensor, int]] = {}  # id -> (tensor, offset)
        offset = 0
        for tensor, _, _ in found:
            if id(tensor) not in sources:
                sources[id(tensor)] = (tensor, offset)
                offset += int(tensor.shape[0])
        if len(found) == 1:
            tensor, lo, n = found[0]
            return tensor[lo : lo + n]
        if any(int(t.shape[0]) > SHARE_ROWS for t, _ in sources.values()) and len(sources) > 1:
            parts = [t[lo : lo + n] for t, lo, n in found]
            return paddle.concat(parts, axis=0)
        rows = np.concatenate([np.arange(lo, lo + n) + sources[id(t)][1] for t, lo, n in found])
        tensors = [t for t, _ in sources.values()]
        source = tensors[0] if len(tensors) == 1 else paddle.concat(tensors, axis=0)
        return paddle.gather(source, self.model.staging.put(rows), axis=0)

    def _locate(
        self, seq_id: int, start_pos: int, count: int
    ) -> list[tuple[paddle.Tensor, int, int]]:
        """The stored pieces holding these positions: (tensor, its row of the first
        position, positions), in order."""
        stored = self._rows.get(seq_id, [])
        pieces: list[tuple[paddle.Tensor, int, int]] = []
        pos, end = start_pos, start_pos + count
        for i, r in enumerate(stored):
            upto = stored[i + 1].start_pos if i + 1 < len(stored) else r.start_pos + r.count
            upto = min(upto, r.start_pos + r.count)
            if pos >= end or pos < r.start_pos or pos >= upto:
                continue
            n = min(end, upto) - pos
            pieces.append((r.hidden, r.first + pos - r.start_pos, n))
            pos += n
        if pos < end:
            held = [(r.start_pos, r.count) for r in stored]
            raise RuntimeError(
                f"seq {seq_id}: rows {start_pos}+{count} outside stored hidden rows {held}"
            )
        return pieces

    def release(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._rows.pop(seq_id, None)

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._rows


class MTPProposer:
    """Drafts with the checkpoint's MTP layer (``num_model_steps`` substeps at most)."""

    method = "mtp"

    def __init__(
        self,
        model: SpectrioForCausalLM,
        num_blocks: int,
        block_size: int,
        *,
        k_max: int,
        num_kv_heads: int | None = None,
        grammar: GrammarBook | None = None,
    ) -> None:
        """``grammar``: constrained sequences' state; their drafts are the argmax of
        the tokens their grammar allows."""
        cfg = model.config
        if model.mtp is None:
            raise RuntimeError("speculation needs a checkpoint with an MTP layer")
        self.model = model
        self.k_max = k_max
        kvh = cfg.num_key_value_heads if num_kv_heads is None else num_kv_heads
        self.cache = PagedKVCache(1, num_blocks, block_size, kvh, cfg.head_dim, model.dtype)
        self.hidden = HiddenStore(model)
        self.catch_up = CatchUp()
        self.grammar = grammar

    def warmup(self, batch: PackedBatch, hidden: paddle.Tensor) -> None:
        self.model.mtp_forward(batch, hidden, self.cache)

    def release(self, seq_ids: Iterable[int]) -> None:
        ids = list(seq_ids)
        self.hidden.release(ids)
        self.catch_up.release(ids)

    def holds(self, seq_id: int) -> bool:
        return self.hidden.holds(seq_id) or self.catch_up.holds(seq_id)

    def max_lag(self, num_seqs: int) -> int:
        """The most positions a sequence's catch-up may lag when ``num_seqs`` sequences
        speculate: their held hidden rows stay within :data:`LAG_BYTES`."""
        row = self.model.config.hidden_size * np.dtype(self.model.dtype).itemsize
        return int(min(MAX_LAG, max(MIN_LAG, LAG_BYTES // (row * max(1, num_seqs)))))

    def after_verify(
        self, plan: StepPlan, hidden: paddle.Tensor, row_starts: np.ndarray, history: TokenHistory
    ) -> Proposal:
        """Keep each speculative sequence's verified hidden rows for its next catch-up,
        then catch every prompt chunk of the step up at once: the token after each of its
        rows but the last is known, so the step that writes a prompt block's target KV
        writes its MTP KV too (module docstring). Its last row waits for the sampled (or
        the next chunk's first) token, in the sequence's next step."""
        work: list[tuple[SeqWork, int, list[int]]] = []
        for i, w in enumerate(plan.seqs):
            if not w.speculative:
                continue
            first = int(row_starts[i])
            caught_up = self.catch_up.position(w.seq_id)
            if caught_up is not None:
                self.hidden.drop_before(w.seq_id, caught_up)
            self.hidden.store(w.seq_id, w.start_pos, hidden, first, int(row_starts[i + 1]) - first)
            if not w.decodes:
                end = w.start_pos + len(w.token_ids) - 1
                start, tokens = self.catch_up.advance(
                    w.seq_id, end, history.tokens(w.seq_id), len(w.cached_ids)
                )
                if tokens:
                    work.append((w, start, tokens))
        if not work:
            return Proposal({})
        t0 = time.perf_counter()
        self._run(work)
        rows = sum(len(tokens) for _, _, tokens in work)
        return Proposal({}, extra_rows=rows, forward_seconds=time.perf_counter() - t0)

    def propose(self, plan: StepPlan, history: TokenHistory) -> Proposal:
        """Catch every decoding speculative sequence up, then run the substeps for those
        with draft slots. Writes real MTP cache entries for the catch-up positions."""
        work: list[tuple[SeqWork, int, list[int]]] = []  # (work, first position, tokens)
        speculative = [w for w in plan.seqs if w.speculative]
        max_lag = self.max_lag(len(speculative))
        for w in speculative:
            if not w.decodes or self.catch_up.may_defer(w, max_lag):
                continue  # a prompt chunk is caught up after verify (after_verify)
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
                # One copy to the host, then NumPy's argmax (the first of equal maxima,
                # as Paddle's): a Paddle argmax is one more op a substep.
                values = logits.numpy()
                best = values.argmax(axis=-1)
                tokens = (best if vocab_ids is None else vocab_ids[best]).tolist()
                ended = self._under_grammar(active, values, vocab_ids, drafts, tokens)
                for (w, _), tok in zip(active, tokens, strict=True):
                    if w.slot not in ended:
                        drafts.setdefault(w.slot, []).append(int(tok))
                substep += 1
                keep = [
                    i
                    for i, (w, _) in enumerate(active)
                    if w.num_drafts > substep and w.slot not in ended
                ]
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

    def _under_grammar(
        self,
        active: list[tuple[SeqWork, int]],
        values: np.ndarray,
        vocab_ids: np.ndarray | None,
        drafts: dict[int, list[int]],
        tokens: list[int],
    ) -> set[int]:
        """Replace each constrained sequence's token in ``tokens`` by the argmax of what
        its grammar allows after its drafts so far; returns the slots whose grammar allows
        nothing the head can draft (they stop drafting)."""
        ended: set[int] = set()
        if self.grammar is None:
            return ended
        rows = [i for i, (w, _) in enumerate(active) if w.params.constraint is not None]
        if not rows:
            return ended
        masks = self.grammar.allowed_after(
            [(active[i][0], drafts.get(active[i][0].slot, [])) for i in rows]
        )
        for i, allowed in zip(rows, masks, strict=True):
            w = active[i][0]
            if vocab_ids is not None:  # the head scores a subset of the vocabulary
                allowed = allowed[vocab_ids]
            best = _masked_argmax(values[i], allowed)
            if best is None:
                ended.add(w.slot)
            else:
                tokens[i] = int(best if vocab_ids is None else vocab_ids[best])
        return ended


def _masked_argmax(row: np.ndarray, allowed: np.ndarray) -> int | None:
    """The index of the largest of ``row`` where ``allowed``; None where nothing is."""
    if not allowed.any():
        return None
    return int(np.argmax(np.where(allowed, row, -np.inf)))


def _picked(model: SpectrioForCausalLM, out: ForwardOutput, rows: np.ndarray) -> paddle.Tensor:
    """The MTP hidden states of ``rows`` (the ones with logits): gathered by the pass
    already where it could."""
    if out.picked_hidden is not None:
        return out.picked_hidden
    return paddle.gather(out.hidden, model.staging.put(rows), axis=0)
