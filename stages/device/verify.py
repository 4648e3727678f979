"""The verify stage: one target pass over every sequence's rows of the step.

Runs on the device worker. Rows are the prefill chunk, or ``[last token, drafts...]``;
a proposer that asks for them (MTP) gets the target hidden states of the step's rows, in
the same step (:meth:`~spectrio.stages.device.draft.base.Proposer.after_verify`).

The model computes logits only for the rows the step needs (``PackedBatch.logits_indices``):
each sampling slot's ``[last token, drafts...]`` rows, and the rows of a prefill chunk
that score prompt tokens for ``prompt_logprobs`` (``SeqWork.score_ids``). The sampler
stage reduces the latter to logprobs on this thread, so no ``[rows, vocab]`` array
leaves the device worker.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from spectrio.core.messages import StepPlan
from spectrio.models import PackedBatch
from spectrio.models.ops.paddle_setup import paddle
from spectrio.stages.device.workspace import Workspace

__all__ = ["Verified", "verify"]


@dataclasses.dataclass(frozen=True)
class Verified:
    """What verify hands the sampler stage, by slot."""

    # every sampling slot's logits, host float64 [m + 1, V] (rows [last token, d1..dm])
    logits: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    # every slot that scores prompt tokens: the raw logits of those rows as the model
    # computed them (float32 or float64) [len(score_ids), V]; the reduction widens them
    prompt_logits: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    # the proposer's rows after verify (Proposer.after_verify): draft-side rows whose
    # cost does not depend on k, added to the plan's ``draft_rows``
    draft_rows: int = 0


def verify(ws: Workspace, plan: StepPlan) -> Verified:
    """Run the target over the plan's rows; returns the logits of the rows that need them."""
    if not plan.seqs:  # a step that only reports aborts or preemptions: nothing to run
        return Verified()
    rows = [w.token_ids + (w.drafts if w.sample else []) for w in plan.seqs]
    batch = PackedBatch.from_sequences(
        rows, [w.start_pos for w in plan.seqs], [np.asarray(w.block_table) for w in plan.seqs]
    )
    starts, ends = batch.cu_seqlens_q[:-1], batch.cu_seqlens_q[1:]
    picks: list[np.ndarray] = []
    offsets: dict[int, tuple[int, int]] = {}
    scored: dict[int, tuple[int, int]] = {}
    n = 0
    for w, begin, end in zip(plan.seqs, starts, ends, strict=True):
        if w.score_ids:  # prompt rows come before the chunk's last row: never a sampling row
            first = int(begin) + w.score_start - w.start_pos
            count = len(w.score_ids)
            if w.score_start < w.start_pos or first + count > int(end) - (1 if w.sample else 0):
                raise ValueError(f"slot {w.slot}: scored rows outside its prompt chunk")
            picks.append(np.arange(first, first + count))
            scored[w.slot] = (n, count)
            n += count
        if w.sample:
            count = len(w.drafts) + 1
            picks.append(np.arange(end - count, end))
            offsets[w.slot] = (n, count)
            n += count
    batch.logits_indices = np.concatenate(picks) if picks else np.zeros(0, dtype=np.int64)
    t0 = time.perf_counter()
    with paddle.no_grad():
        out = ws.model.forward(batch, ws.target_cache)
    ws.forward_seconds += time.perf_counter() - t0
    draft_rows = 0
    if ws.proposer is not None:
        after = ws.proposer.after_verify(plan, out.hidden, batch.cu_seqlens_q, ws.history)
        ws.forward_seconds += after.forward_seconds
        draft_rows = after.extra_rows
    if not picks:
        return Verified(draft_rows=draft_rows)
    host = out.logits.numpy()
    return Verified(
        draft_rows=draft_rows,
        logits={
            slot: host[lo : lo + count].astype(np.float64, copy=False)
            for slot, (lo, count) in offsets.items()
        },
        prompt_logits={slot: host[lo : lo + count] for slot, (lo, count) in scored.items()},
    )
