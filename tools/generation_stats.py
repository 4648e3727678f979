"""Per-request speculation statistics, accumulated from a request's deltas (pure).

Drafts are counted by the one rule of :class:`spectrio.stages.acceptance.Acceptance`;
this adds what only a stream of deltas knows (steps and tokens emitted)."""

from __future__ import annotations

import dataclasses

from spectrio.runtime.api import Delta
from spectrio.stages.acceptance import Acceptance


@dataclasses.dataclass
class GenerationStats:
    num_steps: int = 0  # verify steps that emitted tokens for this request
    num_tokens: int = 0
    acceptance: Acceptance = dataclasses.field(default_factory=Acceptance)

    @property
    def proposed(self) -> list[int]:
        """Per draft position: steps that proposed it."""
        return self.acceptance.proposed_at

    @property
    def accepted(self) -> list[int]:
        """Per draft position: steps that accepted it."""
        return self.acceptance.accepted_at

    @property
    def reached(self) -> list[int]:
        """Per draft position i: steps that proposed it with drafts 1..i-1 all accepted."""
        return self.acceptance.reached_at

    def add(self, delta: Delta) -> None:
        if not delta.token_ids:
            return
        self.num_steps += 1
        self.num_tokens += len(delta.token_ids)
        self.acceptance.add(delta.num_drafts, delta.num_accepted)

    def merge(self, other: GenerationStats) -> None:
        """Add another request's counts (per-position lists are summed)."""
        self.num_steps += other.num_steps
        self.num_tokens += other.num_tokens
        self.acceptance.merge(other.acceptance)

    @property
    def mean_accept_len(self) -> float:
        """Tokens emitted per verify step (1.0 without speculation)."""
        return self.num_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def accepted_per_position(self) -> list[float]:
        """Share of steps in which draft position i was accepted, of those that proposed it."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed, strict=False)]

    @property
    def conditional_acceptance(self) -> list[float]:
        """Share of drafts at position i that were accepted, among steps that proposed it
        with every earlier draft accepted: the rate a draft model has at that position."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted, self.reached, strict=True)]

    @property
    def mean_accepted(self) -> float:
        """Drafts accepted per step (``mean_accept_len - 1`` without truncation)."""
        return sum(self.accepted) / self.num_steps if self.num_steps else 0.0
