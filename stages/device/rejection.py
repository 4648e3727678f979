"""Lossless acceptance of draft tokens: greedy matching and rejection sampling.

Pure NumPy, no I/O. The sampler actor calls :func:`rejection_sample` once per
step with every request of the batch: its drafts, and the target at each draft
position and at the position after the last draft (the bonus position).

Rules (issue 4, "Rejection sampling"):

* **Greedy rows** accept a draft while it equals the target's argmax at its
  position. At the first mismatch they emit the argmax there and stop; with every
  draft accepted they emit the argmax at the bonus position.
* **Random rows with one-hot drafts** (``draft_probs`` is None, the MTP case)
  *sample, then match*: at each position ``n`` they draw ``x_n`` from the target
  ``p_n`` by inverse CDF with the keyed uniform (key, ``n``, ``SAMPLE``), accept
  the draft iff it equals ``x_n``, and at the first mismatch emit ``x_n`` and
  stop; with every draft accepted they emit ``x`` at the bonus position. A draft
  ``d`` is accepted with probability ``p(d) = min(1, p(d) / q(d))`` for the
  one-hot ``q``, and after a rejection ``x_n`` follows ``p`` with ``d`` removed,
  renormalised, which is the residual ``max(p - q, 0)``: this *is* rejection
  sampling, with one draw per position instead of two. Its point: the token a
  row emits at position ``n`` is ``x_n`` whether or not, and whatever, the
  drafts were, so the output does not depend on the draft schedule.
* **Random rows with a draft distribution** accept draft ``d`` when
  ``u < p(d) / q(d)`` (``u`` keyed with purpose ``ACCEPT``), ``q(d) == 0``
  counting as a rejection. At the first rejection they emit a token drawn from
  the normalised residual ``max(p - q, 0)`` (purpose ``RESIDUAL``) and stop. If
  the residual has no mass (``p == q`` on the support), the token is drawn from
  ``p`` instead. With every draft accepted they emit ``x`` at the bonus position
  (purpose ``SAMPLE``).

Random-number contract (what makes seeded rows reproducible): every uniform is
*keyed*, never streamed. The uniform for request key ``key``, output position
``n`` and purpose ``purpose`` is

    ``Generator(Philox(key=key + (purpose << 64), counter=n)).random()``

that is NumPy's Philox4x64-10 keyed with ``(key, purpose)``, whose counter is the
output position (:func:`keyed_uniforms`). No draw depends on how many draws came
before, on the batch, or on which purposes other positions used. A row's key
is its request's (the seed, or a random key drawn once per request), and
``positions[i]`` is the output position of row ``i``'s first draft (the number
of tokens the request emitted before this step). Inverse-CDF sampling is
:func:`sample_rows`, whose result is a function of the row and the uniform only.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np

__all__ = [
    "Purpose",
    "greedy_run",
    "keyed_sample",
    "keyed_uniforms",
    "rejection_sample",
    "sample_rows",
]

_TO_UNIT = 2.0**-53  # NumPy's Generator.random(): the top 53 bits of a 64-bit word


class Purpose(enum.IntEnum):
    """What a keyed uniform decides; the second word of the Philox key."""

    SAMPLE = 0  # the token at an output position (inverse CDF of the target there)
    ACCEPT = 1  # accept or reject a draft drawn from a draft distribution
    RESIDUAL = 2  # the token after such a rejection (inverse CDF of the residual)
    DRAFT = (
        3  # a draft sampled from a draft model's distribution (stages/device/draft/draft_model.py)
    )


def _csr_index(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])``, vectorised."""
    total = int(counts.sum())
    first = np.cumsum(counts) - counts
    return np.repeat(starts - first, counts) + np.arange(total)


def _unit(raw: np.ndarray) -> np.ndarray:
    return (raw >> np.uint64(11)).astype(np.float64) * _TO_UNIT


def keyed_uniforms(
    keys: np.ndarray, starts: np.ndarray, counts: np.ndarray, purpose: Purpose
) -> np.ndarray:
    """Float64 uniforms in ``[0, 1)``, CSR by ``counts``: row ``i`` gets the uniforms of
    positions ``starts[i] .. starts[i] + counts[i] - 1`` under ``keys[i]`` and
    ``purpose`` (the formula is in the module docstring).

    Consecutive counters of one Philox stream are consecutive positions (each
    position uses the first of the four words its counter block yields), so a row
    draws its positions in one call, and rows that share a key share one call."""
    keys_l = np.asarray(keys, dtype=np.uint64).tolist()
    starts_a = np.asarray(starts, dtype=np.int64)
    counts_a = np.asarray(counts, dtype=np.int64)
    out = np.empty(int(counts_a.sum()), dtype=np.float64)
    if np.any(starts_a[counts_a > 0] < 0):
        raise ValueError("positions must be >= 0")
    offsets = np.cumsum(counts_a) - counts_a
    tag = int(purpose) << 64
    groups: dict[int, list[int]] = {}
    for i in np.flatnonzero(counts_a > 0).tolist():
        groups.setdefault(keys_l[i], []).append(i)
    for key, members in groups.items():
        rows = np.asarray(members)
        lo = int(starts_a[rows].min())
        span = int((starts_a[rows] + counts_a[rows]).max()) - lo
        # A Philox call costs about as much as 1000 draws, so one call spanning gaps is
        # cheaper, up to a size (32 bytes per position) worth bounding.
        if len(members) > 1 and span > min(1024 * int(counts_a[rows].sum()) + 4096, 1 << 20):
            for i in members:  # far apart: one call per row
                o, c = int(offsets[i]), int(counts_a[i])
                bits = np.random.Philox(key=key + tag, counter=int(starts_a[i]))
                out[o : o + c] = _unit(bits.random_raw(4 * c)[::4])
            continue
        u = _unit(np.random.Philox(key=key + tag, counter=lo).random_raw(4 * span)[::4])
        if len(members) == 1:
            o = int(offsets[members[0]])
            out[o : o + span] = u
        else:
            out[_csr_index(offsets[rows], counts_a[rows])] = u[
                _csr_index(starts_a[rows] - lo, counts_a[rows])
            ]
    return out


def sample_rows(weights: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF sample one index per row of non-negative ``weights`` [R, V]
    using ``u`` [R] in [0, 1): the number of cumulative sums ``<= u * total``.
    Never returns a zero-weight index."""
    cdf = np.cumsum(weights, axis=1)
    target = u * cdf[:, -1]
    idx = (cdf <= target[:, None]).sum(axis=1)
    # Rounding at the top end can step past the last index with mass: clamp it there.
    # (Zero-weight indices below it are never picked: their cdf equals the one before.)
    v = weights.shape[1]
    top = np.minimum(idx, v - 1)
    over = np.flatnonzero((idx >= v) | ~(weights[np.arange(weights.shape[0]), top] > 0))
    if over.size:
        last_pos = v - 1 - np.argmax(weights[over, ::-1] > 0, axis=1)
        idx[over] = np.minimum(idx[over], last_pos)
    return idx


def keyed_sample(
    probs: np.ndarray, keys: np.ndarray, positions: np.ndarray, purpose: Purpose = Purpose.SAMPLE
) -> np.ndarray:
    """One token per row of ``probs`` [R, V]: the inverse-CDF sample with the keyed uniform
    of (``keys[i]``, ``positions[i]``, ``purpose``); with ``SAMPLE``, the token a random
    request emits at that output position whatever its drafts (module docstring)."""
    u = keyed_uniforms(keys, positions, np.ones(len(keys), dtype=np.int64), purpose)
    return sample_rows(probs, u)


def _validate(
    draft_token_ids: np.ndarray,
    num_draft_tokens: np.ndarray,
    target_probs: np.ndarray,
    is_greedy: np.ndarray,
    draft_probs: np.ndarray | None,
    keys: np.ndarray,
    positions: np.ndarray,
) -> None:
    if draft_token_ids.ndim != 1:
        raise ValueError(f"draft_token_ids must be 1-D, got shape {draft_token_ids.shape}")
    if num_draft_tokens.ndim != 1:
        raise ValueError(f"num_draft_tokens must be 1-D, got shape {num_draft_tokens.shape}")
    b = num_draft_tokens.shape[0]
    if np.any(num_draft_tokens < 0):
        raise ValueError("num_draft_tokens must be >= 0")
    t = int(num_draft_tokens.sum())
    if draft_token_ids.shape[0] != t:
        raise ValueError(
            f"draft_token_ids has {draft_token_ids.shape[0]} entries, "
            f"but num_draft_tokens sums to {t}"
        )
    if target_probs.ndim != 2 or target_probs.shape[0] != t + b:
        raise ValueError(
            f"target_probs must have shape [{t + b}, V] (drafts plus one bonus row per "
            f"request), got {target_probs.shape}"
        )
    v = target_probs.shape[1]
    if draft_probs is not None and draft_probs.shape != (t, v):
        raise ValueError(f"draft_probs must have shape [{t}, {v}], got {draft_probs.shape}")
    for name, arr in (("is_greedy", is_greedy), ("keys", keys), ("positions", positions)):
        if arr.shape != (b,):
            raise ValueError(f"{name} must have shape [{b}], got {arr.shape}")
    if b and positions.min() < 0:
        raise ValueError("positions must be >= 0")
    if t and (draft_token_ids.min() < 0 or draft_token_ids.max() >= v):
        raise ValueError(f"draft token ids must lie in [0, {v})")


def greedy_run(rows: np.ndarray, drafts: Sequence[int]) -> list[int]:
    """One greedy request's decision, as :func:`rejection_sample` makes it for a greedy
    row: its drafts while each equals the argmax of its row, then the argmax of the first
    row whose draft differs, or of the bonus row. ``rows`` [n + 1, V] for ``n`` drafts.
    A batch whose requests are all greedy is decided request by request with this: no
    randomness, and no copy of every row into one array."""
    if rows.ndim != 2 or rows.shape[0] != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} rows, got {rows.shape}")
    best = np.argmax(rows, axis=1).tolist()
    run: list[int] = []
    for draft, top in zip(drafts, best, strict=False):
        if draft != top:
            run.append(top)
            return run
        run.append(draft)
    run.append(best[len(drafts)])
    return run


def rejection_sample(
    draft_token_ids: np.ndarray,
    num_draft_tokens: np.ndarray,
    target_probs: np.ndarray,
    is_greedy: np.ndarray,
    draft_probs: np.ndarray | None,
    keys: np.ndarray,
    positions: np.ndarray,
) -> np.ndarray:
    """Decide which drafts each request accepts and what token follows them.

    Args:
        draft_token_ids: int [T], every draft of the batch, request after request.
        num_draft_tokens: int [B], drafts per request (``n_i``, may be 0).
        target_probs: float [T + B, V], request after request: the target's
            (processed) distribution at each of its ``n_i`` draft positions, then at
            the bonus position. Greedy rows only use each row's argmax (logits do).
        is_greedy: bool [B].
        draft_probs: float [T, V], the draft distribution each draft was sampled
            from, or None when drafts are deterministic (one-hot).
        keys: uint64 [B], each request's random key (unused for greedy rows).
        positions: int [B], the output position of each request's first draft.

    Returns:
        int32 [B, max(num_draft_tokens) + 1]: per row the accepted drafts then
        one recovered or bonus token, -1 in unused slots.
    """
    draft_token_ids = np.asarray(draft_token_ids)
    n = np.asarray(num_draft_tokens).astype(np.int64, copy=False)
    target_probs = np.asarray(target_probs)
    is_greedy = np.asarray(is_greedy, dtype=bool)
    keys = np.asarray(keys, dtype=np.uint64)
    positions = np.asarray(positions).astype(np.int64, copy=False)
    if draft_probs is not None:
        draft_probs = np.asarray(draft_probs)
    _validate(draft_token_ids, n, target_probs, is_greedy, draft_probs, keys, positions)

    b = n.shape[0]
    k = int(n.max()) if b else 0
    out = np.full((b, k + 1), -1, dtype=np.int32)
    if b == 0:
        return out
    # Padded [B, K + 1] views: column j < n_i is draft j, column n_i the bonus position.
    col = np.arange(k + 1)
    is_draft = col[None, :] < n[:, None]
    d_start = np.cumsum(n) - n
    t_start = d_start + np.arange(b)  # each request has n_i + 1 target rows
    d_flat = np.where(is_draft, d_start[:, None] + col[None, :], 0)
    drafts = np.where(is_draft, draft_token_ids[d_flat] if len(draft_token_ids) else 0, -1)
    stop = n.copy()  # column of the emitted non-draft token
    final = np.zeros(b, dtype=np.int64)  # that token

    greedy = np.flatnonzero(is_greedy)
    if greedy.size:
        g_n = n[greedy]
        g_rows = _csr_index(t_start[greedy], g_n + 1)
        best = np.full((greedy.size, k + 1), -1, dtype=np.int64)
        # Argmax over only the greedy requests' rows, or over all rows (no copy) when
        # every request is greedy.
        rows_max = (
            np.argmax(target_probs, axis=1)
            if greedy.size == b
            else np.argmax(target_probs[g_rows], axis=1)
        )
        best[col[None, :] <= g_n[:, None]] = rows_max
        miss = (best != drafts[greedy]) & is_draft[greedy]
        stop[greedy] = np.where(miss.any(axis=1), np.argmax(miss, axis=1), g_n)
        final[greedy] = best[np.arange(greedy.size), stop[greedy]]

    rand = np.flatnonzero(~is_greedy)
    if rand.size and draft_probs is None:
        _sample_then_match(target_probs, drafts, n, t_start, keys, positions, rand, stop, final)
    elif rand.size:
        assert draft_probs is not None
        _accept_reject(
            target_probs,
            draft_probs,
            drafts,
            n,
            d_flat,
            t_start,
            keys,
            positions,
            rand,
            stop,
            final,
        )

    out[:, :k][col[None, :k] < stop[:, None]] = drafts[:, :k][col[None, :k] < stop[:, None]]
    out[np.arange(b), stop] = final.astype(np.int32)
    return out


def _sample_then_match(
    target_probs: np.ndarray,
    drafts: np.ndarray,
    n: np.ndarray,
    t_start: np.ndarray,
    keys: np.ndarray,
    positions: np.ndarray,
    rows: np.ndarray,
    stop: np.ndarray,
    final: np.ndarray,
) -> None:
    """One-hot drafts: fill ``stop``/``final`` of ``rows``. Position by position, only
    rows still matching are sampled, so a row costs one sample per emitted token."""
    counts = n[rows] + 1
    u_all = keyed_uniforms(keys[rows], positions[rows], counts, Purpose.SAMPLE)
    u_start = np.cumsum(counts) - counts
    alive = np.arange(rows.size)  # indices into rows
    j = 0
    while alive.size:
        r = rows[alive]
        x = sample_rows(
            np.asarray(target_probs[t_start[r] + j], dtype=np.float64), u_all[u_start[alive] + j]
        )
        match = (j < n[r]) & (x == drafts[r, j])
        done = ~match
        stop[r[done]] = j
        final[r[done]] = x[done]
        alive = alive[match]
        j += 1


def _accept_reject(
    target_probs: np.ndarray,
    draft_probs: np.ndarray,
    drafts: np.ndarray,
    n: np.ndarray,
    d_flat: np.ndarray,
    t_start: np.ndarray,
    keys: np.ndarray,
    positions: np.ndarray,
    rows: np.ndarray,
    stop: np.ndarray,
    final: np.ndarray,
) -> None:
    """Drafts from a distribution: fill ``stop``/``final`` of ``rows``."""
    r_n = n[rows]
    k = drafts.shape[1] - 1
    valid = np.arange(k)[None, :] < r_n[:, None]
    d_rows = d_flat[rows, :k][valid]  # their draft rows, request after request
    t_rows = (t_start[rows, None] + np.arange(k)[None, :])[valid]
    r_drafts = drafts[rows, :k][valid]
    u = np.zeros((rows.size, k), dtype=np.float64)
    u[valid] = keyed_uniforms(keys[rows], positions[rows], r_n, Purpose.ACCEPT)
    p_d = np.zeros((rows.size, k), dtype=np.float64)
    q_d = np.zeros((rows.size, k), dtype=np.float64)
    p_d[valid] = target_probs[t_rows, r_drafts]
    q_d[valid] = draft_probs[d_rows, r_drafts]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(q_d > 0, p_d / np.where(q_d > 0, q_d, 1.0), 0.0)
    reject = ~((q_d > 0) & (u < ratio)) & valid
    first = np.argmax(reject, axis=1) if k else np.zeros(rows.size, dtype=np.int64)
    stop[rows] = np.where(reject.any(axis=1), first, r_n)
    rej = rows[stop[rows] < r_n]
    if rej.size:
        p = np.asarray(target_probs[t_start[rej] + stop[rej]], dtype=np.float64)
        q = np.asarray(draft_probs[d_flat[rej, stop[rej]]], dtype=np.float64)
        resid = np.maximum(p - q, 0.0)
        empty = ~(resid.sum(axis=1) > 0)
        resid[empty] = p[empty]
        ones = np.ones(rej.size, dtype=np.int64)
        u_res = keyed_uniforms(keys[rej], positions[rej] + stop[rej], ones, Purpose.RESIDUAL)
        final[rej] = sample_rows(resid, u_res)
    full = rows[stop[rows] == r_n]
    if full.size:
        bonus = np.asarray(target_probs[t_start[full] + n[full]], dtype=np.float64)
        final[full] = keyed_sample(bonus, keys[full], positions[full] + n[full])
