"""NumPy references for the step-record kernels (the CPU path).

Each function here has the exact semantics of one kernel in this folder, and
its output is byte-identical to the kernel's on valid input:

* :func:`speculate_save_ref` <-> ``speculate_save.cu``: header, ``accept_num``
  and the CSR ``token_ids``.
* :func:`pack_topk_ref` <-> ``pack_topk.cu``: the logprob block, exactly
  ``width`` columns wide.

The record layout they produce is documented field by field in
:mod:`spectrio.core.record`, which assembles and parses whole records.
The references validate their input and raise ``ValueError``; the kernels
trust theirs (the loader checks shapes and dtypes, and the kernels clamp
counts into range only so a bad input cannot write out of bounds).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "HEADER_WORDS",
    "KIND_DRAFT",
    "KIND_TARGET",
    "MAX_WIDTH",
    "PREEMPTED",
    "RECORD_VERSION",
    "expand_per_token",
    "pack_header",
    "pack_topk_ref",
    "record_width",
    "speculate_save_ref",
    "unpack_header",
]

RECORD_VERSION = 1
"""Version word of the step record (header[0])."""
KIND_TARGET = 3
"""Record kind: verified (target) tokens."""
KIND_DRAFT = 4
"""Record kind: draft tokens."""
PREEMPTED = -9
"""``accept_num`` value of a slot preempted or aborted this step."""
HEADER_WORDS = 4
"""int32 words in the header: version, kind | (width << 8), bsz, num_tokens."""
MAX_WIDTH = (1 << 23) - 1
"""Largest width that keeps ``kind | (width << 8)`` a non-negative int32."""

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")


def pack_header(kind: int, width: int, bsz: int, num_tokens: int) -> np.ndarray:
    """The 4-word header as little-endian int32."""
    if not 0 <= kind <= 0xFF:
        raise ValueError(f"record kind must fit in 8 bits (0..255), got {kind}")
    if not 0 <= width <= MAX_WIDTH:
        raise ValueError(f"record width must be in [0, {MAX_WIDTH}], got {width}")
    if bsz < 0 or num_tokens < 0:
        raise ValueError(f"bsz and num_tokens must be >= 0, got {bsz}, {num_tokens}")
    return np.array([RECORD_VERSION, (kind & 0xFF) | (width << 8), bsz, num_tokens], dtype=_I32)


def unpack_header(packed: int) -> tuple[int, int]:
    """Split header[1] into ``(kind, width)``."""
    return packed & 0xFF, packed >> 8


def record_width(topn_per_slot: np.ndarray | None) -> int:
    """Logprob block width for a batch: 0 when no slot wants logprobs
    (every entry < 0, or None), else 1 + the largest top-N any slot asked for.
    Column 0 always holds the sampled token."""
    if topn_per_slot is None:
        return 0
    topn = np.asarray(topn_per_slot)
    if topn.size == 0 or int(topn.max()) < 0:
        return 0
    return 1 + int(topn.max())


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
