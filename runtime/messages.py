"""Messages between pipeline stages. Every one is a msgspec Struct carrying ids and small
host lists; device tensors (logits, hidden states, KV) stay in the rank's workspace and
are referenced by step and slot."""

from __future__ import annotations

import msgspec

from spectrio.runtime.params import SamplingParams


class SeqWork(msgspec.Struct, kw_only=True):
    """One sequence's share of a step. Written by the scheduler, drafts added by the draft stage."""

    slot: int  # row of this sequence in the step (index into StepPlan.seqs)
    seq_id: int  # scheduler-internal id; keys the workspace's per-sequence state
    request_id: str
    block_table: list[int]  # shared by the target cache and the MTP cache
    start_pos: int  # position of token_ids[0]
    token_ids: list[int]  # committed tokens the target reads this step
    sample: bool  # token_ids reach the end of the sequence: the sampler emits tokens
    num_drafts: int  # MTP substeps wanted (0 when not speculating this step)
    mtp_start: int  # first MTP catch-up position
    mtp_token_ids: list[int]  # token at p+1 for each catch-up position p
    eos_token_ids: list[int]  # tokens that end the request (EOS unless ignored, stop ids)
    max_new_tokens: int  # tokens this request may still emit
    drafts: list[int] = []  # filled in by the draft stage


class StepPlan(msgspec.Struct, kw_only=True):
    step: int
    seqs: list[SeqWork]
    preempted: list[str] = []  # request ids preempted while planning this step
    released: list[int] = []  # seq ids whose workspace state can be dropped


class SeqResult(msgspec.Struct, kw_only=True):
    slot: int
    seq_id: int
    request_id: str
    num_drafts: int  # drafts proposed
    num_accepted: int  # drafts accepted (before stop truncation)
    token_ids: list[int]  # tokens emitted this step (after truncation)
    finish_reason: str | None = None  # "stop" | "length" | None


class StepResult(msgspec.Struct, kw_only=True):
    step: int
    results: list[SeqResult]
    preempted: list[str] = []


class NewRequest(msgspec.Struct, tag=True, kw_only=True):
    """Runtime to scheduler: admit a validated request."""

    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    speculative: bool


class AbortRequest(msgspec.Struct, tag=True, kw_only=True):
    seq_id: int
    reason: str = "aborted"


Control = NewRequest | AbortRequest
