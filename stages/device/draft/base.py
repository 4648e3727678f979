"""What every draft method sees and hears: the :class:`Proposer` protocol and the
per-request :class:`TokenHistory` it reads (pure: no Trio, no device).

A step's plan gives each sequence some draft slots (``SeqWork.num_drafts``); a proposer
fills at most that many and may leave any empty. Rules every proposer keeps:

* **Same drafts on every rank.** A proposer sees only the resolved plan (which rank 0
  broadcasts before drafting) and state it derived from earlier plans, never a step's
  result: a tensor-parallel follower never sees results. So every rank proposes the same
  drafts and verifies the same rows.
* **Drafts never change the output's distribution.** Acceptance is sample-then-match
  for one-hot drafts (greedy argmax, or lossless rejection sampling), so such a proposer
  only decides how many tokens a step may gain; a proposer that samples its drafts
  hands their distributions over (:attr:`Proposal.draft_probs`) and verification
  applies the full rule with them.
* **State ends with the sequence.** :meth:`Proposer.release` gets every sequence that
  finished, was aborted or was preempted; a preempted one comes back from position 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np

from spectrio.core.messages import SeqWork, StepPlan

__all__ = ["Proposal", "Proposer", "TokenHistory"]


@dataclasses.dataclass
class Proposal:
    """A proposer's answer for one step."""

    drafts: dict[int, list[int]]  # slot -> drafts (at most the slot's num_drafts)
    extra_rows: int = 0  # draft-side rows whose cost does not depend on k (the adaptive
    #                      policy takes their learnt cost off the step's time)
    forward_seconds: float = 0.0  # wall time inside model forward calls
    # slot -> float64 [drafts, V]: the distribution each draft was sampled from, for
    # verification's full rule; a slot without one has deterministic (one-hot) drafts
    draft_probs: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)


class Proposer(Protocol):
    """A draft method. Runs on the device worker (and on every tensor-parallel rank)."""

    method: str  # SpeculativeConfig.method

    def propose(self, plan: StepPlan, history: TokenHistory) -> Proposal:
        """Drafts for the speculative sequences of ``plan``; ``history`` holds each one's
        tokens up to and including the step's rows."""
        ...

    def after_verify(
        self, plan: StepPlan, hidden: Any, row_starts: np.ndarray, history: TokenHistory
    ) -> Proposal:
        """After verify, in the same step: ``hidden[row_starts[i]: row_starts[i + 1]]``
        are the target hidden states of ``plan.seqs[i]``'s rows (MTP keeps them; other
        methods ignore them). Whatever draft state the step's prompt rows define is
        written here, so a prompt block's KV is complete when its step returns (the
        scheduler registers it then). Returns no drafts; its rows and model time count
        as the step's draft side."""
        ...

    def warmup(self, batch: Any, hidden: Any) -> None:
        """The profile run: one pass over the target warm-up's rows, if it runs a model."""
        ...

    def release(self, seq_ids: Iterable[int]) -> None:
        """Drop these sequences' state (unknown ids are ignored)."""
        ...

    def holds(self, seq_id: int) -> bool:
        """Whether it keeps state for this sequence."""
        ...


def _tracked(w: SeqWork) -> bool:
    """Whether the history keeps this sequence's tokens."""
    return w.speculative or w.params.constraint is not None


class TokenHistory:
    """Each speculative (or constrained) sequence's tokens as the device has verified
    them, folded from the resolved plans and the drafts proposed for them.

    After :meth:`fold` of a step, a sequence's tokens are positions ``0 ..
    start_pos + len(token_ids) - 1`` of its work. The positions between the end of its
    previous work and this one's ``start_pos`` are the previous step's accepted drafts
    (emitted tokens are the accepted drafts then one more, and that one is the next
    work's first token), so the count accepted is that gap: :meth:`accepted`."""

    def __init__(self) -> None:
        self._tokens: dict[int, list[int]] = {}
        self._drafts: dict[int, list[int]] = {}  # the drafts of the sequence's last step
        self._accepted: dict[int, int] = {}

    def fold(self, plan: StepPlan) -> None:
        """Bring every speculative or constrained sequence of ``plan`` up to its rows (a
        constrained one's grammar state is derived from them: ``grammar_book``)."""
        for w in plan.seqs:
            if not _tracked(w):
                continue
            # A first work after a prefix-cache hit starts past positions it never
            # computed: their tokens come with it.
            tokens = self._tokens.setdefault(w.seq_id, list(w.cached_ids))
            gap = w.start_pos - len(tokens)
            if gap > 0:
                drafted = self._drafts.get(w.seq_id, [])
                if gap > len(drafted):
                    raise RuntimeError(
                        f"seq {w.seq_id}: work starts at {w.start_pos}, history ends at "
                        f"{len(tokens)} with {len(drafted)} drafts to fill the gap"
                    )
                tokens.extend(drafted[:gap])
            elif gap < 0:
                del tokens[w.start_pos :]
            tokens.extend(w.token_ids)
            self._accepted[w.seq_id] = max(0, gap)
            self._drafts[w.seq_id] = []

    def drafted(self, plan: StepPlan) -> None:
        """Remember the drafts ``plan`` verifies: the next fold fills accepted ones in."""
        for w in plan.seqs:
            if _tracked(w) and w.drafts:
                self._drafts[w.seq_id] = list(w.drafts)

    def tokens(self, seq_id: int) -> list[int]:
        """The sequence's tokens (its prompt, then its output), as folded so far."""
        return self._tokens.get(seq_id, [])

    def accepted(self, seq_id: int) -> int:
        """Drafts accepted at the sequence's previous step (0 before its first decode)."""
        return self._accepted.get(seq_id, 0)

    def release(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._tokens.pop(seq_id, None)
            self._drafts.pop(seq_id, None)
            self._accepted.pop(seq_id, None)

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._tokens

    @property
    def seq_ids(self) -> set[int]:
        return set(self._tokens)
