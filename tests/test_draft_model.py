"""The draft-model proposer (``SpeculativeConfig(method="draft_model")``): drafts sampled
from a model of its own, verified with their probabilities.

* pure: a draft drawn by :func:`sample_drafts` and verified by the full rule keeps the
  target's distribution (total variation within sampling noise of 0);
* in the real pipeline (float64, bundled model): greedy output equals no speculation,
  with the target's first layer as the draft and with the target itself; with the
  target itself almost every draft is accepted, greedy and at temperature 1 (one-hot
  drafts would be accepted only with p(x) there); seeded output is reproducible; with
  overlap, every block and every state comes back;
* bad configs are refused naming the field.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio

from spectrio import (
    ConfigError,
    RuntimeConfig,
    SamplingParams,
    SpeculativeConfig,
    open_runtime,
)
from spectrio.stages.device.draft.draft_model import sample_drafts
from spectrio.stages.device.rejection import rejection_sample

PROMPTS = [[5, 9, 23, 7, 88, 41, 3], [17, 2, 2, 60, 11], list(range(30, 52))]


def test_sampled_drafts_verified_by_their_probabilities_keep_the_target_distribution() -> None:
    """60,000 requests, one draft each from q, verified against p: the first emitted
    token follows p, though q is far from it and has mass where p has none."""
    p = np.array([0.30, 0.05, 0.25, 0.0, 0.10, 0.20, 0.05, 0.05])
    q = np.array([0.05, 0.30, 0.10, 0.20, 0.05, 0.10, 0.10, 0.10])
    n = 60_000
    keys = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(2654435761)
    positions = np.full(n, 3, dtype=np.int64)
    logits = np.tile(np.log(q), (n, 1))
    drafts, q_rows = sample_drafts(logits, np.ones(n), keys, positions)
    assert np.allclose(q_rows[0], q)
    seen = np.bincount(drafts, minlength=p.size) / n
    assert 0.5 * np.abs(seen - q).sum() < 0.01  # the drafts follow q
    target = np.repeat(np.stack([p, p])[None], n, axis=0).reshape(2 * n, p.size)
    out = rejection_sample(
        drafts.astype(np.int64),
        np.ones(n, dtype=np.int64),
        target,
        np.zeros(n, dtype=bool),
        q_rows,
        keys,
        positions,
    )
    first = np.array([row[0] for row in out])
    emitted = np.bincount(first, minlength=p.size) / n
    assert 0.5 * np.abs(emitted - p).sum() < 0.01
    assert emitted[3] == 0.0  # never a token the target cannot emit


def test_greedy_rows_draft_the_argmax_one_hot() -> None:
    logits = np.array([[0.1, 2.0, -1.0], [3.0, 0.0, 0.5]])
    tokens, probs = sample_drafts(
        logits, np.zeros(2), np.array([1, 2], np.uint64), np.array([0, 0])
    )
    assert tokens.tolist() == [1, 0]
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def config(layers: int | None, *, k: int = 3, overlap: bool = False) -> RuntimeConfig:
    spec = (
        SpeculativeConfig(method=None)
        if k == 0
        else SpeculativeConfig(
            method="draft_model", num_speculative_tokens=k, adaptive=False, draft_layers=layers
        )
    )
    return RuntimeConfig(
        dtype="float64",
        max_model_len=96,
        max_num_seqs=4,
        block_size=4,
        speculative=spec,
        enable_overlap=overlap,
    )


async def run_all(cfg: RuntimeConfig, params: SamplingParams) -> tuple[list[list[int]], float]:
    """Every prompt at once; their tokens and the share of drafts accepted."""
    out: list[list[int]] = [[] for _ in PROMPTS]
    totals = [0, 0]

    async def one(i: int) -> None:
        async for delta in rt.generate(PROMPTS[i], params):
            out[i] += delta.token_ids
            if delta.finished:
                totals[0] += delta.total_drafts or 0
                totals[1] += delta.total_accepted or 0

    async with open_runtime(cfg) as rt:
        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(one, i)
        await rt.wait_idle()
        assert rt.blocks.num_used_blocks == 0
        assert rt.workspace.num_states == 0
        rt.blocks.check_invariants()
    return out, (totals[1] / totals[0] if totals[0] else 0.0)


GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("layers,overlap", [(1, False), (None, False), (1, True)])
async def test_greedy_output_equals_no_speculation(
    bundled64: object, layers: int | None, overlap: bool
) -> None:
    with trio.fail_after(300):
        plain, _ = await run_all(config(None, k=0, overlap=overlap), GREEDY)
        drafted, accepted = await run_all(config(layers, overlap=overlap), GREEDY)
    assert drafted == plain
    if layers is None:  # the target drafting for itself
        assert accepted >= 0.95


async def test_the_target_as_its_own_draft_is_accepted_at_temperature_1(
    bundled64: object,
) -> None:
    """At temperature 1 a one-hot draft x is accepted with p(x); drafts sampled from the
    target's own distribution, verified with it, are accepted with min(1, p/q) = 1."""
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=7)
    with trio.fail_after(300):
        first, accepted = await run_all(config(None), params)
        again, _ = await run_all(config(None), params)
    assert accepted >= 0.95
    assert first == again  # seeded: the drafts' draws are keyed too


async def test_a_weak_draft_keeps_seeded_runs_reproducible(bundled64: object) -> None:
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, seed=3)
    with trio.fail_after(300):
        first, accepted = await run_all(config(1), params)
        again, _ = await run_all(config(1), params)
    assert first == again
    assert 0.0 < accepted < 1.0


def test_bad_draft_configs_are_refused() -> None:
    with pytest.raises(ConfigError, match="draft_layers"):
        SpeculativeConfig(method="draft_model", draft_layers=0)
    with pytest.raises(ConfigError, match="draft_model"):
        SpeculativeConfig(method="mtp", draft_model="bundled")
    with pytest.raises(ConfigError, match="draft_layers"):
        SpeculativeConfig(method="ngram", draft_layers=2)


async def test_the_draft_kv_stays_right_through_preemption_and_the_prefix_cache(
    bundled64: object,
) -> None:
    """The target drafting for itself proposes exactly what verification samples, so any
    draft KV not what a fresh pass writes (a cached block without it, a recompute after
    preemption that skipped it, a stale entry read) shows as a rejected draft. A request
    ending at its first token caches a shared prefix (its prompt's draft KV written in
    its one step); then five requests over it, in 20 blocks of 4, with overlap, hit it
    and preempt one another, and every draft is still accepted."""
    prefix = list(range(300, 330))
    prompts = [prefix + [400 + i, 7 + i] for i in range(6)]
    cfg = RuntimeConfig(
        dtype="float64",
        max_model_len=72,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        block_size=4,
        num_kv_blocks=20,
        enable_overlap=True,
        speculative=SpeculativeConfig(
            method="draft_model", num_speculative_tokens=3, adaptive=False
        ),
    )
    totals = [0, 0]

    async def one(i: int, max_tokens: int) -> None:
        params = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, temperature=float(i % 2), seed=i
        )
        async for delta in rt.generate(prompts[i], params):
            if delta.finished:
                totals[0] += delta.total_drafts or 0
                totals[1] += delta.total_accepted or 0

    with trio.fail_after(300):
        async with open_runtime(cfg) as rt:
            await one(0, 1)
            await rt.wait_idle()
            assert rt.stats().cached_kv_blocks == len(prompts[0]) // 4
            async with trio.open_nursery() as nursery:
                for i in range(1, 6):
                    nursery.start_soon(one, i, 16)
            await rt.wait_idle()
            stats = rt.stats()
            assert rt.blocks.num_used_blocks == 0 and rt.workspace.num_states == 0
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits >= 5 * (len(prefix) // 4 * 4)
    assert totals[0] > 50 and totals[1] == totals[0]
