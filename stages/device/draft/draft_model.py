"""Drafting with a model of its own: any checkpoint spectrio loads that shares the
target's vocabulary, the target itself, or its first N layers (self-speculation), as a
:class:`Proposer`.

The draft model keeps a paged KV cache of its own, in blocks that share the target's
block tables (the scheduler's reservation for the verify rows covers its substeps).
Its KV at position ``p`` depends on the tokens up to ``p`` only. Per sequence, positions
below its *catch-up position* hold real draft KV:

* a decode step runs the draft over positions ``catch-up .. start_pos`` (the accepted
  tokens since its last pass, then the step's committed token), samples draft 1 from
  the last row, and each further substep feeds the previous draft back. Entries past
  ``start_pos`` are speculative; the next step's catch-up overwrites them;
* a prompt chunk runs the draft over all of its rows after verify, in the same step
  (:meth:`DraftModelProposer.after_verify`), so a prompt block's draft KV is complete
  when its step returns and the scheduler can register it;
* a decode step that drafts nothing may defer its catch-up, as MTP's does.

Drafts are *sampled*: a greedy request's are the draft's argmax, a random request's
are drawn from the draft's distribution at the request's temperature, by inverse CDF
with a keyed uniform (the request's key, the draft's output position, purpose
``DRAFT``). The distributions go to verification (:attr:`Proposal.draft_probs`), which
applies the full rule: accept with ``min(1, p/q)``, on rejection sample from the
normalised ``max(0, p - q)``. So the output keeps the target's distribution whatever
the draft is. The key comes from the plan alone (the seed, else a hash of the request
id), so every tensor-parallel rank draws the same drafts.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from spectrio.core.messages import SeqWork, StepPlan
from spectrio.models import PackedBatch, PagedKVCache, SpectrioForCausalLM
from spectrio.models.ops.paddle_setup import paddle
from spectrio.stages.device.draft.base import Proposal, TokenHistory
from spectrio.stages.device.draft.mtp import MAX_LAG, CatchUp, extra_rows
from spectrio.stages.device.logits_processing import softmax
from spectrio.stages.device.rejection import Purpose, keyed_sample

__all__ = ["DraftModelProposer", "draft_key", "sample_drafts"]


def draft_key(work: SeqWork) -> int:
    """The key of a request's draft draws: its seed, else a hash of its request id (the
    plan alone decides it, so every rank draws alike)."""
    if work.params.seed is not None:
        return int(work.params.seed) & ((1 << 64) - 1)
    digest = hashlib.blake2b(work.request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def sample_drafts(
    logits: np.ndarray, temperatures: np.ndarray, keys: np.ndarray, positions: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One draft per row of ``logits`` [R, V]: the argmax where the temperature is 0,
    else a draw from ``softmax(logits / temperature)`` with the keyed uniform of
    (key, output position, ``DRAFT``). Returns the tokens [R] and the float64
    distributions they were drawn from [R, V] (one-hot for argmax rows)."""
    x = np.asarray(logits, dtype=np.float64)
    probs = np.zeros_like(x)
    tokens = np.argmax(x, axis=1)
    greedy = temperatures <= 0
    probs[np.flatnonzero(greedy), tokens[greedy]] = 1.0
    hot = np.flatnonzero(~greedy)
    if hot.size:
        probs[hot] = softmax(x[hot] / temperatures[hot, None])
        tokens[hot] = keyed_sample(probs[hot], keys[hot], positions[hot], Purpose.DRAFT)
    return tokens, probs


class DraftModelProposer:
    """Drafts with ``model``'s first ``num_layers`` layers (all of them by default)."""

    method = "draft_model"

    def __init__(
        self,
        model: SpectrioForCausalLM,
        num_blocks: int,
        block_size: int,
        *,
        k_max: int,
        num_layers: int | None = None,
        num_kv_heads: int | None = None,
    ) -> None:
        """``num_kv_heads``: the KV heads ``model``'s pass writes (a tensor-parallel
        shard's share, when the target's shard drafts for itself)."""
        cfg = model.config
        self.model = model
        self.k_max = k_max
        self.num_layers = cfg.num_hidden_layers if num_layers is None else num_layers
        if not 1 <= self.num_layers <= cfg.num_hidden_layers:
            raise ValueError(
                f"draft layers: must be in 1..{cfg.num_hidden_layers}, got {self.num_layers}"
            )
        kvh = cfg.num_key_value_heads if num_kv_heads is None else num_kv_heads
        self.cache = PagedKVCache(
            self.num_layers, num_blocks, block_size, kvh, cfg.head_dim, model.dtype
        )
        self.catch_up = CatchUp(lookahead=0)  # its KV at a position reads nothing past it

    # ---- the passes -------------------------------------------------------------------

    def _forward(
        self, rows: list[list[int]], starts: list[int], works: list[SeqWork], pick: np.ndarray
    ) -> np.ndarray | None:
        """The draft over ``rows`` (sequence i's at positions ``starts[i] ..``); the
        logits of the rows ``pick`` indexes, as host float32 [len(pick), V]."""
        batch = PackedBatch.from_sequences(rows, starts, [np.asarray(w.block_table) for w in works])
        batch.logits_indices = pick
        with paddle.no_grad():
            out = self.model.forward(batch, self.cache, num_layers=self.num_layers)
        return out.logits.numpy() if pick.size else None

    def _catch_up(self, w: SeqWork, end: int, history: TokenHistory) -> tuple[int, list[int]]:
        """Positions ``catch-up .. end - 1`` and their tokens; the position moves to end."""
        return self.catch_up.advance(w.seq_id, end, history.tokens(w.seq_id), len(w.cached_ids))

    def propose(self, plan: StepPlan, history: TokenHistory) -> Proposal:
        """Catch every decoding speculative sequence up through its committed token,
        then sample its drafts substep by substep."""
        work: list[tuple[SeqWork, int, list[int]]] = []
        for w in plan.seqs:
            if not w.speculative or not w.decodes or self.catch_up.may_defer(w, MAX_LAG):
                continue
            first, tokens = self._catch_up(w, w.start_pos + 1, history)
            if tokens:
                work.append((w, first, tokens))
        if not work:
            return Proposal({})
        t0 = time.perf_counter()
        wanting = [i for i, (w, _, _) in enumerate(work) if w.num_drafts > 0]
        ends = np.cumsum([len(t) for _, _, t in work]) - 1
        logits = self._forward(
            [t for _, _, t in work], [f for _, f, _ in work], [w for w, _, _ in work],
            ends[wanting],
        )  # fmt: skip
        active = [work[i][0] for i in wanting]
        drafts: dict[int, list[int]] = {w.slot: [] for w in active}
        dists: dict[int, list[np.ndarray]] = {w.slot: [] for w in active}
        temps = np.array([w.params.temperature for w in active], dtype=np.float64)
        keys = np.array([draft_key(w) for w in active], dtype=np.uint64)
        substep = 0
        while active and logits is not None:
            positions = np.array([w.num_output + substep for w in active], dtype=np.int64)
            picked, dist = sample_drafts(logits, temps, keys, positions)
            for i, w in enumerate(active):
                drafts[w.slot].append(int(picked[i]))
                dists[w.slot].append(dist[i])
            substep += 1
            keep = [i for i, w in enumerate(active) if w.num_drafts > substep]
            if not keep:
                break
            active = [active[i] for i in keep]
            temps, keys = temps[keep], keys[keep]
            logits = self._forward(
                [[drafts[w.slot][-1]] for w in active],
                [w.start_pos + substep for w in active],
                active,
                np.arange(len(active)),
            )
        return Proposal(
            drafts,
            extra_rows=extra_rows((len(t) for _, _, t in work), self.k_max),
            forward_seconds=time.perf_counter() - t0,
            draft_probs={slot: np.stack(rows) for slot, rows in dists.items()},
        )

    def after_verify(
        self, plan: StepPlan, hidden: Any, row_starts: np.ndarray, history: TokenHistory
    ) -> Proposal:
        """Run the draft over every prompt chunk of the step, all of its rows: its KV at
        a position reads nothing past it, so the chunk's blocks are complete now."""
        work: list[tuple[SeqWork, int, list[int]]] = []
        for w in plan.seqs:
            if w.speculative and not w.decodes:
                first, tokens = self._catch_up(w, w.start_pos + len(w.token_ids), history)
                if tokens:
                    work.append((w, first, tokens))
        if not work:
            return Proposal({})
        t0 = time.perf_counter()
        self._forward(
            [t for _, _, t in work], [f for _, f, _ in work], [w for w, _, _ in work],
            np.zeros(0, dtype=np.int64),
        )  # fmt: skip
        rows = sum(len(t) for _, _, t in work)
        return Proposal({}, extra_rows=rows, forward_seconds=time.perf_counter() - t0)

    def warmup(self, batch: PackedBatch, hidden: Any) -> None:
        with paddle.no_grad():
            self.model.forward(batch, self.cache, num_layers=self.num_layers)

    def release(self, seq_ids: Iterable[int]) -> None:
        self.catch_up.release(seq_ids)

    def holds(self, seq_id: int) -> bool:
        return self.catch_up.holds(seq_id)
