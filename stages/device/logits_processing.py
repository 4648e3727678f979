"""From one sequence's verify logits to the distributions the sampler draws from (pure NumPy).

A sampling sequence's verify pass yields rows ``[last token, d1, ..., dm]``; row ``i``
scores the token after row ``i``. Row ``i`` is processed as if ``d1..di`` had already
been emitted, so the result at a draft position is exactly what one-token-at-a-time
decoding would have used there (issue 4: "penalties are exact at every draft position").

Steps, in order (everything in float64):

1. **Penalties** (:func:`apply_penalties`), vLLM semantics:
   ``repetition_penalty`` over the prompt and the output so far (plus the drafts
   before the row): a seen token's logit is divided by the penalty when positive and
   multiplied by it otherwise. ``frequency_penalty * count`` and
   ``presence_penalty * (count > 0)`` are subtracted, with ``count`` over the output
   tokens (plus the drafts before the row) only.
2. **min_tokens** (:func:`mask_stop_tokens`): while fewer than ``min_tokens`` tokens
   precede the row's token, the stop tokens (EOS unless ignored, ``stop_token_ids``)
   get ``-inf``. A constrained request's row gets ``-inf`` for every token its grammar
   refuses there (:mod:`.grammar_book`).
3. Greedy requests stop here: their token is the argmax of these logits.
4. **temperature**, then **top-k** (every token whose logit ties the k-th largest
   is kept), then **top-p** (the smallest prefix of tokens, sorted by probability
   with ties broken by lower id, whose mass reaches ``top_p``; the top token is always
   kept), then **min-p** (keep ``p >= min_p * max p``); the survivors are renormalised
   by a softmax (:func:`sampling_probs`).

Logprobs (:func:`token_logprobs`) are computed only for the rows of emitted tokens; the
top alternatives are ordered by logprob, ties (``-inf`` included) by lower token id.
Prompt logprobs (:func:`prompt_logprobs`) are the same reduction (:func:`log_softmax` in
float64, then :func:`token_logprobs`) over the rows that score prompt tokens, taken a
block of rows at a time so a long prefill chunk never needs a float64 copy of all its
rows at once; :func:`logprob_entries` turns either into
:class:`~spectrio.core.messages.TokenLogprob` s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from spectrio.core.messages import TokenLogprob
from spectrio.core.params import SamplingParams

__all__ = [
    "History",
    "LogprobRows",
    "apply_penalties",
    "log_softmax",
    "softmax",
    "logprob_entries",
    "mask_stop_tokens",
    "process_rows",
    "prompt_logprobs",
    "sampling_probs",
    "token_logprobs",
    "top_logprobs",
]


@dataclasses.dataclass
class History:
    """What penalties need to know about a sequence before the current step.

    ``seen`` marks tokens of the prompt and the output (only kept when
    ``repetition_penalty != 1``); ``counts`` counts output tokens (only kept when
    any penalty is on).
    """

    vocab_size: int
    seen: np.ndarray | None = None  # bool [V]
    counts: np.ndarray | None = None  # int64 [V]
    num_output: int = 0

    @classmethod
    def start(cls, params: SamplingParams, vocab_size: int, prompt_ids: Sequence[int]) -> History:
        hist = cls(vocab_size)
        if params.repetition_penalty != 1.0:
            hist.seen = np.zeros(vocab_size, dtype=bool)
            hist.seen[np.asarray(prompt_ids, dtype=np.int64)] = True
        if params.has_penalties:
            hist.counts = np.zeros(vocab_size, dtype=np.int64)
        return hist

    def extend(self, token_ids: Sequence[int]) -> None:
        """Record emitted tokens."""
        self.num_output += len(token_ids)
        if not token_ids:
            return
        ids = np.asarray(token_ids, dtype=np.int64)
        if self.seen is not None:
            self.seen[ids] = True
        if self.counts is not None:
            np.add.at(self.counts, ids, 1)


def _draft_prefix_counts(drafts: Sequence[int], num_rows: int, vocab_size: int) -> np.ndarray:
    """int64 [R, V]: row i counts ``drafts[:i]``."""
    extra = np.zeros((num_rows, vocab_size), dtype=np.int64)
    for i in range(1, num_rows):
        extra[i] = extra[i - 1]
        extra[i, drafts[i - 1]] += 1
    return extra


def apply_penalties(
    logits: np.ndarray, params: SamplingParams, history: History, drafts: Sequence[int]
) -> np.ndarray:
    """Penalised ``logits`` [R, V] as float64; row i's history includes ``drafts[:i]``.
    Without penalties this is ``logits`` itself when it already is float64 (never modified)."""
    if not params.has_penalties:
        return np.asarray(logits, dtype=np.float64)
    out = np.array(logits, dtype=np.float64)
    rows, vocab = out.shape
    if len(drafts) < rows - 1:
        raise ValueError(f"{rows} rows need {rows - 1} drafts, got {len(drafts)}")
    assert history.counts is not None
    counts = history.counts[None, :] + _draft_prefix_counts(drafts, rows, vocab)
    if params.repetition_penalty != 1.0:
        assert history.seen is not None
        seen = history.seen[None, :] | (counts > 0)
        pen = params.repetition_penalty
        out = np.where(seen, np.where(out > 0, out / pen, out * pen), out)
    if params.frequency_penalty != 0.0:
        out -= params.frequency_penalty * counts
    if params.presence_penalty != 0.0:
        out -= params.presence_penalty * (counts > 0)
    return out


def mask_stop_tokens(
    logits: np.ndarray, num_output: int, min_tokens: int, stop_token_ids: Sequence[int]
) -> np.ndarray:
    """``logits`` with the stop tokens set to ``-inf`` in every row ``i`` with
    ``num_output + i < min_tokens`` (the token it scores would be emitted too early).
    Returns a copy when it masks anything, else ``logits`` itself."""
    early = min_tokens - num_output
    if early <= 0 or not len(stop_token_ids):
        return logits
    out = np.array(logits, dtype=np.float64)
    out[:early, np.asarray(stop_token_ids, dtype=np.int64)] = -np.inf
    return out


def softmax(logits: np.ndarray) -> np.ndarray:
    """Rows of ``logits`` to probabilities (the max subtracted first)."""
    shifted = logits - np.max(logits, axis=-1, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=-1, keepdims=True)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - np.max(x, axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def sampling_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Temperature, top-k, top-p and min-p over penalised logits [R, V] -> probabilities
    [R, V] (float64, rows sum to 1). For random (temperature > 0) requests only."""
    if params.is_greedy:
        raise ValueError("sampling_probs is for temperature > 0; greedy takes the argmax")
    x = np.asarray(logits, dtype=np.float64) / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = np.partition(x, vocab - params.top_k, axis=-1)[:, vocab - params.top_k]
        x = np.where(x >= kth[:, None], x, -np.inf)
    probs = softmax(x)
    if params.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly before each token
        keep_sorted = before < params.top_p
        keep_sorted[:, 0] = True
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        x = np.where(keep, x, -np.inf)
        probs = softmax(x)
    if params.min_p > 0.0:
        keep = probs >= params.min_p * probs.max(axis=-1, keepdims=True)
        x = np.where(keep, x, -np.inf)
        probs = softmax(x)
    return probs


def process_rows(
    logits: np.ndarray,
    params: SamplingParams,
    history: History,
    drafts: Sequence[int],
    stop_token_ids: Sequence[int],
    allowed: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """One sequence's rows [R, V] -> ``(processed logits, probabilities)``.

    The processed logits are penalised, min_tokens-masked and, for a constrained request,
    masked to the tokens its grammar allows at each row (``allowed``, bool [R, V]); greedy
    requests take their argmax. The probabilities are None for greedy requests.
    """
    processed = apply_penalties(logits, params, history, drafts)
    processed = mask_stop_tokens(processed, history.num_output, params.min_tokens, stop_token_ids)
    if allowed is not None:
        processed = np.where(allowed, processed, -np.inf)
    if params.is_greedy:
        return processed, None
    return processed, sampling_probs(processed, params)


@dataclasses.dataclass
class LogprobRows:
    """Logprobs of emitted tokens, one row per token."""

    token_logprobs: np.ndarray  # float64 [n]
    ranks: np.ndarray  # int64 [n], 1 = the most likely token
    top_ids: np.ndarray  # int64 [n, top]
    top_logprobs: np.ndarray  # float64 [n, top]


def top_logprobs(logprobs: np.ndarray, top: int) -> np.ndarray:
    """int64 [n, top]: per row the ``top`` token ids in the order (logprob descending, token
    id ascending). A total order, so ties (``-inf`` included) never depend on anything but
    the row, and the first ``t`` columns for ``top >= t`` are the answer for ``t``: a
    request's alternatives do not depend on what its batch neighbours asked for."""
    lp = np.asarray(logprobs, dtype=np.float64)
    n, vocab = lp.shape
    top = min(top, vocab)
    if top == 0 or n == 0:
        return np.zeros((n, top), dtype=np.int64)
    # The top-th largest value per row; everything above it is in, and of the values equal
    # to it, the lowest ids fill the remaining columns.
    kth = -np.partition(-lp, top - 1, axis=1)[:, top - 1]
    above = lp > kth[:, None]
    tied = lp == kth[:, None]
    room = top - above.sum(axis=1)
    chosen = above | (tied & (np.cumsum(tied, axis=1) <= room[:, None]))
    ids = np.nonzero(chosen)[1].reshape(n, top)  # ascending id within each row
    order = np.lexsort((ids, -np.take_along_axis(lp, ids, axis=1)), axis=1)
    return np.take_along_axis(ids, order, axis=1)


def token_logprobs(logprobs: np.ndarray, token_ids: Sequence[int], top: int) -> LogprobRows:
    """For rows ``logprobs`` [n, V] and the token emitted from each row: its logprob,
    its rank (1 + the number of strictly more likely tokens) and the ``top`` most likely
    (id, logprob) pairs, best first, ties broken by lower id (:func:`top_logprobs`)."""
    lp = np.asarray(logprobs, dtype=np.float64)
    n = lp.shape[0]
    ids = np.asarray(token_ids, dtype=np.int64)
    chosen = lp[np.arange(n), ids]
    ranks = (lp > chosen[:, None]).sum(axis=1) + 1
    top_ids = top_logprobs(lp, top)
    return LogprobRows(chosen, ranks, top_ids, np.take_along_axis(lp, top_ids, axis=1))


def logprob_entries(
    rows: LogprobRows, token_ids: Sequence[int], wants: Sequence[int]
) -> list[TokenLogprob]:
    """One :class:`TokenLogprob` per row of ``rows`` (computed for ``token_ids``), row
    ``i`` keeping the first ``wants[i]`` of its top columns (a request's alternatives do
    not depend on what its batch neighbours asked for: :func:`top_logprobs`)."""
    values, ranks = rows.token_logprobs.tolist(), rows.ranks.tolist()
    top_ids, top_lps = rows.top_ids.tolist(), rows.top_logprobs.tolist()
    return [
        TokenLogprob(
            token_id=int(tok),
            logprob=values[i],
            rank=ranks[i],
            top=list(zip(top_ids[i][:want], top_lps[i][:want], strict=True)),
        )
        for i, (tok, want) in enumerate(zip(token_ids, wants, strict=True))
    ]


PROMPT_BLOCK_ROWS = 64
"""Rows reduced at once by :func:`prompt_logprobs`: float64 temporaries of this many
rows times the vocabulary (about 25 MB each for a 49,152-token vocabulary)."""


def prompt_logprobs(
    logits: np.ndarray, token_ids: Sequence[int], top: int, *, block_rows: int = PROMPT_BLOCK_ROWS
) -> list[TokenLogprob]:
    """The logprobs of prompt tokens: row ``i`` of ``logits`` [n, V] (the raw target
    logits at the position before ``token_ids[i]``) scores ``token_ids[i]``, with the
    ``top`` most likely alternatives. The same float64 log-softmax as the sampled tokens'
    ``raw`` logprobs, block by block of ``block_rows`` rows."""
    n = len(token_ids)
    if logits.shape[0] != n:
        raise ValueError(f"{logits.shape[0]} logit rows for {n} prompt tokens")
    out: list[TokenLogprob] = []
    for lo in range(0, n, block_rows):
        hi = min(n, lo + block_rows)
        ids = token_ids[lo:hi]
        rows = token_logprobs(log_softmax(logits[lo:hi]), ids, top)
        out += logprob_entries(rows, ids, [top] * (hi - lo))
    return out
