"""The memory floor (``spectrio.models.ops.memory_floor``): the bytes a target forward reads
are its weights (counted from the configuration, checked here against the checkpoint's
own parameters) and its rows' KV, and the bandwidth probe's kernel reads its buffer
exactly (its sum equals NumPy's)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from spectrio.models import LoadedModel
from spectrio.models.ops.memory_floor import floor_us, forward_bytes, read_bandwidth
from spectrio.models.ops.native_ops import native_ops_available, read_sum
from spectrio.models.ops.paddle_setup import paddle


def _target_parameter_bytes(loaded: LoadedModel) -> int:
    """What the target reads of its own parameters: the decoder (the embedding once, as
    the LM head reads it in full) and an untied LM head; not the MTP layer."""
    model = loaded.model
    count = sum(int(p.numel()) for p in model.model.parameters())
    if model.lm_head is not None:
        count += int(model.lm_head.weight.numel())
    return 4 * count


def test_forward_bytes_are_the_targets_weights_and_its_rows_kv(bundled: LoadedModel) -> None:
    cfg = bundled.config
    weights = forward_bytes(cfg, [])
    assert weights == _target_parameter_bytes(bundled)
    kv_per_position = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    assert forward_bytes(cfg, [64, 10]) == weights + 74 * kv_per_position


def test_biases_and_qk_norms_are_counted() -> None:
    from spectrio.models.architecture.config import ModelConfig

    base = ModelConfig(
        vocab_size=100,
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=16,
    )
    biased = dataclasses.replace(base, attention_bias=True, mlp_bias=True)
    q, kv = 2 * 4, 1 * 4
    per_layer_bias = (q + 2 * kv + 8) + (2 * 16 + 8)
    assert forward_bytes(biased, []) - forward_bytes(base, []) == 4 * 2 * per_layer_bias


@pytest.mark.skipif(not native_ops_available(), reason="the native kernels do not build here")
def test_the_probe_kernel_reads_every_element() -> None:
    rng = np.random.default_rng(0)
    values = rng.standard_normal(1_000_003).astype(np.float32)  # not a multiple of 32
    with paddle.no_grad():
        for threads in (1, 2, 3):
            got = read_sum(paddle.to_tensor(values), threads)
            assert got is not None
            assert got.item() == pytest.approx(float(values.astype(np.float64).sum()), abs=1e-2)
    probe = read_bandwidth(nbytes=32 << 20, passes=2, threads=2)
    assert probe.method == "native" and probe.best_gb_s >= probe.median_gb_s > 0
    assert floor_us(int(probe.best_gb_s * 1e9), probe) == pytest.approx(1e6, rel=1e-9)
