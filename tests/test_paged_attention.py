"""The paged forward pass equals the dense one for prefill, decode and verify rows."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from conftest import tiny_model

from spectrio.models import PackedBatch, PagedKVCache, SpectrioForCausalLM

BLOCK = 4


def _cache(model: SpectrioForCausalLM, num_blocks: int = 64) -> PagedKVCache:
    cfg = model.config
    return PagedKVCache(
        cfg.num_hidden_layers, num_blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim, model.dtype
    )


def _dense(model: SpectrioForCausalLM, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    with paddle.no_grad():
        logits, hidden, _ = model.forward_dense(paddle.to_tensor(np.asarray([ids], dtype=np.int64)))
    return logits.numpy()[0], hidden.numpy()[0]


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("float64", 1e-10)])
def test_mixed_batch_matches_dense(dtype: str, tol: float) -> None:
    model = tiny_model(dtype)
    rng = np.random.default_rng(0)
    seqs = {
        name: rng.integers(1, 97, size=n).tolist() for name, n in [("a", 21), ("b", 10), ("c", 17)]
    }
    # Scattered, non-contiguous blocks so every lookup goes through the table.
    tables = {"a": [40, 3, 17, 9, 22, 5], "b": [11, 30, 2], "c": [8, 61, 14, 27, 33]}
    cache = _cache(model)
    with paddle.no_grad():
        # Earlier steps: b's first 9 tokens and c's first 13, in two chunks for c.
        model.forward(
            PackedBatch.from_sequences(
                [seqs["b"][:9], seqs["c"][:6]],
                [0, 0],
                [np.array(tables["b"]), np.array(tables["c"])],
            ),
            cache,
        )
        model.forward(
            PackedBatch.from_sequences([seqs["c"][6:13]], [6], [np.array(tables["c"])]), cache
        )
        # This step: a prefills 21 positions, b decodes 1, c verifies 4 across a block boundary.
        batch = PackedBatch.from_sequences(
            [seqs["a"], seqs["b"][9:], seqs["c"][13:]],
            [0, 9, 13],
            [np.array(tables[k]) for k in "abc"],
        )
        out = model.forward(batch, cache)
    logits, hidden = out.logits.numpy(), out.hidden.numpy()
    rows = {"a": slice(0, 21), "b": slice(21, 22), "c": slice(22, 26)}
    tails = {"a": slice(0, 21), "b": slice(9, 10), "c": slice(13, 17)}
    for name in "abc":
        dl, dh = _dense(model, seqs[name])
        assert np.abs(logits[rows[name]] - dl[tails[name]]).max() <= tol
        assert np.abs(hidden[rows[name]] - dh[tails[name]]).max() <= tol


def test_verify_rows_equal_one_token_at_a_time_in_float64() -> None:
    """A (k+1)-row verify pass gives exactly the argmaxes of a token-by-token decode."""
    model = tiny_model("float64", seed=3)
    rng = np.random.default_rng(5)
    prompt = rng.integers(1, 97, size=11).tolist()
    proposal = rng.integers(1, 97, size=4).tolist()  # last accepted token + 3 drafts
    table = np.array([7, 1, 12, 4, 9])
    with paddle.no_grad():
        batched_cache = _cache(model)
        model.forward(PackedBatch.from_sequences([prompt], [0], [table]), batched_cache)
        verify = model.forward(PackedBatch.from_sequences([proposal], [11], [table]), batched_cache)
        step_cache = _cache(model)
        model.forward(PackedBatch.from_sequences([prompt], [0], [table]), step_cache)
        single = [
            model.forward(PackedBatch.from_sequences([[tok]], [11 + i], [table]), step_cache).logits
            for i, tok in enumerate(proposal)
        ]
    one_by_one = np.concatenate([s.numpy() for s in single])
    assert np.array_equal(verify.logits.numpy().argmax(-1), one_by_one.argmax(-1))
    assert np.abs(verify.logits.numpy() - one_by_one).max() < 1e-10


def test_a_single_sequences_rows_attend_alike_in_both_layouts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One sequence's few rows (batch-1 verification) broadcast K/V over the rows; the
    transposed layout that every other batch uses gives the same logits."""
    from spectrio.models.architecture import batch as batch_module

    model = tiny_model("float64", seed=6)
    rng = np.random.default_rng(2)
    prompt = rng.integers(1, 97, size=13).tolist()
    table = np.array([4, 11, 2, 8, 6, 9])

    def verify(rows: list[int]) -> tuple[bool, np.ndarray]:
        cache = _cache(model)
        with paddle.no_grad():
            model.forward(PackedBatch.from_sequences([prompt], [0], [table]), cache)
            step = PackedBatch.from_sequences([rows], [13], [table])
            plan = batch_module.AttentionPlan.build(step, cache, "float64")
            return plan.broadcast_kv, model.forward(step, cache).logits.numpy()

    for n in (2, 4, batch_module.BROADCAST_KV_MAX_Q):
        rows = rng.integers(1, 97, size=n).tolist()
        used, broadcast = verify(rows)
        with monkeypatch.context() as m:
            m.setattr(batch_module, "BROADCAST_KV_MAX_Q", 0)
            unused, transposed = verify(rows)
        assert used and not unused
        assert np.abs(broadcast - transposed).max() < 1e-12


def test_short_rows_are_not_padded_to_a_prefill_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step mixing a prefill chunk with decode and verify rows attends in two groups, each
    padded to its own length; the logits equal the single padded group's, whatever order
    the sequences come in."""
    from spectrio.models.architecture import batch as batch_module

    model = tiny_model("float64", seed=8)
    rng = np.random.default_rng(4)
    prior = [rng.integers(1, 97, size=n).tolist() for n in (6, 0, 9, 5)]
    new = [rng.integers(1, 97, size=n).tolist() for n in (3, 14, 1, 3)]  # seq 1: a prefill
    tables = [np.array([2, 9, 5, 14]), np.array([7, 1, 12, 4]), np.array([3, 8, 0]), [6, 11]]

    def step() -> tuple[batch_module.AttentionPlan, np.ndarray]:
        cache = _cache(model)
        with paddle.no_grad():
            warm = [(p, t) for p, t in zip(prior, tables, strict=True) if p]
            model.forward(
                PackedBatch.from_sequences(
                    [p for p, _ in warm], [0] * len(warm), [t for _, t in warm]
                ),
                cache,
            )
            batch = PackedBatch.from_sequences(new, [len(p) for p in prior], tables)
            plan = batch_module.AttentionPlan.build(batch, cache, "float64")
            return plan, model.forward(batch, cache).logits.numpy()

    plan, split = step()
    assert plan.groups is not None and plan.order is not None
    assert [(g.num_seqs, g.max_q) for g in plan.groups] == [(3, 3), (1, 14)]
    with monkeypatch.context() as m:
        m.setattr(batch_module, "SHORT_Q", 0)
        plan, padded = step()
    assert plan.groups is None
    assert np.abs(split - padded).max() < 1e-12


def test_logits_indices_select_rows() -> None:
    # float64 and a tolerance: a GEMM may round differently for 2 rows than for 6 (MKL's
    # AVX2 path does, in float32), and the selection is what is under test
    model = tiny_model("float64")
    ids = [[5, 6, 7, 8], [9, 10]]
    tables = [np.array([0, 1]), np.array([2])]
    with paddle.no_grad():
        full = model.forward(PackedBatch.from_sequences(ids, [0, 0], tables), _cache(model))
        batch = PackedBatch.from_sequences(ids, [0, 0], tables)
        batch.logits_indices = batch.last_rows()
        last = model.forward(batch, _cache(model))
    assert last.logits.shape == [2, 97]
    np.testing.assert_allclose(last.logits.numpy(), full.logits.numpy()[[3, 5]], rtol=1e-12)
    assert last.hidden.shape == [6, 32]


def test_packed_batch_rejects_bad_layouts() -> None:
    with pytest.raises(ValueError, match="consecutive"):
        PackedBatch(np.array([1, 2]), np.array([0, 2]), np.array([0, 2]), [np.array([0])])
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        PackedBatch(np.array([1, 2]), np.array([0, 1]), np.array([0, 3]), [np.array([0])])
    with pytest.raises(ValueError, match="block tables"):
        PackedBatch(np.array([1, 2]), np.array([0, 1]), np.array([0, 2]), [])
    model = tiny_model()
    short = PackedBatch.from_sequences([[1] * 9], [0], [np.array([0, 1])])
    with pytest.raises(ValueError, match="cannot hold position 8"):
        model.forward(short, _cache(model))


def test_fused_serving_weights_follow_training_updates() -> None:
    """The paged pass runs on fused copies of the weights; training mode drops them, so
    an update made while training is what the next serving pass computes with."""
    model = tiny_model("float64")
    ids = [5, 9, 14, 3, 7]
    table = np.array([0, 1])

    def paged_last_logits() -> np.ndarray:
        batch = PackedBatch.from_sequences([ids], [0], [table])
        with paddle.no_grad():
            return model.forward(batch, _cache(model)).logits.numpy()[-1]

    before = paged_last_logits()
    model.train()
    with paddle.no_grad():
        for layer in model.model.layers:
            w = layer.self_attn.v_proj.weight
            w.set_value(w * 1.5)
            g = layer.post_attention_layernorm.weight
            g.set_value(g * 0.5)
    model.eval()
    after = paged_last_logits()
    assert np.abs(after - before).max() > 1e-3
    assert np.abs(after - _dense(model, ids)[0][-1]).max() <= 1e-10


def test_attention_plan_pads_only_mixed_batches() -> None:
    """Equal query lengths (decode, verify) need no padding gathers; mixed ones do, and
    every padded row is masked to one visible key so its softmax stays finite."""
    from spectrio.models.architecture.batch import AttentionPlan

    tables = [np.array([3, 4]), np.array([7, 1])]
    cache = PagedKVCache(1, 8, BLOCK, 2, 4, "float64")  # 2 KV heads, 8 blocks of 4 slots
    even = PackedBatch.from_sequences([[1, 2], [3, 4]], [5, 2], tables)
    plan = AttentionPlan.build(even, cache, "float64")
    assert plan.pad_rows is None and plan.unpad_rows is None
    assert (plan.max_q, plan.max_ctx) == (2, 8)  # context padded to whole blocks
    # Head-major pools: head h's copy of slot s is row h * 32 + s; block b of head h is
    # block row h * 8 + b, read sequence by sequence, then head by head.
    assert plan.write_rows.numpy().tolist() == [17, 49, 18, 50, 30, 62, 31, 63]
    assert plan.context_blocks.numpy().tolist() == [3, 4, 11, 12, 7, 1, 15, 9]
    mixed = PackedBatch.from_sequences([[1, 2, 3], [4]], [0, 6], tables)
    plan = AttentionPlan.build(mixed, cache, "float64")
    assert plan.pad_rows is not None and plan.unpad_rows is not None
    assert plan.unpad_rows.numpy().tolist() == [0, 1, 2, 3]
    visible = np.isfinite(plan.mask)  # [B, 1, max_q, max_ctx]
    assert visible[1, 0, 1:].sum(axis=-1).tolist() == [1, 1]  # padded rows of sequence 1
    assert visible[0, 0].sum(axis=-1).tolist() == [1, 2, 3]
    assert visible[1, 0, 0].sum() == 7


def test_decode_rows_of_different_context_lengths_match_dense() -> None:
    """One row per sequence (plain decode, the packed layout needs no padding) with
    contexts of different lengths in one step."""
    model = tiny_model("float64", seed=4)
    rng = np.random.default_rng(9)
    seqs = [rng.integers(1, 97, size=n).tolist() for n in (3, 11, 6)]
    tables = [np.array([5, 9, 1]), np.array([2, 7, 12, 0]), np.array([3, 4])]
    cache = _cache(model)
    with paddle.no_grad():
        model.forward(PackedBatch.from_sequences([s[:-1] for s in seqs], [0, 0, 0], tables), cache)
        step = PackedBatch.from_sequences(
            [s[-1:] for s in seqs], [len(s) - 1 for s in seqs], tables
        )
        logits = model.forward(step, cache).logits.numpy()
    for i, s in enumerate(seqs):
        assert np.abs(logits[i] - _dense(model, s)[0][-1]).max() <= 1e-10


def test_cache_gather_reads_what_write_stored_through_the_blocked_view() -> None:
    """The pools are written flat and read through a reshaped (shared-storage) view."""
    cache = PagedKVCache(2, 4, 2, 2, 3, "float64")  # 4 blocks of 2 slots, 2 heads, D = 3
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((2, 2, 3)), rng.standard_normal((2, 2, 3))
    slots = np.array([5, 2])  # block 2 offset 1, block 1 offset 0
    rows = paddle.to_tensor(cache.write_rows(slots))
    cache.write(1, rows, paddle.to_tensor(k), paddle.to_tensor(v))
    # Two sequences: the first reads blocks 2 then 1, the second blocks 3 and 0 (empty).
    table = paddle.to_tensor(cache.block_rows(np.array([[2, 1], [3, 0]])))
    kc, vc = (t.numpy() for t in cache.gather(1, table, 2))  # [2 seqs, heads, 4 positions, D]
    assert kc.shape == (2, 2, 4, 3)
    for h in range(2):
        np.testing.assert_array_equal(kc[0, h, [1, 2]], k[:, h])
        np.testing.assert_array_equal(vc[0, h, [1, 2]], v[:, h])
    assert not kc[0, :, [0, 3]].any() and not kc[1].any() and not vc[1].any()
    assert not any(t.numpy().any() for t in cache.gather(0, table, 2))  # layer 0 untouched
