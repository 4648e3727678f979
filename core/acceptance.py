"""Draft acceptance counts (pure): the one rule for counting a step's drafts.

A sequence's step that proposed ``n`` drafts and accepted ``a`` (the first ``a``, since
acceptance stops at the first rejection) counts ``n`` proposed and ``a`` accepted in
total, and per draft position ``i`` (0-based): proposed when ``i < n``, accepted when
``i < a``, and *reached* when ``i <= a`` (every draft before it was accepted, so its own
acceptance was decided). The scheduler counts every step once, where it folds the
sampler's result in (:meth:`spectrio.stages.planning.scheduler.Scheduler.update`): for the
runtime, and for each request, whose final output carries its count (a copy, on the
finishing :class:`~spectrio.core.messages.SeqResult` and the stream's final delta), so a
consumer that wants per-request acceptance reads it there and never counts again.

It lives in ``core`` because the stage messages carry it.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Acceptance"]


@dataclasses.dataclass
class Acceptance:
    proposed: int = 0
    accepted: int = 0
    proposed_at: list[int] = dataclasses.field(default_factory=list)  # per draft position
    accepted_at: list[int] = dataclasses.field(default_factory=list)
    reached_at: list[int] = dataclasses.field(default_factory=list)

    def add(self, num_drafts: int, num_accepted: int) -> None:
        """One sequence's step: ``num_drafts`` proposed, the first ``num_accepted`` taken."""
        if num_drafts <= 0:
            return
        accepted = min(num_accepted, num_drafts)
        self.proposed += num_drafts
        self.accepted += accepted
        grow = num_drafts - len(self.proposed_at)
        if grow > 0:
            for counts in (self.proposed_at, self.accepted_at, self.reached_at):
                counts.extend([0] * grow)
        for i in range(num_drafts):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < accepted
            self.reached_at[i] += i <= accepted

    def copy(self) -> Acceptance:
        """An independent copy (the lists are not shared)."""
        return Acceptance(
            self.proposed,
            self.accepted,
            list(self.proposed_at),
            list(self.accepted_at),
            list(self.reached_at),
        )

    def merge(self, other: Acceptance) -> None:
        """Add another count (per-position lists are summed)."""
        self.proposed += other.proposed
        self.accepted += other.accepted
        for mine, theirs in (
            (self.proposed_at, other.proposed_at),
            (self.accepted_at, other.accepted_at),
            (self.reached_at, other.reached_at),
        ):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v
