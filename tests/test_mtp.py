"""The MTP layer in paged mode reproduces its own dense computation over several substeps."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from conftest import tiny_model

from spectrio.models import PackedBatch, PagedKVCache, reference

BLOCK = 4


@pytest.mark.parametrize("num_steps", [1, 3])
def test_paged_mtp_substeps_match_dense_drafts(num_steps: int) -> None:
    model = tiny_model("float64", seed=11)
    cfg = model.config
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 97, size=n).tolist() for n in (9, 14)]
    tables = [np.array([5, 0, 9, 3, 12]), np.array([1, 7, 2, 11, 4, 6])]
    target_cache = PagedKVCache(
        cfg.num_hidden_layers, 16, BLOCK, cfg.num_key_value_heads, cfg.head_dim, "float64"
    )
    mtp_cache = PagedKVCache(1, 16, BLOCK, cfg.num_key_value_heads, cfg.head_dim, "float64")
    with paddle.no_grad():
        out = model.forward(PackedBatch.from_sequences(prompts, [0, 0], tables), target_cache)
        last = out.logits.numpy()[[len(prompts[0]) - 1, -1]]
        g1 = last.argmax(-1).tolist()
        # MTP prefill: entry p pairs h_p with token p+1 (the prompt shifted, then g1).
        shifted = [p[1:] + [g] for p, g in zip(prompts, g1, strict=True)]
        batch = PackedBatch.from_sequences(shifted, [0, 0], tables)
        batch.logits_indices = batch.last_rows()
        step = model.mtp_forward(batch, out.hidden, mtp_cache)
        drafts: list[list[int]] = [[], []]
        positions = [len(p) for p in prompts]
        for _ in range(num_steps):
            tokens = step.logits.numpy().argmax(-1).tolist()
            for i, t in enumerate(tokens):
                drafts[i].append(t)
            prev = paddle.gather(step.hidden, paddle.to_tensor(batch.last_rows()), axis=0)
            batch = PackedBatch.from_sequences([[t] for t in tokens], positions, tables)
            step = model.mtp_forward(batch, prev, mtp_cache)
            positions = [p + 1 for p in positions]
    for prompt, mine, first in zip(prompts, drafts, g1, strict=True):
        target, dense = reference.greedy_mtp_drafts(model, [prompt], num_steps)
        assert mine == dense[0].tolist()
        assert target.shape == (1, num_steps + 1) and target[0, 0] == first


@pytest.mark.parametrize("half", [False, True])
def test_paged_mtp_logits_close_to_dense_in_float32(half: bool) -> None:
    """The paged MTP pass over two chunks gives the dense pass's logits; with the draft
    side's float16 weights (the default), as close as their rounding allows."""
    model = tiny_model("float32", seed=4)
    assert model.draft_half  # drafting reads float16 copies unless told otherwise
    model.set_draft_precision(half)
    cfg = model.config
    ids = np.random.default_rng(9).integers(1, 97, size=13).tolist()
    table = np.array([3, 1, 2, 0])
    with paddle.no_grad():
        _, hidden, _ = model.forward_dense(paddle.to_tensor([ids]))
        dense_logits, dense_hidden, _ = model.mtp_forward_dense(
            paddle.to_tensor([ids[1:]]), hidden[:, :-1]
        )
        cache = PagedKVCache(1, 4, BLOCK, cfg.num_key_value_heads, cfg.head_dim, "float32")
        first = model.mtp_forward(
            PackedBatch.from_sequences([ids[1:7]], [0], [table]), hidden[0, :6], cache
        )
        rest = model.mtp_forward(
            PackedBatch.from_sequences([ids[7:]], [6], [table]), hidden[0, 6:12], cache
        )
    paged = np.concatenate([first.logits.numpy(), rest.logits.numpy()])
    error = np.abs(paged - dense_logits.numpy()[0]).max()
    assert error <= (1e-2 if half else 1e-4)
    if half:
        assert error > 1e-5  # the float16 copies were used


def test_draft_precision_needs_the_weights_it_rebuilds_from() -> None:
    """A serving-only model (the runtime's own load) released the separate projections
    the float32 copies would be rebuilt from: changing the precision is refused, keeping
    it is not."""
    model = tiny_model("float32", seed=4)
    model.prepare_serving(release=True)
    model.set_draft_precision(True)  # unchanged
    with pytest.raises(RuntimeError, match=r"set_draft_precision\(\)"):
        model.set_draft_precision(False)
    assert model.draft_half


def test_mtp_requires_an_mtp_layer() -> None:
    from spectrio.models import ModelConfig, build_model

    cfg = ModelConfig(
        vocab_size=11,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=8,
        num_nextn_predict_layers=0,
    )
    model = build_model(cfg)
    assert model.mtp is None
    with pytest.raises(RuntimeError, match="no MTP layer"):
        model.mtp_forward_dense(paddle.to_tensor([[1]]), paddle.zeros([1, 1, 8]))
