"""The synthetic device (spectrio.models.doubles.synthetic): its spec, its cost, and, through the
real runtime, lossless greedy output at the acceptance rates it was asked for."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import trio

from spectrio import ConfigError, RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.models import PackedBatch, PagedKVCache, load
from spectrio.models.doubles.synthetic import (
    SYNTHETIC_CONFIG,
    SyntheticModel,
    SyntheticSpec,
    draft_tokens,
    parse_spec,
    true_chain,
    true_next,
)
from spectrio.stages.output.output_processor import RequestStats

VOCAB = SYNTHETIC_CONFIG.vocab_size


def test_spec_exact_spelling_and_defaults() -> None:
    assert parse_spec("synthetic:step_ms=10,per_row_us=20,accept=0.8,0.6,0.4") == SyntheticSpec(
        step_ms=10.0, per_row_us=20.0, accept=(0.8, 0.6, 0.4)
    )
    assert parse_spec("synthetic") == SyntheticSpec()
    assert parse_spec("synthetic:") == SyntheticSpec()
    got = parse_spec("synthetic:accept=0.5,seed=3,draft_cost=0")
    assert (got.accept, got.seed, got.draft_cost, got.step_ms) == ((0.5,), 3, 0.0, 10.0)
    assert got.accept_at(0) == got.accept_at(5) == 0.5
    assert parse_spec("synthetic:vocab=4096").config.vocab_size == 4096


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("synthetic:stepms=10", "stepms"),
        ("synthetic:step_ms=fast", "step_ms"),
        ("synthetic:per_row_us=-1", "per_row_us"),
        ("synthetic:step_ms=nan", "step_ms"),
        ("synthetic:accept=0.8,1.2", "accept"),
        ("synthetic:accept=0.8,,0.4", "accept"),
        ("synthetic:step_ms=1,2", "step_ms takes one value"),
        ("synthetic:step_ms=1,step_ms=2", "step_ms"),
        ("synthetic:seed=1.5", "seed"),
        ("synthetic:draft_cost=", "draft_cost"),
        ("synthetic:vocab=2", "vocab"),
        ("synthetic:vocab=5000", "vocab"),
    ],
)
def test_spec_errors_name_the_key(name: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        parse_spec(name)
    with pytest.raises(ConfigError, match=key):
        load(name)


def test_load_gives_a_small_mtp_model_and_the_bundled_tokenizer() -> None:
    loaded = load("synthetic:step_ms=0", dtype="float64")
    assert isinstance(loaded.model, SyntheticModel)
    assert loaded.config is SYNTHETIC_CONFIG and loaded.model.config is SYNTHETIC_CONFIG
    assert loaded.config.has_mtp and loaded.config.vocab_size == 512
    assert loaded.model.dtype == "float64"
    assert loaded.tokenizer is not None
    assert isinstance(loaded.tokenizer.decode(list(range(1, 512))), str)
    with pytest.raises(ConfigError, match="dense"):
        loaded.model.forward_dense(None)  # type: ignore[arg-type]


def test_true_next_is_deterministic_never_eos_and_seeded() -> None:
    x = np.arange(2000) % VOCAB
    p = np.arange(2000)
    a = true_next(0, x, p, VOCAB)
    assert np.array_equal(a, true_next(0, x, p, VOCAB))
    assert a.min() >= 1 and a.max() < VOCAB
    assert len(np.unique(a)) > 400  # spread over the vocabulary
    assert np.mean(a != true_next(1, x, p, VOCAB)) > 0.99


def test_draft_rates_and_wrong_drafts_differ() -> None:
    spec = SyntheticSpec(accept=(0.9, 0.5, 0.1))
    n = 20000
    x, p = np.arange(n) % VOCAB, np.arange(n)
    truth = true_next(0, x, p, VOCAB)
    for depth, rate in enumerate(spec.accept):
        d = draft_tokens(spec, x, p, np.full(n, depth), VOCAB)
        assert abs(np.mean(d == truth) - rate) < 0.015
        assert d.min() >= 1 and d.max() < VOCAB


def _batch(lens: list[int]) -> PackedBatch:
    tables = [np.arange(i * 8, i * 8 + 8) for i in range(len(lens))]
    b = PackedBatch.from_sequences([[7] * n for n in lens], [3] * len(lens), tables)
    b.logits_indices = b.last_rows()
    return b


def test_forward_shapes_logits_and_draft_depths() -> None:
    model = load("synthetic:step_ms=0,per_row_us=0,accept=1").model
    cache = PagedKVCache(1, 64, 16, 1, 8)
    batch = _batch([3, 1, 4])
    out = model.forward(batch, cache)
    assert out.logits.shape == [3, VOCAB] and out.hidden.shape == [8, 8]
    want = true_next(0, np.full(3, 7), batch.positions[batch.last_rows()], VOCAB)
    assert np.array_equal(out.logits.numpy().argmax(-1), want)
    assert float(out.logits.numpy().max(-1).min()) == 20.0
    # A catch-up pass fed target hidden rows drafts position 1; its hidden feeds position 2.
    mtp = model.mtp_forward(batch, out.hidden, cache)
    assert mtp.logits.shape == [3, VOCAB]
    # accept=1: the draft is the true token after the row's token (at position + 1).
    want = true_next(0, np.full(3, 7), batch.positions[batch.last_rows()] + 1, VOCAB)
    assert np.array_equal(mtp.logits.numpy().argmax(-1), want)
    assert np.array_equal(mtp.hidden.numpy()[:, 0], np.ones(8))
    assert np.array_equal(model.mtp_forward(batch, mtp.hidden, cache).hidden.numpy()[:, 0], [2] * 8)
    batch.logits_indices = None
    assert model.forward(batch, cache).logits.shape == [8, VOCAB]


def test_block_tables_are_checked() -> None:
    model = load("synthetic:step_ms=0,per_row_us=0").model
    cache = PagedKVCache(1, 64, 16, 1, 8)
    short = PackedBatch.from_sequences([[1, 2]], [15], [np.asarray([0])])
    with pytest.raises(ValueError, match="cannot hold position 16"):
        model.forward(short, cache)


def test_cost_is_a_plus_b_rows_and_releases_the_gil() -> None:
    model = load("synthetic:step_ms=60,per_row_us=5000,draft_cost=0.5").model
    cache = PagedKVCache(1, 64, 16, 1, 8)
    batch = _batch([3, 1, 4])  # 8 rows: 60 + 40 ms
    t0 = time.perf_counter()
    out = model.forward(batch, cache)
    target = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.mtp_forward(batch, out.hidden, cache)
    draft = time.perf_counter() - t0
    assert 0.099 <= target < 0.100 + 0.05  # the sleeper may end a little early
    assert 0.049 <= draft < 0.050 + 0.05
    # Two threads' forwards overlap: each sleeps without the GIL.
    threads = [threading.Thread(target=model.forward, args=(batch, cache)) for _ in range(2)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.perf_counter() - t0 < 0.180


def _fixed(k: int) -> SpeculativeConfig:
    return SpeculativeConfig(num_speculative_tokens=k, adaptive=False)


@pytest.mark.parametrize("overlap", [False, True])
async def test_greedy_through_the_runtime_is_the_true_chain_at_the_requested_rates(
    overlap: bool,
) -> None:
    accept = (0.8, 0.6, 0.4)
    cfg = RuntimeConfig(
        model="synthetic:step_ms=0.2,per_row_us=0,accept=0.8,0.6,0.4,seed=5",
        max_model_len=256,
        max_num_seqs=64,
        speculative=_fixed(3),
        enable_overlap=overlap,
    )
    rng = np.random.default_rng(0)
    lens = rng.integers(4, 40, 64)
    prompts = [[int(t) for t in rng.integers(1, VOCAB, size=int(n))] for n in lens]
    max_tokens = 160
    total = RequestStats()
    outputs: dict[int, list[int]] = {}
    with trio.fail_after(120):
        async with open_runtime(cfg) as rt:

            async def one(i: int) -> None:
                stats = RequestStats()
                toks: list[int] = []
                params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
                async for delta in rt.generate(prompts[i], params):
                    stats.add(delta)
                    toks += delta.token_ids
                outputs[i] = toks
                total.merge(stats)

            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i)
            await rt.wait_idle()
            stats = rt.stats()
    # The runtime's own counters agree with what the deltas reported.
    assert stats.proposed_per_position == total.proposed
    assert stats.accepted_per_position == total.accepted
    for i, prompt in enumerate(prompts):
        assert outputs[i] == true_chain(prompt, max_tokens, seed=5), f"prompt {i}"
    assert sum(total.proposed) > 3000
    assert min(total.reached) > 500
    got = total.conditional_acceptance
    assert all(abs(g - a) < 0.05 for g, a in zip(got, accept, strict=True)), got
    # Unconditional: position i is accepted when all of 1..i are.
    want = np.cumprod(accept)
    assert all(abs(g - w) < 0.05 for g, w in zip(total.accepted_per_position, want, strict=True))


async def test_text_prompts_with_the_full_vocab() -> None:
    cfg = RuntimeConfig(model="synthetic:step_ms=0.1,per_row_us=0,vocab=4096", max_model_len=128)
    with trio.fail_after(60):
        async with open_runtime(cfg) as rt:
            prompt = rt.tokenizer.encode("def main():")
            assert max(prompt) >= 512  # the bundled tokenizer's ids, not the default vocab's
            text, toks = "", []
            async for delta in rt.generate("def main():", SamplingParams(max_tokens=12)):
                text += delta.text
                toks += delta.token_ids
    assert toks == true_chain(prompt, 12, vocab=4096)
    assert text == rt.tokenizer.decode(toks)


@pytest.mark.parametrize("k", [0, 2])
async def test_seeded_sampling_follows_the_chain_too(k: int) -> None:
    cfg = RuntimeConfig(
        model="synthetic:step_ms=0.1,per_row_us=0",
        max_model_len=128,
        speculative=_fixed(k) if k else SpeculativeConfig(method=None),
    )
    prompt = [11, 12, 13]
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=3)
    with trio.fail_after(60):
        async with open_runtime(cfg) as rt:
            toks: list[int] = []
            async for delta in rt.generate(prompt, params):
                toks += delta.token_ids
    assert toks == true_chain(prompt, 40)
