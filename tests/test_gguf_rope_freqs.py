"""Llama 3.x GGUF files carry their ``llama3`` rope scaling as ``rope_freqs.weight``, one
divisor per RoPE frequency (models/loading/gguf_file.py). Such a file loads with the equivalent
Hugging Face ``rope_scaling`` and computes the logits of the same weights loaded from a
folder whose config.json carries it; divisors no ``llama3`` rule gives are refused,
naming the tensor.

The files are real: a tiny random Llama saved as a Hugging Face folder with
``rope_scaling``, and the same weights written by ``gguf.GGUFWriter`` as llama.cpp's
converter writes them, with the divisors it computes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from test_gguf import write_gguf

from spectrio.errors import CheckpointError
from spectrio.models import ModelConfig, load
from spectrio.models.architecture.config import RopeScaling
from spectrio.models.architecture.model import build_model
from spectrio.models.loading.gguf_file import llama3_scaling, rope_divisors
from spectrio.models.loading.loader import save_checkpoint
from spectrio.models.ops.paddle_setup import paddle

# Llama 3.1's (and 3.2's but for the factor); another set with its own original length
LLAMA31 = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
OTHER = RopeScaling("llama3", 16.0, 0.5, 3.0, 4096)

# head_dim 64 and Llama 3's base: the 32 frequencies span the kept band, the blend and
# the divided band, as Llama 3.1's 64 do
TINY = ModelConfig(
    vocab_size=96,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=64,
    max_position_embeddings=64,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    num_nextn_predict_layers=0,
    eos_token_id=1,  # as test_gguf.write_gguf's metadata says
)
PROMPT = [int(t) for t in np.random.default_rng(0).integers(0, 96, size=60)]


def llama_cpp_divisors(scaling: RopeScaling, head_dim: int, theta: float) -> np.ndarray:
    """``rope_freqs`` as llama.cpp's convert_hf_to_gguf.py computes it for Llama 3.1
    (LlamaModel.generate_extra_tensors), written out independently of spectrio."""
    base = theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    old_context = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    low_wavelen, high_wavelen = old_context / low, old_context / high
    out = []
    for freq in 1.0 / base:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(scaling.factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / scaling.factor + smooth))
    return np.array(out, dtype=np.float32)


def hf_folder(path: Path, scaling: RopeScaling | None) -> Path:
    """The tiny Llama's weights (the same draw every time) under ``scaling``."""
    model = build_model(dataclasses.replace(TINY, rope_scaling=scaling), seed=0)
    save_checkpoint(model, path)
    return path


def logits(path: Path) -> np.ndarray:
    model = load(path, dtype="float64").model
    with paddle.no_grad():
        return np.asarray(model.forward_dense(paddle.to_tensor(np.array([PROMPT])))[0].numpy())


@pytest.mark.parametrize("scaling", [LLAMA31, OTHER], ids=["llama3.1", "other"])
@pytest.mark.parametrize("cache", ["converted once", "read directly"])
def test_rope_freqs_load_as_the_llama3_rope_scaling(
    tmp_path: Path, scaling: RopeScaling, cache: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if cache == "read directly":
        monkeypatch.setenv("SPECTRIO_GGUF_CACHE", "0")
    folder = hf_folder(tmp_path / "hf", scaling)
    divisors = llama_cpp_divisors(scaling, TINY.head_dim, TINY.rope_theta)
    assert 1.0 == divisors.min() < divisors.max() == scaling.factor
    assert ((divisors > 1) & (divisors < scaling.factor)).sum() >= 2  # a blend to fit
    path = tmp_path / "tiny.gguf"
    original = scaling.original_max_position_embeddings
    write_gguf(
        path,
        folder=folder,
        rope_freqs=divisors,
        original_context=None if original == 8192 else original,  # 8192 when unstated
    )
    loaded = load(path, dtype="float64")
    assert loaded.config.rope_scaling == scaling  # recovered as config.json states it
    assert loaded.config == load(folder, dtype="float64").config
    want = logits(folder)
    np.testing.assert_array_equal(logits(path), want)
    unscaled = logits(hf_folder(tmp_path / "unscaled", None))
    assert not np.allclose(unscaled, want)  # the scaling moves these logits


def test_all_ones_is_no_scaling(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path / "hf", None)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, folder=folder, rope_freqs=np.ones(TINY.head_dim // 2))
    assert load(path).config.rope_scaling is None
    np.testing.assert_array_equal(logits(path), logits(folder))


def _bad(n: int) -> dict[str, np.ndarray]:
    good = llama_cpp_divisors(LLAMA31, TINY.head_dim, TINY.rope_theta)
    bumped = good.copy()
    bumped[np.argmax((good > 1) & (good < 8))] *= 1.01  # one blend value off the line
    return {
        "length": good[:n],
        "nonpositive": np.where(good == 1.0, 0.0, good),
        "not llama3": good[::-1].copy(),  # long wavelengths kept, short ones divided
        "off the rule": bumped,
        "linear": np.full(n, 4.0) + np.linspace(0, 1, n),
    }


@pytest.mark.parametrize(
    "kind,why",
    [
        ("length", "has 31 values, but RoPE over heads of 64 has 32 frequencies"),
        ("nonpositive", "not a positive number"),
        ("not llama3", "not those of a Llama 3 'llama3' rope scaling"),
        ("off the rule", "not those of a Llama 3 'llama3' rope scaling"),
        ("linear", "not those of a Llama 3 'llama3' rope scaling"),
    ],
)
def test_malformed_rope_freqs_are_refused_naming_the_tensor(
    tmp_path: Path, kind: str, why: str
) -> None:
    folder = hf_folder(tmp_path / "hf", None)
    path = tmp_path / "bad.gguf"
    n = TINY.head_dim // 2
    write_gguf(path, folder=folder, rope_freqs=_bad(n - 1 if kind == "length" else n)[kind])
    with pytest.raises(CheckpointError, match=rf"tensor 'rope_freqs.weight'.*: .*{why}"):
        load(path)


@pytest.mark.parametrize("head_dim,theta", [(8, 10000.0), (32, 500000.0), (128, 500000.0)])
def test_few_frequencies_give_an_equivalent_scaling(head_dim: int, theta: float) -> None:
    """With one blended frequency or none, factor/low/high are not all determined: any
    rule giving the same divisors will do (Llama 3.1's own 64 frequencies pin them)."""
    cfg = dataclasses.replace(TINY, hidden_size=2 * head_dim, head_dim=head_dim, rope_theta=theta)
    divisors = llama_cpp_divisors(LLAMA31, head_dim, theta)
    scaling = llama3_scaling(divisors, cfg)
    assert scaling is not None and scaling.original_max_position_embeddings == 8192
    got = rope_divisors(dataclasses.replace(cfg, rope_scaling=scaling))
    np.testing.assert_allclose(got, divisors, rtol=1e-5)
    if head_dim == 128:
        assert scaling == LLAMA31
