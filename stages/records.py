"""Packing a step's results into the per-step record (pure; the NumPy reference path).

The record layout is :mod:`spectrio.core.record`'s. Slot ``i < len(results)`` is the
plan's slot ``i``; after them come one slot per request preempted while planning the step
and one per request aborted since the last step, all stamped ``-9``. A slot still in
chunked prefill (``num_computed < context_len``) is stamped ``0``.
"""

from __future__ import annotations

import numpy as np

from spectrio.core.messages import PublishedStep, StepResult
from spectrio.core.record import pack_step_record
from spectrio.cuda_kernels.reference import record_width

__all__ = ["publish_step"]


def publish_step(result: StepResult) -> PublishedStep:
    results = result.results
    extra = list(result.preempted) + list(result.aborted)
    bsz = len(results) + len(extra)
    cols = max([1] + [len(r.token_ids) for r in results])
    tokens = np.full((bsz, cols), -1, dtype=np.int32)
    counts = np.zeros(bsz, dtype=np.int32)
    decoded = np.zeros(bsz, dtype=np.int32)
    context = np.zeros(bsz, dtype=np.int32)
    topn = np.full(bsz, -1, dtype=np.int32)
    for i, r in enumerate(results):
        tokens[i, : len(r.token_ids)] = r.token_ids
        counts[i] = len(r.token_ids)
        decoded[i], context[i] = r.num_computed, r.context_len
        if r.num_logprobs is not None:
            topn[i] = r.num_logprobs
    preempted = np.arange(bsz) >= len(results)
    width = record_width(topn)
    lp_ids = lp_vals = ranks = None
    if width:
        num_tokens = int(counts.sum())
        lp_ids = np.full((num_tokens, width), -1, dtype=np.int32)
        lp_vals = np.zeros((num_tokens, width), dtype=np.float32)
        ranks = np.full(num_tokens, -1, dtype=np.int32)
        row = 0
        for r in results:
            for lp in r.logprobs or []:
                lp_ids[row, 0], lp_vals[row, 0], ranks[row] = lp.token_id, lp.logprob, lp.rank
                if lp.top:
                    ids, vals = zip(*lp.top, strict=True)
                    lp_ids[row, 1 : 1 + len(ids)] = ids
                    lp_vals[row, 1 : 1 + len(vals)] = vals
                row += 1
            if not r.logprobs:
                row += len(r.token_ids)
    record = pack_step_record(
        tokens,
        counts,
        preempted,
        decoded,
        context,
        logprobs=topn,
        topk_ids=lp_ids,
        topk_vals=lp_vals,
        ranks=ranks,
    )
    return PublishedStep(
        step=result.step,
        request_ids=[r.request_id for r in results] + extra,
        finish_reasons=(
            [r.finish_reason for r in results]
            + [None] * len(result.preempted)
            + ["abort"] * len(result.aborted)
        ),
        record=record,
    )
