"""NumPy references for the step-record kernels (the CPU path).

Each function here has the exact semantics of one kernel in this folder, and
its output is byte-identical to the kernel's on valid input:

* :func:`speculate_save_ref` <-> ``speculate_save.cu``: header, ``accept_num``
  and the CSR ``token_ids``.
* :func:`pack_topk_ref` <-> ``pack_topk.cu``: the logprob block, exactly
  ``width`` columns wide.

The record layout they produce is defined, field by field, in
:mod:`spectrio.core.record`, which owns its constants and header rules, and which
assembles and parses whole records.
The references validate their input and raise ``ValueError``; the kernels
trust theirs (the loader checks shapes and dtypes, and the kernels clamp
counts into range only so a bad input cannot write out of bounds).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from spectrio.core.record import (
    HEADER_WORDS,
    KIND_DRAFT,
    KIND_TARGET,
    MAX_WIDTH,
    PREEMPTED,
    RECORD_VERSION,
    pack_header,
    record_width,
    unpack_header,
)

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")

# The format's constants and header helpers are core.record's; they stay importable here.
__all__ = [
    "HEADER_WORDS",
    "KIND_DRAFT",
    "KIND_TARGET",
    "MAX_WIDTH",
    "PREEMPTED",
    "RECORD_VERSION",
    "expand_per_token",
    "pack_header",
    "pack_step_record",
    "pack_topk_ref",
    "record_width",
    "speculate_save_ref",
    "unpack_header",
]


def expand_per_token(per_slot: np.ndarray, accept_num: np.ndarray) -> np.ndarray:
    """Repeat a per-slot value once per emitted token (CSR by ``accept_num``;
    slots with ``accept_num <= 0`` contribute nothing)."""
    return np.repeat(np.asarray(per_slot), np.maximum(np.asarray(accept_num), 0))


def check_slot_shapes(bsz: int, **arrays: Any) -> None:
    """Every per-slot input of ``speculate_save`` must have shape ``[bsz]``."""
    for name, arr in arrays.items():
        if tuple(arr.shape) != (bsz,):
            raise ValueError(f"{name} must have shape [{bsz}], got {tuple(arr.shape)}")


def speculate_save_ref(
    accepted_tokens: np.ndarray,
    accept_counts: np.ndarray,
    preempted: np.ndarray,
    seq_lens_decoder: np.ndarray,
    prompt_lens: np.ndarray,
    kind: int,
    width: int = 0,
) -> np.ndarray:
    """Header, ``accept_num`` and ``token_ids`` of one step record.

    Args:
        accepted_tokens: int [bsz, k+1], the tokens each slot emits, left-aligned.
        accept_counts: int [bsz], how many of them are emitted (0 for a stopped
            or empty slot), in ``[0, k+1]``.
        preempted: bool [bsz], slot preempted or aborted this step.
        seq_lens_decoder: int [bsz]; with ``prompt_lens`` marks chunked prefill
            in progress (``seq_lens_decoder < prompt_lens``).
        prompt_lens: int [bsz].
        kind: record kind, 0..255 (``KIND_TARGET`` or ``KIND_DRAFT``).
        width: logprob block width the record will carry (header only).

    Returns:
        Little-endian int32 ``[4 + bsz + num_tokens]``: header, accept_num
        (-9 preempted, 0 prefill in progress, else the count), token_ids.
    """
    tokens = np.asarray(accepted_tokens)
    counts = np.asarray(accept_counts)
    pre = np.asarray(preempted, dtype=bool)
    dec = np.asarray(seq_lens_decoder)
    plen = np.asarray(prompt_lens)
    if tokens.ndim != 2:
        raise ValueError(f"accepted_tokens must be [bsz, k+1], got shape {tokens.shape}")
    bsz, cols = tokens.shape
    check_slot_shapes(
        bsz, accept_counts=counts, preempted=pre, seq_lens_decoder=dec, prompt_lens=plen
    )
    if bsz and (counts.min() < 0 or counts.max() > cols):
        raise ValueError(f"accept_counts must lie in [0, {cols}]")

    accept_num = np.where(pre, PREEMPTED, np.where(dec < plen, 0, counts)).astype(_I32)
    emit = np.arange(cols)[None, :] < np.maximum(accept_num, 0)[:, None]
    token_ids = tokens[emit].astype(_I32)  # row-major: slot after slot
    header = pack_header(kind, width, bsz, int(token_ids.size))
    return np.concatenate([header, accept_num, token_ids]).astype(_I32, copy=False)


def pack_topk_ref(
    topk_ids: np.ndarray,
    topk_vals: np.ndarray,
    ranks: np.ndarray,
    topn: np.ndarray,
    width: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The logprob block of one step record.

    Args:
        topk_ids: int [num_tokens, W_max]; column 0 is the emitted token,
            columns 1.. its top alternatives, best first.
        topk_vals: float [num_tokens, W_max], the matching logprobs.
        ranks: int [num_tokens], rank of each emitted token.
        topn: int [num_tokens], the top-N each token's request asked for
            (-1: no logprobs for that request; 0: the sampled token only).
        width: block width, ``1 <= width <= W_max`` and ``>= 1 + max(topn)``.

    Returns:
        ``(lp_ids int32 [num_tokens, width], lp_vals float32 [num_tokens, width],
        ranks int32 [num_tokens])``, little-endian. Column ``c`` of token ``t``
        holds the input when ``c <= topn[t]``, else -1 and 0.0. Tokens with
        ``topn < 0`` get rank -1.
    """
    ids = np.asarray(topk_ids)
    vals = np.asarray(topk_vals)
    rk = np.asarray(ranks)
    n = np.asarray(topn)
    if ids.ndim != 2 or vals.shape != ids.shape:
        raise ValueError(f"topk_ids/topk_vals must be matching 2-D, got {ids.shape}, {vals.shape}")
    num_tokens, w_max = ids.shape
    if rk.shape != (num_tokens,) or n.shape != (num_tokens,):
        raise ValueError(f"ranks and topn must have shape [{num_tokens}]")
    if not 1 <= width <= w_max:
        raise ValueError(f"width must be in [1, {w_max}], got {width}")
    if num_tokens and int(n.max()) + 1 > width:
        raise ValueError(f"width {width} is narrower than 1 + max(topn) = {int(n.max()) + 1}")

    want = np.arange(width)[None, :] <= n[:, None]
    lp_ids = np.where(want, ids[:, :width], -1).astype(_I32)
    lp_vals = np.where(want, vals[:, :width].astype(np.float32), np.float32(0.0)).astype(_F32)
    out_ranks = np.where(n >= 0, rk, -1).astype(_I32)
    return lp_ids, lp_vals, out_ranks


def pack_step_record(
    accepted_tokens: np.ndarray,
    accept_counts: np.ndarray,
    preempted: np.ndarray,
    seq_lens_decoder: np.ndarray,
    prompt_lens: np.ndarray,
    *,
    kind: int = KIND_TARGET,
    logprobs: np.ndarray | None = None,
    topk_ids: np.ndarray | None = None,
    topk_vals: np.ndarray | None = None,
    ranks: np.ndarray | None = None,
) -> bytes:
    """Pack one step into a record (the CPU path of both kernels combined).

    Args:
        accepted_tokens, accept_counts, preempted, seq_lens_decoder,
            prompt_lens, kind: as in
            :func:`speculate_save_ref`.
        logprobs: int [bsz], the top-N each slot asked for (-1 or None: none;
            0: the sampled token only). Sets the record width.
        topk_ids, topk_vals: [num_tokens, W_max] logprob candidates of the
            emitted tokens in record order (column 0 the emitted token).
        ranks: int [num_tokens].
    """
    width = record_width(logprobs)
    head = speculate_save_ref(
        accepted_tokens, accept_counts, preempted, seq_lens_decoder, prompt_lens, kind, width
    )
    if width == 0:
        return head.tobytes()
    if topk_ids is None or topk_vals is None or ranks is None:
        raise ValueError("a slot asked for logprobs: topk_ids, topk_vals and ranks are required")
    assert logprobs is not None
    bsz = int(head[2])
    if np.shape(logprobs) != (bsz,):
        raise ValueError(f"logprobs must have shape [{bsz}], got {np.shape(logprobs)}")
    accept_num = head[HEADER_WORDS : HEADER_WORDS + bsz]
    rows = np.shape(topk_ids)[0]
    if rows != int(head[3]):
        raise ValueError(f"logprob arrays have {rows} rows for {int(head[3])} emitted tokens")
    topn = expand_per_token(np.asarray(logprobs), accept_num)
    lp_ids, lp_vals, out_ranks = pack_topk_ref(topk_ids, topk_vals, ranks, topn, width)
    return b"".join((head.tobytes(), lp_ids.tobytes(), lp_vals.tobytes(), out_ranks.tobytes()))
