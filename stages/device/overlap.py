"""Resolving a step planned ahead (overlap scheduling), as pure functions.

With overlap the scheduler plans step N+1 while step N runs. A sequence that step N
samples cannot know, at planning time, how many tokens N emits (1 to k+1) or whether N
finishes it, so N+1 carries a *pending* :class:`SeqWork` for it: its slot, block table
(reserved for the longest outcome), drafts wanted and limits, but no input tokens.
:func:`resolve_plan` fills those in from step N's plan and result, on the device worker,
right before N+1 runs:

* a sequence that N finished is dropped (it loses and duplicates no token);
* otherwise it verifies its last emitted token at ``context_len + e - 1`` (``e`` tokens
  emitted), its draft slots are clamped by what it may still emit and by
  ``max_model_len``, and the remaining sequences' slots are renumbered. (A proposer
  reads the accepted tokens from its history: ``stages/device/draft/``.)

The result is exactly the plan the scheduler would have made after seeing N's result
(``tests/test_overlap.py`` checks that), so output is identical with overlap on and off.
"""

from __future__ import annotations

from msgspec.structs import replace

from spectrio.core.draft_methods import draft_slots
from spectrio.core.messages import SeqResult, SeqWork, StepPlan, StepResult

__all__ = ["resolve_plan", "resolve_work"]


def resolve_work(template: SeqWork, prev: SeqWork, result: SeqResult) -> SeqWork | None:
    """The concrete work of a pending sequence, or None when ``result`` finished it."""
    if result.finish_reason is not None:
        return None
    emitted = list(result.token_ids)
    e = len(emitted)
    if e == 0:
        raise RuntimeError(f"seq {template.seq_id}: step emitted no token and did not finish")
    length = prev.context_len + e
    num_output = prev.num_output + e
    start = length - 1
    remaining = template.params.max_tokens - num_output
    room = template.max_model_len - length
    drafts = draft_slots(template.num_drafts, remaining, room)
    return replace(
        template,
        pending=False,
        start_pos=start,
        token_ids=[emitted[-1]],
        num_drafts=drafts,
        max_new_tokens=min(remaining, room),
        num_output=num_output,
        context_len=length,
    )


def resolve_plan(
    template: StepPlan, prev_plan: StepPlan | None, prev_result: StepResult | None
) -> StepPlan:
    """``template`` with every pending sequence resolved from the previous step."""
    if not any(w.pending for w in template.seqs):
        return template
    if prev_plan is None or prev_result is None:
        raise RuntimeError(f"step {template.step} has pending work but no previous step")
    works = {w.seq_id: w for w in prev_plan.seqs}
    results = {r.seq_id: r for r in prev_result.results}
    seqs: list[SeqWork] = []
    for w in template.seqs:
        if w.pending:
            prev, result = works.get(w.seq_id), results.get(w.seq_id)
            if prev is None or result is None or not prev.sample:
                raise RuntimeError(
                    f"step {template.step}: seq {w.seq_id} is pending on step "
                    f"{prev_plan.step}, which did not sample it"
                )
            resolved = resolve_work(w, prev, result)
            if resolved is None:
                continue
            w = resolved
        seqs.append(w if w.slot == len(seqs) else replace(w, slot=len(seqs)))
    return replace(template, seqs=seqs)
