"""N-gram (prompt-lookup) drafting: a request's own tokens propose its next ones.

:func:`lookup` is the whole rule, pure. For ``n`` from ``max_n`` down to ``min_n``, take
the last ``n`` tokens of the sequence; if they occur earlier in it (prompt or output),
the tokens that followed their most recent earlier occurrence are the drafts, at most
``k``. The first ``n`` with a match wins, so a longer context always beats a shorter one;
no match, no drafts. Drafts are one-hot proposals like MTP's, so acceptance keeps the
target's output exactly (greedy) or its distribution (sampled). It needs no weights and
no device state: the only state is the :class:`~.base.TokenHistory` every proposer gets.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from spectrio.core.messages import StepPlan
from spectrio.stages.device.draft.base import Proposal, TokenHistory

__all__ = ["NgramProposer", "lookup"]


def lookup(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest
    suffix of ``tokens`` (``max_n`` down to ``min_n`` tokens long); [] when none occurs."""
    size = len(tokens)
    if k <= 0 or size < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = arr[size - n :]
        # windows starting at 0 .. size - n - 1: every occurrence that ends before the last
        # token, so at least one token follows it
        windows = np.lib.stride_tricks.sliding_window_view(arr[: size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


class NgramProposer:
    """Drafts by :func:`lookup` over each sequence's history."""

    method = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, plan: StepPlan, history: TokenHistory) -> Proposal:
        drafts: dict[int, list[int]] = {}
        for w in plan.seqs:
            if w.speculative and w.num_drafts > 0:
                found = lookup(history.tokens(w.seq_id), w.num_drafts, self.min_n, self.max_n)
                if found:
                    drafts[w.slot] = found
        return Proposal(drafts)

    def after_verify(
        self, plan: StepPlan, hidden: Any, row_starts: np.ndarray, history: TokenHistory
    ) -> Proposal:
        return Proposal({})

    def warmup(self, batch: Any, hidden: Any) -> None:
        return None

    def release(self, seq_ids: Iterable[int]) -> None:
        return None

    def holds(self, seq_id: int) -> bool:
        return False
