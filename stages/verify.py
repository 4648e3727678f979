"""The verify stage: one target pass over every sequence's rows of the step.

Runs on the device worker. Rows are the prefill chunk, or ``[last token, drafts...]``;
a proposer that asks for them (MTP) gets the target hidden states of the step's rows."""

from __future__ import annotations

import time

import numpy as np

from spectrio.core.messages import StepPlan
from spectrio.models import PackedBatch
from spectrio.models.paddle_setup import paddle
from spectrio.stages.workspace import Workspace

__all__ = ["verify"]


def verify(ws: Workspace, plan: StepPlan) -> dict[int, np.ndarray]:
    """Run the target; returns every sampling slot's logits as a host float64 array
    ``[m + 1, V]`` (rows ``[last token, d1..dm]``)."""
    if not plan.seqs:  # a step that only reports aborts or preemptions: nothing to run
        return {}
    rows = [w.token_ids + (w.drafts if w.sample else []) for w in plan.seqs]
    batch = PackedBatch.from_sequences(
        rows, [w.start_pos for w in plan.seqs], [np.asarray(w.block_table) for w in plan.seqs]
    )
    ends = batch.cu_seqlens_q[1:]
    picks: list[np.ndarray] = []
    offsets: dict[int, tuple[int, int]] = {}
    n = 0
    for w, end in zip(plan.seqs, ends, strict=True):
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
    if ws.proposer is not None and ws.proposer.wants_hidden:
        ws.proposer.keep_hidden(plan, out.hidden, batch.cu_seqlens_q)
    if not offsets:
        return {}
    host = out.logits.numpy().astype(np.float64, copy=False)
    return {slot: host[lo : lo + count] for slot, (lo, count) in offsets.items()}
