"""Structured output on the device worker: each constrained sequence's grammar state, and
what the draft and sampler stages ask of it (no Trio, no device).

The state is derived from the plans alone, like the proposer's token history
(:class:`~.draft.base.TokenHistory`, which folds every constrained sequence): at each
step a sequence's matcher is brought up to its output tokens so far (the history from
position ``context_len - num_output``, where the prompt ends). So every tensor-parallel
rank holds the same state (a follower never sees a result) and cuts the same drafts;
a state survives overlap (the plan is resolved before it is folded), and preemption and
prefix caching need nothing of their own: a preempted sequence's state goes with its
other draft-side state, and its next work brings back the tokens it had.

What the stages ask:

* :meth:`GrammarBook.allowed_after` (MTP's substeps): a constrained sequence's MTP
  drafts are the argmax under the mask, so the head is never wasted on a refused token.
* :meth:`GrammarBook.constrain_drafts` (draft stage): where the grammar admits a single
  continuation, those tokens are the drafts (forced drafts, which the target accepts
  whenever its masked distribution has one allowed token); otherwise the proposer's, cut
  at the first token the grammar refuses.
* :meth:`GrammarBook.masks` (sampler stage): per sampling sequence, the tokens allowed at
  each verified row (``[last token, d1..dm]``, row ``i`` as if ``d1..di`` were emitted).
  The sampler masks the target there, so greedy takes the best allowed token and
  rejection sampling runs on the masked target distribution: the output is exactly the
  constrained target's, with or without drafts.

A request's special stop tokens (EOS, a chat's end-of-turn tokens) are allowed exactly
where the grammar allows EOS, that is where it is complete: such an output never ends
early. A stop token that is ordinary text (``stop_token_ids`` may name any token) is
allowed where the grammar allows it too, and ends the output there, as a stop string
does. Drafts stop before any stop token. A row past the grammar's end is never emitted
from; it allows every token so its distribution stays defined.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import numpy as np
import structlog

from spectrio.core.messages import SeqWork, StepPlan

if TYPE_CHECKING:
    import llguidance

    from spectrio.stages.device.draft.base import TokenHistory
    from spectrio.stages.device.grammar import GrammarCompiler

__all__ = ["GrammarBook"]

log = structlog.get_logger("spectrio.grammar")


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _timed(
    method: Callable[Concatenate[GrammarBook, _P], _R],
) -> Callable[Concatenate[GrammarBook, _P], _R]:
    """Add the method's wall time to the book's ``seconds`` (read per step by the device
    worker: ``DeviceTiming.grammar_seconds``)."""

    @functools.wraps(method)
    def run(self: GrammarBook, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        t0 = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0

    return run


@dataclasses.dataclass
class _State:
    matcher: llguidance.LLMatcher
    consumed: int = 0  # output tokens the matcher has consumed


class GrammarBook:
    """Every constrained sequence's matcher, by seq id (module docstring)."""

    def __init__(self, compiler: GrammarCompiler, *, threads: int | None = None) -> None:
        import llguidance

        self.compiler = compiler
        self.vocab_size = compiler.vocab_size
        self._words = (self.vocab_size + 31) // 32  # int32 words of one mask row
        self._executor = llguidance.LLExecutor(num_threads=threads or min(4, os.cpu_count() or 1))
        self._states: dict[int, _State] = {}
        self.seconds = 0.0  # wall time in the methods below (_timed)
        self._stop_split: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}

    @property
    def num_states(self) -> int:
        return len(self._states)

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._states

    def release(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._states.pop(seq_id, None)

    @_timed
    def fold(self, plan: StepPlan, history: TokenHistory) -> None:
        """Bring every constrained sequence of ``plan`` up to its output so far (the
        history has folded ``plan`` already)."""
        for w in plan.seqs:
            if w.params.constraint is None:
                continue
            state = self._states.get(w.seq_id)
            if state is None:
                state = self._states[w.seq_id] = _State(self.compiler.matcher(w.params.constraint))
            output = history.tokens(w.seq_id)[w.context_len - w.num_output :]
            if len(output) < state.consumed:  # the history was cut back: so is the matcher
                if not state.matcher.rollback(state.consumed - len(output)):
                    state.matcher.reset()
                    state.consumed = 0
                else:
                    state.consumed = len(output)
            fresh = output[state.consumed :]
            if fresh and not state.matcher.consume_tokens(fresh):
                raise RuntimeError(
                    f"seq {w.seq_id}: output tokens {fresh} break its grammar "
                    f"({state.matcher.get_error()})"
                )
            state.consumed = len(output)

    def _state(self, w: SeqWork) -> _State:
        state = self._states.get(w.seq_id)
        if state is None:
            raise RuntimeError(f"seq {w.seq_id} is constrained but has no grammar state")
        return state

    @_timed
    def constrain_drafts(
        self,
        plan: StepPlan,
        found: dict[int, list[int]],
        sampled: AbstractSet[int] = frozenset(),
    ) -> tuple[dict[int, list[int]], dict[int, int], set[int]]:
        """The drafts of ``plan``'s slots (``found``: the proposer's) with each constrained
        sequence's made grammatical: its forced continuation where the grammar has one,
        else the proposer's cut at the first token the grammar refuses and before any
        stop token (:meth:`keeps`). A deterministic proposer's further drafts are kept
        after the forced ones when they begin with them; a sampled one's (``sampled``:
        slots with draft distributions) never are, so forced drafts are one-hot.

        Returns the drafts; per slot, how many of its first drafts are forced tokens; and
        the slots whose proposed drafts were replaced (their draft distributions no longer
        apply)."""
        out = dict(found)
        forced_counts: dict[int, int] = {}
        replaced: set[int] = set()
        for w in plan.seqs:
            if w.params.constraint is None or not w.sample or w.num_drafts <= 0:
                continue
            matcher = self._state(w).matcher
            proposed = found.get(w.slot, [])[: w.num_drafts]
            forced = [] if matcher.is_stopped() else matcher.compute_ff_tokens()[: w.num_drafts]
            stops = set(w.eos_token_ids)
            forced = forced[: next((i for i, t in enumerate(forced) if t in stops), len(forced))]
            if forced and (w.slot in sampled or proposed[: len(forced)] != forced):
                proposed = forced
                replaced.add(w.slot)
            if proposed:
                proposed = proposed[: self._kept(matcher, proposed, stops)]
            if proposed:
                out[w.slot] = proposed
                if forced:
                    forced_counts[w.slot] = min(len(forced), len(proposed))
            else:
                out.pop(w.slot, None)
        return out, forced_counts, replaced

    @staticmethod
    def _kept(matcher: Any, drafts: list[int], stops: set[int]) -> int:
        """How many of ``drafts`` a constrained sequence keeps: up to the first its grammar
        refuses or the first stop token (which would end the run anyway). The sampler's
        restriction of a sampled draft's distribution (:meth:`keeps`) is this same rule."""
        n = next((i for i, t in enumerate(drafts) if t in stops), len(drafts))
        return int(matcher.validate_tokens(drafts[:n])) if n else 0

    @staticmethod
    def keeps(allowed: np.ndarray, stops: list[int]) -> np.ndarray:
        """The tokens a draft may be and be kept, per row of ``allowed`` (:meth:`masks`):
        what the grammar allows there, less the stop tokens (:meth:`_kept`)."""
        kept = allowed.copy()
        if stops:
            kept[:, np.asarray(stops, dtype=np.int64)] = False
        return kept

    @_timed
    def allowed_after(self, items: list[tuple[SeqWork, list[int]]]) -> np.ndarray:
        """bool [len(items), V]: per (sequence, drafts), the tokens its grammar allows after
        its output so far and then those drafts (all of which it allows); a row is all
        False once the grammar has ended. For a proposer that drafts under the mask
        (MTP's argmax). One library call for every row."""
        bits = np.zeros((len(items), self._words), dtype=np.int32)
        pairs: list[tuple[Any, int]] = []
        consumed: list[tuple[Any, int]] = []
        try:
            for row, (w, drafts) in enumerate(items):
                matcher = self._state(w).matcher
                if drafts:
                    if not matcher.consume_tokens(drafts):
                        raise RuntimeError(f"seq {w.seq_id}: drafts {drafts} break its grammar")
                    consumed.append((matcher, len(drafts)))
                if not matcher.is_stopped():
                    pairs.append((matcher, row))
            if pairs:
                self._executor.unsafe_compute_mask_ptr(
                    pairs, bits.ctypes.data, self._words * 4, bits.shape[0]
                )
        finally:
            for matcher, n in consumed:
                matcher.rollback(n)
        return self._unpack(bits)

    def _unpack(self, bits: np.ndarray) -> np.ndarray:
        """The library's bitmask rows (int32 words, bit ``t % 32`` of word ``t // 32``)
        as bool ``[rows, V]``, a view of one unpacked buffer."""
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
        return allowed[:, : self.vocab_size].view(bool)

    def _split_stops(self, stop_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """A request's stop tokens: (special tokens, text tokens)."""
        key = tuple(stop_ids)
        found = self._stop_split.get(key)
        if found is None:
            tokenizer = self.compiler.tokenizer
            special = [t for t in stop_ids if tokenizer.is_special_token(t)]
            text = [t for t in stop_ids if not tokenizer.is_special_token(t)]
            found = (np.asarray(special, dtype=np.int64), np.asarray(text, dtype=np.int64))
            if len(self._stop_split) < 1024:
                self._stop_split[key] = found
        return found

    @_timed
    def masks(self, plan: StepPlan) -> dict[int, np.ndarray]:
        """Per constrained sampling slot of ``plan`` (its drafts filled in), bool
        ``[len(drafts) + 1, V]``: the tokens allowed at each verified row."""
        works = [w for w in plan.seqs if w.sample and w.params.constraint is not None]
        if not works:
            return {}
        starts = np.cumsum([0] + [len(w.drafts) + 1 for w in works])
        bits = np.zeros((int(starts[-1]), self._words), dtype=np.int32)
        # The library takes sequences with drafts and without in two calls.
        plain: list[tuple[Any, int]] = []
        drafted: list[tuple[Any, int, list[int]]] = []
        for w, at in zip(works, starts[:-1].tolist(), strict=True):
            matcher = self._state(w).matcher
            if w.drafts:
                drafted.append((matcher, at, list(w.drafts)))
            else:
                plain.append((matcher, at))
        if plain:
            self._executor.unsafe_compute_mask_ptr(
                plain, bits.ctypes.data, self._words * 4, bits.shape[0]
            )
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                drafted, bits.ctypes.data, self._words * 4, bits.shape[0]
            )
        allowed = self._unpack(bits)
        eos = self.compiler.eos_token_id
        out: dict[int, np.ndarray] = {}
        for w, lo, hi in zip(works, starts[:-1], starts[1:], strict=True):
            rows = allowed[lo:hi]
            # A stop token ends the output. A special one (EOS, a chat's end of turn) is
            # allowed only where the grammar may end; one that is also text the grammar
            # may produce is allowed there too (ending early, as a stop string does).
            special, text = self._split_stops(w.eos_token_ids)
            if special.size:
                rows[:, special] = rows[:, [eos]]
            if text.size:
                rows[:, text] |= rows[:, [eos]]
            empty = np.logical_not(np.any(rows, axis=1))
            if bool(empty[0]):
                # The library failed inside a grammar the compiler had checked (a limit
                # hit mid-output): the request ends here, at its EOS, rather than the
                # engine, and the cause is logged.
                matcher = self._state(w).matcher
                log.error(
                    "grammar failed; the request ends here",
                    seq_id=w.seq_id,
                    request_id=w.request_id,
                    error=matcher.get_error() if matcher.is_error() else "no token allowed",
                )
                rows[0, :] = False
                rows[0, eos] = True
                empty[0] = False
            rows[empty] = True  # past the grammar's end (after a drafted EOS): never emitted
            out[w.slot] = rows
        return out
