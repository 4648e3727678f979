"""A runtime's own load (``load(..., serving=True)``) keeps only the fused serving
weights: the same logits as a full load, and a clear error, never freed memory, for
anything that needs the unfused ones."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from spectrio import RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.models import load
from spectrio.models.architecture.batch import PackedBatch
from spectrio.models.architecture.kv_cache import PagedKVCache
from spectrio.models.loading.loader import save_checkpoint
from spectrio.models.ops.paddle_setup import paddle


def _logits(model: object, prompt: list[int]) -> np.ndarray:
    cfg = model.config  # type: ignore[attr-defined]
    cache = PagedKVCache(
        cfg.num_hidden_layers, 8, 16, cfg.num_key_value_heads, cfg.head_dim, "float32"
    )
    batch = PackedBatch.from_sequences([prompt], [0], [np.arange(8)])
    batch.logits_indices = batch.last_rows()
    with paddle.no_grad():
        return model.forward(batch, cache).logits.numpy()  # type: ignore[attr-defined]


def test_serving_load_gives_the_same_logits_and_refuses_what_needs_freed_weights(
    tmp_path: object,
) -> None:
    full, serving = load("bundled"), load("bundled", serving=True)
    assert serving.model.serving_only and not full.model.serving_only
    prompt = [5, 9, 2, 40, 7]
    np.testing.assert_array_equal(_logits(serving.model, prompt), _logits(full.model, prompt))
    q = serving.model.model.layers[0].self_attn.q_proj.weight
    assert not q._is_initialized()  # freed, not merely unused
    ids = paddle.to_tensor([prompt])
    for attempt in (
        lambda: serving.model.forward_dense(ids),
        lambda: serving.model.train(),
        lambda: serving.model.drop_serving_cache(),
        lambda: save_checkpoint(serving.model, tmp_path),
    ):
        with pytest.raises(RuntimeError, match="loaded for serving only"):
            attempt()


async def test_a_runtime_serves_from_its_serving_load() -> None:
    """open_runtime loads for serving; its greedy output equals the full model's."""
    from spectrio.models import reference

    full = load("bundled")
    prompt = [3, 14, 15, 92, 65]
    want = reference.greedy_generate(full.model, prompt, 12).token_ids
    config = RuntimeConfig(model="bundled", speculative=SpeculativeConfig(num_speculative_tokens=2))
    with trio.fail_after(120):
        async with open_runtime(config) as rt:
            assert rt.loaded.model.serving_only
            got: list[int] = []
            async for delta in rt.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True)):
                got += delta.token_ids
    assert got == want
