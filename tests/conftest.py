"""Shared fixtures: small random models for exactness tests, the bundled model once per session."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

from spectrio.models import LoadedModel, ModelConfig, SpectrioForCausalLM, build_model, load

# benchmarks/ is not installed: tests of a benchmark import it by its file name, as
# ``python benchmarks/<name>.py`` runs it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

TINY = ModelConfig(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=256,
    eos_token_id=0,
)


def tiny_model(dtype: str = "float32", seed: int = 7, tie: bool = True) -> SpectrioForCausalLM:
    """A random model whose weights are large enough that logits are not near-uniform."""
    cfg = TINY if tie else dataclasses.replace(TINY, tie_word_embeddings=False)
    model = build_model(cfg, dtype, seed=seed)
    rng = np.random.default_rng(seed)
    with paddle.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 2:
                p.set_value(rng.normal(0.0, 0.2, size=p.shape).astype(dtype))
    return model


@pytest.fixture(scope="session")
def bundled() -> LoadedModel:
    return load("bundled")


@pytest.fixture(scope="session")
def bundled64() -> LoadedModel:
    return load("bundled", dtype="float64")


@pytest.fixture(autouse=True)
def _own_timing_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each test starts the adaptive policy cold: its runtimes keep their step times in a
    folder of its own (``timing_cache="auto"`` reads ``$SPECTRIO_CACHE_DIR``), never the
    user's cache or another test's."""
    monkeypatch.setenv("SPECTRIO_CACHE_DIR", str(tmp_path_factory.mktemp("spectrio_cache")))
