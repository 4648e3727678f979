"""A request as the scheduler holds it (:class:`Sequence`): the :class:`NewRequest` it
was admitted with and the state the scheduler keeps for it."""

from __future__ import annotations

import dataclasses

from spectrio.core.acceptance import Acceptance
from spectrio.core.messages import NewRequest, SeqWork
from spectrio.core.params import SamplingParams
from spectrio.stages.planning.lifecycle import RequestState, advance

__all__ = ["Sequence"]


@dataclasses.dataclass(eq=False)
class Sequence:
    """A request the scheduler holds: the :class:`NewRequest` it was admitted with (its
    fields are read through, never copied), and the state the scheduler keeps for it."""

    request: NewRequest
    output_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    state: RequestState = RequestState.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    decoding: bool = False  # a step sampled it since its context was last (re)computed
    pending: SeqWork | None = None  # the in-flight sampling work whose result is unknown
    acceptance: Acceptance = dataclasses.field(default_factory=Acceptance)  # over its life
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    prefix_hit: int = 0  # positions this admission took from the cache, until its first work
    # prompt_logprobs: rows at positions 0 .. prompt_scored - 1 have been planned for
    # scoring (their results always reach the publisher: see _score)
    prompt_scored: int = 0

    @property
    def seq_id(self) -> int:
        return self.request.seq_id

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def eos_token_ids(self) -> list[int]:
        return self.request.eos_token_ids

    @property
    def speculative(self) -> bool:
        return self.request.speculative

    @property
    def cache_salt(self) -> str:
        """Requests share prefix-cache blocks only with the same salt."""
        return self.request.cache_salt

    @property
    def drafts_proposed(self) -> int:
        return self.acceptance.proposed

    @property
    def drafts_accepted(self) -> int:
        return self.acceptance.accepted

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def scoring_left(self) -> bool:
        """prompt_logprobs asked for and some prompt row not planned for scoring yet
        (rows at positions 0 .. P - 2 score prompt tokens 1 .. P - 1)."""
        return (
            self.params.prompt_logprobs is not None
            and self.prompt_scored < len(self.prompt_ids) - 1
        )

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    def move(self, to: RequestState) -> None:
        self.state = advance(self.state, to, f"request {self.request_id}")
