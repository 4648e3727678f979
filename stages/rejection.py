"""Lossless acceptance of draft tokens: greedy matching and rejection sampling.

Pure NumPy, no I/O. The sampler actor calls :func:`rejection_sample` once per
step with every draft of the batch flattened into one array.

Rules (issue 4, "Rejection sampling"):

* **Greedy rows** accept a draft while it equals ``argmax(target_probs)`` at
  its position. At the first mismatch they emit the argmax and stop.
* **Random rows** accept draft ``d`` when ``u < p(d) / q(d)`` with ``u``
  uniform in ``[0, 1)`` (float64), ``q(d) = 1`` when ``draft_probs`` is None,
  and ``q(d) == 0`` counting as a rejection. At the first rejection they emit a
  token drawn from the normalised residual ``max(p - q, 0)`` (with one-hot
  drafts that is ``p`` with ``p(d)`` zeroed) and stop. If the residual has no
  mass (``p == q`` on the support), the token is drawn from ``p`` instead.
* Rows whose drafts are all accepted emit the caller's bonus token.

Random-number contract (what makes seeded rows reproducible):

* A random row with ``n > 0`` drafts consumes exactly ``n + 1`` float64
  uniforms from its generator, in one ``Generator.random(n + 1)`` call:
  ``n`` acceptance draws (one per draft position, whether or not the row gets
  that far) followed by one draw for the residual sample. The count never
  depends on the outcome, so a seeded row's stream stays aligned across steps.
* Rows with no drafts, and greedy rows, consume nothing.
* Rows whose generator is None share one generator. They draw in batch order,
  in a single ``random(sum(n_i + 1))`` call, split row by row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["rejection_sample", "sample_rows", "uniforms_per_row"]


def uniforms_per_row(num_draft_tokens: np.ndarray, is_greedy: np.ndarray) -> np.ndarray:
    """How many float64 uniforms each row consumes: ``n + 1`` for random rows
    with ``n > 0`` drafts, else 0."""
    n = np.asarray(num_draft_tokens, dtype=np.int64)
    greedy = np.asarray(is_greedy, dtype=bool)
    return np.where((n > 0) & ~greedy, n + 1, 0)


def _validate(
    draft_token_ids: np.ndarray,
    num_draft_tokens: np.ndarray,
    target_probs: np.ndarray,
    bonus_token_ids: np.ndarray,
    is_greedy: np.ndarray,
    draft_probs: np.ndarray | None,
    generators: Sequence[np.random.Generator | None],
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
    if target_probs.ndim != 2 or target_probs.shape[0] != t:
        raise ValueError(f"target_probs must have shape [{t}, V], got {target_probs.shape}")
    v = target_probs.shape[1]
    if draft_probs is not None and draft_probs.shape != target_probs.shape:
        raise ValueError(
            f"draft_probs shape {draft_probs.shape} != target_probs shape {target_probs.shape}"
        )
    if bonus_token_ids.shape != (b,):
        raise ValueError(f"bonus_token_ids must have shape [{b}], got {bonus_token_ids.shape}")
    if is_greedy.shape != (b,):
        raise ValueError(f"is_greedy must have shape [{b}], got {is_greedy.shape}")
    if len(generators) != b:
        raise ValueError(f"generators has {len(generators)} entries for {b} requests")
    if t and (draft_token_ids.min() < 0 or draft_token_ids.max() >= v):
        raise ValueError(f"draft token ids must lie in [0, {v})")


def _draw_uniforms(
    counts: np.ndarray,
    generators: Sequence[np.random.Generator | None],
    shared_generator: np.random.Generator | None,
) -> np.ndarray:
    """Float64 uniforms for every row, concatenated in batch order (CSR by
    ``counts``). Seeded rows draw from their own generator; the rest draw one
    block from the shared generator."""
    total = int(counts.sum())
    out = np.empty(total, dtype=np.float64)
    if total == 0:
        return out
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    has_own = np.fromiter((g is not None for g in generators), dtype=bool, count=len(generators))
    own_rows = np.flatnonzero(has_own & (counts > 0))
    for i in own_rows:
        gen = generators[int(i)]
        assert gen is not None
        out[starts[i] : starts[i] + counts[i]] = gen.random(int(counts[i]))
    shared_rows = np.flatnonzero(~has_own & (counts > 0))
    if shared_rows.size:
        gen = shared_generator if shared_generator is not None else np.random.default_rng()
        block = gen.random(int(counts[shared_rows].sum()))
        # Scatter the block into the shared rows' segments, preserving batch order.
        seg_counts = counts[shared_rows]
        seg_starts = np.repeat(starts[shared_rows], seg_counts)
        within = np.arange(block.size) - np.repeat(np.cumsum(seg_counts) - seg_counts, seg_counts)
        out[seg_starts + within] = block
    return out


def sample_rows(weights: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF sample one index per row of non-negative ``weights`` [R, V]
    using ``u`` [R] in [0, 1). Never returns a zero-weight index."""
    cdf = np.cumsum(weights, axis=1)
    total = cdf[:, -1]
    target = u * total
    idx = (cdf <= target[:, None]).sum(axis=1)
    # Guard against rounding at the top end: clamp to the last index with mass.
    last_pos = weights.shape[1] - 1 - np.argmax(weights[:, ::-1] > 0, axis=1)
    return np.minimum(idx, last_pos)


def rejection_sample(
    draft_token_ids: np.ndarray,
    num_draft_tokens: np.ndarray,
    target_probs: np.ndarray,
    bonus_token_ids: np.ndarray,
    is_greedy: np.ndarray,
    draft_probs: np.ndarray | None,
    generators: Sequence[np.random.Generator | None],
    *,
    shared_generator: np.random.Generator | None = None,
) -> np.ndarray:
    """Decide which drafts each request accepts and what token follows them.

    Args:
        draft_token_ids: int [T], every draft of the batch, request after request.
        num_draft_tokens: int [B], drafts per request (may be 0).
        target_probs: float [T, V], the target's (processed) distribution at
            each draft position.
        bonus_token_ids: int [B], a sample from the target at the position after
            each request's last draft; emitted when every draft is accepted.
        is_greedy: bool [B].
        draft_probs: float [T, V], the draft distribution each draft was sampled
            from, or None when drafts are deterministic (one-hot).
        generators: per-request generator; None means "use the shared one".
        shared_generator: generator for rows whose entry is None. When not
            given and such a row needs randomness, a fresh unseeded
            ``np.random.default_rng()`` is used.

    Returns:
        int32 [B, max(num_draft_tokens) + 1]: per row the accepted drafts then
        one recovered or bonus token, -1 in unused slots.
    """
    draft_token_ids = np.asarray(draft_token_ids)
    num_draft_tokens = np.asarray(num_draft_tokens).astype(np.int64, copy=False)
    target_probs = np.asarray(target_probs)
    bonus_token_ids = np.asarray(bonus_token_ids)
    is_greedy = np.asarray(is_greedy, dtype=bool)
    if draft_probs is not None:
        draft_probs = np.asarray(draft_probs)
    _validate(
        draft_token_ids,
        num_draft_tokens,
        target_probs,
        bonus_token_ids,
        is_greedy,
        draft_probs,
        generators,
    )

    b = num_draft_tokens.shape[0]
    k = int(num_draft_tokens.max()) if b else 0
    out = np.full((b, k + 1), -1, dtype=np.int32)
    if b == 0:
        return out

    # Padded [B, K] views of the flat draft arrays.
    row_start = np.cumsum(num_draft_tokens) - num_draft_tokens
    pos = np.arange(k)
    valid = pos[None, :] < num_draft_tokens[:, None]
    flat = np.where(valid, row_start[:, None] + pos[None, :], 0)
    t = draft_token_ids.shape[0]
    drafts = np.where(valid, draft_token_ids[flat] if t else 0, -1).astype(np.int64)
    safe_drafts = np.maximum(drafts, 0)

    # Acceptance matrix [B, K].
    accept = np.zeros((b, k), dtype=bool)
    greedy_rows = np.flatnonzero(is_greedy & (num_draft_tokens > 0))
    argmax_flat = np.argmax(target_probs, axis=1) if t else np.zeros(0, dtype=np.int64)
    if greedy_rows.size:
        g_flat = flat[greedy_rows]
        accept[greedy_rows] = (argmax_flat[g_flat] == drafts[greedy_rows]) & valid[greedy_rows]

    counts = uniforms_per_row(num_draft_tokens, is_greedy)
    uniforms = _draw_uniforms(counts, generators, shared_generator)
    random_rows = np.flatnonzero(counts > 0)
    u_start = np.cumsum(counts) - counts
    residual_u = np.zeros(b, dtype=np.float64)
    if random_rows.size:
        r_flat = flat[random_rows]
        r_drafts = safe_drafts[random_rows]
        r_valid = valid[random_rows]
        p_d = target_probs[r_flat, r_drafts].astype(np.float64)
        if draft_probs is None:
            q_d = np.ones_like(p_d)
        else:
            q_d = draft_probs[r_flat, r_drafts].astype(np.float64)
        u_idx = np.where(r_valid, u_start[random_rows, None] + pos[None, :], 0)
        u = uniforms[u_idx]
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(q_d > 0, p_d / np.where(q_d > 0, q_d, 1.0), 0.0)
        accept[random_rows] = (q_d > 0) & (u < ratio) & r_valid
        residual_u[random_rows] = uniforms[u_start[random_rows] + num_draft_tokens[random_rows]]

    # First rejected position per row (== n when every draft is accepted).
    rejected = ~accept & valid
    any_rej = rejected.any(axis=1)
    first_rej = num_draft_tokens.copy()
    if k:
        first_rej = np.where(any_rej, np.argmax(rejected, axis=1), first_rej)

    # Accepted drafts.
    keep = pos[None, :] < first_rej[:, None]
    out[:, :k][keep] = drafts[keep]

    # Final token: bonus, greedy correction, or a residual sample.
    final = bonus_token_ids.astype(np.int64).copy()
    rej_rows = np.flatnonzero(any_rej)
    if rej_rows.size:
        rej_flat = flat[rej_rows, first_rej[rej_rows]]
        g_mask = is_greedy[rej_rows]
        final[rej_rows[g_mask]] = argmax_flat[rej_flat[g_mask]]
        s_rows = rej_rows[~g_mask]
        if s_rows.size:
            s_flat = rej_flat[~g_mask]
            p = target_probs[s_flat].astype(np.float64)
            if draft_probs is None:
                resid = p.copy()
                resid[np.arange(s_rows.size), safe_drafts[s_rows, first_rej[s_rows]]] = 0.0
            else:
                resid = np.maximum(p - draft_probs[s_flat].astype(np.float64), 0.0)
            empty = ~(resid.sum(axis=1) > 0)
            resid[empty] = p[empty]
            final[s_rows] = sample_rows(resid, residual_u[s_rows])
    out[np.arange(b), first_rej] = final.astype(np.int32)
    return out
