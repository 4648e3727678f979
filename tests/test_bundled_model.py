"""The bundled checkpoint: size, loading, and a recorded greedy continuation."""

from __future__ import annotations

import json

from regen_golden import GOLDEN_PATH

from spectrio.models import BUNDLED_DIR, LoadedModel, reference

# Written by `python tests/regen_golden.py` from the shipped checkpoint (float64 reference).
_GOLDEN = json.loads(GOLDEN_PATH.read_text())
PROMPT: str = _GOLDEN["prompt"]
GOLDEN: list[int] = _GOLDEN["token_ids"]


def test_bundled_files_fit_the_budget() -> None:
    files = ["config.json", "tokenizer.json", "model.safetensors"]
    total = sum((BUNDLED_DIR / f).stat().st_size for f in files)
    assert total <= 16 * 1024 * 1024, total
    cfg = json.loads((BUNDLED_DIR / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1


def test_bundled_loads_with_tokenizer_and_mtp(bundled: LoadedModel) -> None:
    assert bundled.tokenizer is not None and bundled.model.mtp is not None
    assert bundled.tokenizer.vocab_size == bundled.config.vocab_size
    assert bundled.config.eos_token_id == bundled.tokenizer.encode("<|endoftext|>")[0]


def test_greedy_continuation_is_the_recorded_golden(bundled64: LoadedModel) -> None:
    tok = bundled64.tokenizer
    assert tok is not None
    out = reference.greedy_generate(bundled64.model, tok.encode(PROMPT), len(GOLDEN))
    assert out.token_ids == GOLDEN


def test_float32_agrees_with_the_golden_prefix(bundled: LoadedModel) -> None:
    tok = bundled.tokenizer
    assert tok is not None
    out = reference.greedy_generate(bundled.model, tok.encode(PROMPT), 16)
    assert out.token_ids == GOLDEN[:16]
