"""Messages between pipeline stages. Every one is a msgspec Struct carrying ids and small
host lists; device tensors (logits, hidden states, KV) stay in the rank's workspace and
are referenced by step and slot."""

from __future__ import annotations

from typing import Literal

import msgspec

from spectrio.core.acceptance import Acceptance
from spectrio.core.params import SamplingParams
from spectrio.core.timing import DeviceTiming


class SeqWork(msgspec.Struct, kw_only=True, frozen=True):
    """One sequence's share of a step. Written by the scheduler; the draft stage returns a
    copy with ``drafts`` filled in. Immutable: a plan is owned by its step. It gives the
    sequence ``num_drafts`` draft slots and says nothing of how drafts are made
    (``stages/device/draft/``)."""

    slot: int  # row of this sequence in the step (index into StepPlan.seqs)
    seq_id: int  # scheduler-internal id; keys the workspace's and the sampler's per-sequence state
    request_id: str
    block_table: list[int]  # shared by the target cache and a draft method's cache
    start_pos: int  # position of token_ids[0]
    token_ids: list[int]  # committed tokens the target reads this step
    sample: bool  # token_ids reach the end of the sequence: the sampler emits tokens
    num_drafts: int  # draft slots: the most drafts the proposer may fill (0: none this step)
    eos_token_ids: list[int]  # tokens that end the request (EOS unless ignored, stop ids)
    max_new_tokens: int  # tokens this request may still emit
    params: SamplingParams  # the sampler's knobs; the publisher's logprob width
    num_output: int = 0  # tokens emitted before this step (sampler: min_tokens, consistency)
    context_len: int = 0  # positions to compute before sampling (prompt, or prompt + output
    #                       when recomputing after preemption); the record's prefill test
    prompt_ids: list[int] = []  # the prompt, sent once on the first sampling step when a
    #                             repetition penalty needs it (the sampler keeps it)
    drafts: list[int] = []  # filled in by the draft stage (on a copy)
    forced: int = 0  # the first ``forced`` drafts are the grammar's forced tokens (near-certain)
    speculative: bool = False  # the request speculates: the proposer keeps state for it
    #                            (MTP catches up even in a step with 0 draft slots)
    pending: bool = False  # planned ahead: inputs come from the previous step's result
    #                        (stages/device/overlap.py); token_ids is empty until resolved
    max_model_len: int = 0  # the runtime's limit, for resolving drafts of pending work
    cached_ids: list[int] = []  # on a sequence's first work after (re)admission:
    #                             the tokens of positions 0 .. start_pos - 1, whose target and
    #                             draft KV came from the prefix cache (the proposer's history
    #                             and MTP catch-up start at start_pos; TP followers read it
    #                             here, never from a lookup of their own)
    # prompt_logprobs: the rows at positions score_start, score_start + 1, ... of this
    # work (all within token_ids, all before the prompt's last token) are scored against
    # score_ids[i], the prompt token at score_start + i + 1. Each prompt position is
    # scored in exactly one planned work over the request's life (the scheduler's
    # watermark), so recompute after preemption never scores it twice.
    score_start: int = 0
    score_ids: list[int] = []

    @property
    def decodes(self) -> bool:
        """A decode step: one committed token (or one resolved on the device, when planned
        ahead) whose next tokens the sampler emits, with no prefill rows. Any other work
        is a prompt chunk (or a recompute after preemption): the next token of each of its
        rows but the last is known before the step runs."""
        return self.sample and (self.pending or len(self.token_ids) == 1)


class Ended(msgspec.Struct, array_like=True, frozen=True):
    """A sequence that left the batch: the scheduler's own record, attached to the result
    of the step it was reported with (:attr:`StepResult.ended`) when that step is folded
    in. It never crosses to the device: the plan carries only the seq ids whose state
    goes (:attr:`StepPlan.released`, :attr:`StepPlan.retired`)."""

    seq_id: int
    request_id: str
    why: Literal["preempted", "aborted", "finished"]  # preempted: while planning the step
    acceptance: Acceptance | None = None  # aborted: its drafts over its life


class StepPlan(msgspec.Struct, kw_only=True, frozen=True):
    step: int
    seqs: list[SeqWork]
    # Seq ids that left the batch since the last plan (finished, preempted or aborted), in
    # the order they left: the workspace drops their state before the step runs.
    released: list[int] = []
    # Of those, the ones that ended outside the sampler (aborts): it drops their state.
    retired: list[int] = []
    k: int = 0  # drafts per decoding sequence the policy chose for this step
    draft_rows: int = 0  # set by the draft stage: the proposer's rows whose cost does not
    #                      depend on k (the adaptive policy takes their cost off the step)


class TokenLogprob(msgspec.Struct, array_like=True, gc=False):
    """Logprob of one emitted token: its own, its rank (1 = most likely) and the top
    alternatives its request asked for, best first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = []  # (token id, logprob)


class SeqResult(msgspec.Struct, kw_only=True):
    slot: int
    seq_id: int
    request_id: str
    num_drafts: int  # drafts proposed
    num_accepted: int  # drafts accepted (before stop truncation)
    num_forced: int = 0  # of the drafts, the grammar's forced tokens (SeqWork.forced)
    token_ids: list[int]  # tokens emitted this step (after truncation)
    finish_reason: str | None = None  # "stop" | "length" | None
    text_len: int | None = None  # a stop string ended the request: keep this many characters
    logprobs: list[TokenLogprob] | None = None  # one per emitted token when asked for
    num_logprobs: int | None = None  # the request's ``logprobs`` (record width)
    num_computed: int = 0  # positions with target KV after this step
    context_len: int = 0  # positions to compute before sampling; num_computed < context_len
    #                       means chunked prefill is still in progress
    # Set when the request ends: its drafts over its life, per draft position too, the
    # scheduler's one count (a copy), for the stream's final delta and per-request stats.
    acceptance: Acceptance | None = None
    # Set when the request ends: prompt tokens whose KV came from the prefix cache (at the
    # request's first admission)
    cached_tokens: int | None = None
    # prompt_logprobs: one entry per prompt token this step scored (SeqWork.score_ids),
    # in prompt order; None when the step scored none.
    prompt_logprobs: list[TokenLogprob] | None = None


class StepResult(msgspec.Struct, kw_only=True):
    """What a step decided. The device worker fills ``results``, ``device`` and
    ``draft_rows``; the scheduler attaches ``ended`` when it folds the step in, from its
    own record of the step in flight."""

    step: int
    results: list[SeqResult]
    # The device worker's times for this step (its thread writes them, nothing else does).
    device: DeviceTiming = msgspec.field(default_factory=DeviceTiming)
    draft_rows: int = 0  # the resolved plan's ``draft_rows``, and the proposer's after verify
    # Sequences that left the batch reported with this step: preempted while planning it,
    # aborted since the plan before (the record's -9 slots), and finished earlier.
    ended: list[Ended] = []

    @property
    def preempted(self) -> list[str]:
        """Request ids preempted while planning this step (record: -9)."""
        return [e.request_id for e in self.ended if e.why == "preempted"]

    @property
    def aborted(self) -> list[Ended]:
        """Requests aborted since the previous step (record: -9, finish reason "abort")."""
        return [e for e in self.ended if e.why == "aborted"]


class NewRequest(msgspec.Struct, tag=True, kw_only=True):
    """Runtime to scheduler: admit a validated request."""

    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    speculative: bool
    cache_salt: str = ""  # prefix-cache isolation: blocks are shared only within one salt


class AbortRequest(msgspec.Struct, tag=True, kw_only=True):
    seq_id: int
    reason: str = "aborted"


Control = NewRequest | AbortRequest


class PublishedStep(msgspec.Struct, kw_only=True):
    """What the publisher hands record observers once per step (rank 0 only).

    ``record`` is the packed step record (layout: :mod:`spectrio.core.record`); its slot
    ``i`` belongs to ``request_ids[i]``. Slots are the step's sequences in plan order,
    then requests preempted while planning it, then requests aborted since the last step.
    """

    step: int
    request_ids: list[str]
    finish_reasons: list[str | None]
    record: bytes
    # Requests that ended in this step (finished, or aborted and reported here): request
    # id -> its drafts over its whole life (the scheduler's count).
    acceptance: dict[str, Acceptance] = {}
    # Requests that finished in this step: request id -> prompt tokens whose KV came from
    # the prefix cache.
    cached_tokens: dict[str, int] = {}
    # Requests that asked for prompt_logprobs and had prompt tokens scored in this step:
    # request id -> those tokens' logprobs, in prompt order (a request's chunks come in
    # step order, so concatenating them gives prompt tokens 1 .. P-1).
    prompt_logprobs: dict[str, list[TokenLogprob]] = {}

    @property
    def drafts(self) -> dict[str, list[int]]:
        """``acceptance`` as [drafts proposed, accepted] per request (the wire's form)."""
        return {rid: [a.proposed, a.accepted] for rid, a in self.acceptance.items()}


class RuntimeStats(msgspec.Struct, kw_only=True):
    """A snapshot of a runtime's counters and gauges (:meth:`Runtime.stats`)."""

    running: int  # requests holding a batch slot
    waiting: int  # requests queued (new, or preempted for recompute)
    num_kv_blocks: int
    free_kv_blocks: int
    num_steps: int  # steps published
    num_preemptions: int
    drafts_proposed: int
    drafts_accepted: int
    accepted_per_position: list[int]  # drafts accepted at draft position 1, 2, ...
    proposed_per_position: list[int]  # drafts proposed at draft position 1, 2, ...
    finished: dict[str, int]  # requests ended, by finish reason ("stop", "length", "abort")
    # steps with decoding sequences, by drafts per sequence (the adaptive policy's k)
    steps_by_k: dict[int, int] = msgspec.field(default_factory=dict)
    # Prefix cache (stages/planning/block_manager.py), since start: context tokens looked up when a
    # request is (re)admitted, of which found cached; blocks registered now (held or
    # evictable); cached blocks evicted to make room.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    cached_kv_blocks: int = 0
    prefix_cache_evictions: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens over queried tokens (0 before any query)."""
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0
