"""Packing a step's results into the per-step record.

Two steps, kept apart so the device path can skip the first: :func:`step_arrays` lays a
:class:`StepResult` out as columns (host NumPy), and :func:`pack_record` packs columns
into the record's bytes. :func:`pack_record` dispatches on where the columns live: all on
the host, it runs the NumPy reference (:func:`spectrio.cuda_kernels.reference.pack_step_record`);
any on a GPU (CuPy, or any ``__dlpack__`` array whose ``__dlpack_device__`` is not the
CPU), it runs the CuPy kernels of :mod:`spectrio.cuda_kernels`. Both give the same bytes;
the layout is :mod:`spectrio.core.record`'s.

Slot ``i < len(results)`` is the plan's slot ``i``; after them come one slot per request
preempted while planning the step and one per request aborted since the last step, all
stamped ``-9``. A slot still in chunked prefill (``num_computed < context_len``) is
stamped ``0``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from spectrio.core.messages import PublishedStep, StepResult
from spectrio.core.record import HEADER_WORDS, KIND_TARGET
from spectrio.cuda_kernels import (
    expand_per_token,
    is_host_array,
    pack_topk_any,
    record_width,
    speculate_save_any,
    to_host,
)
from spectrio.cuda_kernels.reference import pack_step_record

__all__ = ["StepArrays", "on_device", "pack_record", "publish_step", "step_arrays"]


@dataclass(frozen=True, slots=True)
class StepArrays:
    """One step as the record's input columns. Each may be a host array (NumPy, lists) or
    a device ``__dlpack__`` array; shapes and meanings are those of
    :func:`spectrio.cuda_kernels.reference.pack_step_record`."""

    accepted_tokens: Any  # int [bsz, k+1], emitted tokens left-aligned
    accept_counts: Any  # int [bsz]
    preempted: Any  # bool [bsz]
    seq_lens_decoder: Any  # int [bsz]; < prompt_lens: chunked prefill in progress
    prompt_lens: Any  # int [bsz]
    logprobs: Any = None  # int [bsz], top-N per slot (-1: none); sets the width
    topk_ids: Any = None  # int [num_tokens, W_max], record order, column 0 emitted
    topk_vals: Any = None  # float [num_tokens, W_max]
    ranks: Any = None  # int [num_tokens]
    kind: int = KIND_TARGET


def step_arrays(result: StepResult) -> StepArrays:
    """The step's columns on the host, built from the per-sequence results."""
    results = result.results
    bsz = len(results) + len(result.preempted) + len(result.aborted)
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
    return StepArrays(tokens, counts, preempted, decoded, context, topn, lp_ids, lp_vals, ranks)


def on_device(arrays: StepArrays) -> bool:
    """True when any column lives off the host, so :func:`pack_record` takes the kernels."""
    columns = (getattr(arrays, f.name) for f in fields(arrays) if f.name != "kind")
    return not all(is_host_array(x) for x in columns if x is not None)


def pack_record(arrays: StepArrays, *, stream: Any = None) -> bytes:
    """The step record's bytes: the NumPy reference when every column is on the host, the
    CuPy kernels on ``stream`` (required then; the call synchronises on it) otherwise.

    Raises:
        spectrio.cuda_kernels.KernelUnavailable: device columns but no importable CuPy.
        ValueError: inconsistent columns (a slot asks for logprobs but the logprob
            columns are missing or have the wrong number of rows).
    """
    if on_device(arrays):
        return _pack_on_device(arrays, stream)
    a = arrays
    return pack_step_record(
        _host(a.accepted_tokens),
        _host(a.accept_counts),
        _host(a.preempted),
        _host(a.seq_lens_decoder),
        _host(a.prompt_lens),
        kind=a.kind,
        logprobs=_host(a.logprobs),
        topk_ids=_host(a.topk_ids),
        topk_vals=_host(a.topk_vals),
        ranks=_host(a.ranks),
    )


def _host(x: Any) -> Any:
    """A host column as NumPy can read it (a DLPack view for framework arrays); never a
    device copy, so the reference path cannot quietly run on device columns."""
    if x is None or isinstance(x, np.ndarray) or not hasattr(x, "__dlpack__"):
        return x
    return np.from_dlpack(x)


def _pack_on_device(a: StepArrays, stream: Any) -> bytes:
    # The width sizes the record, so the host needs it before any launch; top-N per slot
    # is a per-request setting, normally already on the host.
    topn_slots = None if a.logprobs is None else to_host(a.logprobs, stream=stream)
    width = record_width(topn_slots)
    head = speculate_save_any(
        a.accepted_tokens,
        a.accept_counts,
        a.preempted,
        a.seq_lens_decoder,
        a.prompt_lens,
        kind=a.kind,
        width=width,
        stream=stream,
    )
    if width == 0:
        return head.tobytes()
    assert topn_slots is not None
    if a.topk_ids is None or a.topk_vals is None or a.ranks is None:
        raise ValueError("a slot asked for logprobs: topk_ids, topk_vals and ranks are required")
    bsz, num_tokens = int(head[2]), int(head[3])
    if topn_slots.shape != (bsz,):
        raise ValueError(f"logprobs must have shape [{bsz}], got {topn_slots.shape}")
    rows = np.shape(a.topk_ids)[0]
    if rows != num_tokens:
        raise ValueError(f"logprob arrays have {rows} rows for {num_tokens} emitted tokens")
    topn = expand_per_token(topn_slots, head[HEADER_WORDS : HEADER_WORDS + bsz])
    block = pack_topk_any(a.topk_ids, a.topk_vals, a.ranks, topn, width, stream=stream)
    return b"".join([head.tobytes(), *(part.tobytes() for part in block)])


def publish_step(result: StepResult) -> PublishedStep:
    results, preempted, aborted = result.results, result.preempted, result.aborted
    return PublishedStep(
        step=result.step,
        request_ids=([r.request_id for r in results] + preempted + [e.request_id for e in aborted]),
        finish_reasons=(
            [r.finish_reason for r in results] + [None] * len(preempted) + ["abort"] * len(aborted)
        ),
        record=pack_record(step_arrays(result)),
        acceptance={
            **{
                r.request_id: r.acceptance
                for r in results
                if r.finish_reason is not None and r.acceptance is not None
            },
            **{e.request_id: e.acceptance for e in aborted if e.acceptance is not None},
        },
        cached_tokens={
            r.request_id: r.cached_tokens
            for r in results
            if r.finish_reason is not None and r.cached_tokens is not None
        },
        prompt_logprobs={r.request_id: r.prompt_logprobs for r in results if r.prompt_logprobs},
    )
