"""GGUF files with a SentencePiece vocabulary (``tokenizer.ggml.model == "llama"``: Llama 2,
Mistral, TinyLlama, ERNIE 4.5): the tokenizer rebuilt from the pieces, scores and types
encodes as sentencepiece itself does, and the model runs with it.

The vocabulary is a tiny SentencePiece BPE model trained by ``tests/spm_golden.py`` in a
scratch environment (sentencepiece is not a dependency); ``tests/data/spm_golden.json``
holds its pieces, scores and types as llama.cpp's converter stores them, and
sentencepiece's own ids and decoded text for each test string. The weights are the tiny
Llama of ``tests/data/archs/llama`` with its embedding grown to that vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from safetensors.numpy import load_file, save_file
from test_gguf import ARCHS, write_gguf

from spectrio import RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.errors import CheckpointError
from spectrio.models import LoadedModel, load, reference
from spectrio.models.loading.convert import convert_gguf
from spectrio.models.loading.gguf_file import GGUFFile
from spectrio.models.loading.gguf_vocab import spm_merges
from spectrio.models.loading.loader import load_tokenizer
from spectrio.models.text.chat import ChatTemplate
from spectrio.models.text.tokenizer import TextTokenizer

GOLDEN = json.loads((Path(__file__).resolve().parent / "data" / "spm_golden.json").read_text())
CASES = [(case["text"], case["ids"], case["decoded"]) for case in GOLDEN["cases"]]
UNK = GOLDEN["unknown_token_id"]


def spm_folder(tmp: Path) -> Path:
    """The tiny Llama, its (tied) embedding grown to the SentencePiece vocabulary with
    fixed random rows."""
    folder = tmp / "llama_spm"
    folder.mkdir(exist_ok=True)
    cfg = json.loads((ARCHS / "llama" / "config.json").read_text())
    tensors = load_file(str(ARCHS / "llama" / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    extra = len(GOLDEN["tokens"]) - embed.shape[0]
    rows = np.random.default_rng(7).normal(0.0, float(embed.std()), (extra, embed.shape[1]))
    tensors["model.embed_tokens.weight"] = np.concatenate([embed, rows.astype(embed.dtype)])
    cfg["vocab_size"] = len(GOLDEN["tokens"])
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def write_spm_gguf(path: Path, **changes: Any) -> None:
    """A tiny Llama GGUF with the golden SentencePiece vocabulary; ``changes`` replace
    (or, given None, drop) its metadata keys."""
    spm = {k: v for k, v in GOLDEN.items() if k != "cases"}
    for key, value in changes.items():
        if value is None:
            spm.pop(key)
        else:
            spm[key] = value
    write_gguf(path, folder=spm_folder(path.parent), tokenizer_model="llama", spm=spm)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = tmp_path_factory.mktemp("spm") / "tiny-spm.gguf"
    write_spm_gguf(path)
    return load(path, dtype="float64")


@pytest.fixture(scope="module")
def tok(loaded: LoadedModel) -> TextTokenizer:
    assert loaded.tokenizer is not None
    return loaded.tokenizer


@pytest.mark.parametrize("text,ids,decoded", CASES, ids=[repr(c[0])[:40] for c in CASES])
def test_encode_is_sentencepiece(
    tok: TextTokenizer, text: str, ids: list[int], decoded: str
) -> None:
    """Ids equal sentencepiece's own (special tokens cut out whole, as llama.cpp does)."""
    assert tok.encode(text) == ids
    assert tok.encode_releasing_gil(text) == ids


@pytest.mark.parametrize("text,ids,decoded", CASES, ids=[repr(c[0])[:40] for c in CASES])
def test_decode_is_sentencepiece(
    tok: TextTokenizer, text: str, ids: list[int], decoded: str
) -> None:
    """Decoding gives sentencepiece's text (spaces and bytes restored, the prefix space
    dropped, control tokens left out), which is the text itself where it holds no
    special token; the incremental detokenizer streams the same text."""
    if UNK in ids:  # sentencepiece writes the unknown token as " ⁇ "; it is special here
        decoded = decoded.replace(" \u2047 ", "")
    assert tok.decode(ids) == decoded
    if not any(GOLDEN["token_types"][i] != 1 and GOLDEN["token_types"][i] != 6 for i in ids):
        assert decoded == text
    stream = tok.stream()
    assert "".join(stream.push([i]) for i in ids) + stream.flush() == decoded


def test_special_tokens_and_config(loaded: LoadedModel, tok: TextTokenizer) -> None:
    pieces = GOLDEN["tokens"]
    assert tok.eos_token_id == GOLDEN["eos_token_id"] == loaded.config.eos_token_id
    assert loaded.config.bos_token_id == GOLDEN["bos_token_id"]
    added = {t.content: t.special for t in tok.raw.get_added_tokens_decoder().values()}
    assert added == {"<unk>": True, "<s>": True, "</s>": True, "<|im_end|>": True, "<|sep|>": False}
    assert tok.raw.get_vocab_size(with_added_tokens=True) == len(pieces)
    # add_bos_token: a text prompt gets BOS (encode_prompt); a rendered chat template,
    # which writes its own, does not (encode).
    raw = tok.raw.encode("a", add_special_tokens=True).ids
    assert raw == tok.encode_prompt("a") == [GOLDEN["bos_token_id"], *tok.encode("a")]
    assert tok.encode_prompt_releasing_gil("a") == tok.encode_prompt("a")


def test_merges_follow_the_scores() -> None:
    """A merge exists where both halves and the join are normal pieces, best score first;
    byte, control and user-defined tokens never join."""
    tokens = ["<unk>", "<s>", "<0x61>", "a", "b", "c", "ab", "abc", "bc", "<s>a"]
    types = [2, 3, 6, 1, 1, 1, 1, 1, 1, 1]
    scores = [0.0, 0.0, 0.0, -9.0, -9.0, -9.0, -1.0, -3.0, -2.0, 0.0]
    merges = spm_merges(tokens, scores, types)
    assert merges == [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]


def test_the_model_runs_with_it(loaded: LoadedModel, tok: TextTokenizer) -> None:
    """Greedy tokens through the loaded model, decoded back to text."""
    prompt = [GOLDEN["bos_token_id"], *tok.encode("The quick brown fox")]
    out = reference.greedy_generate(loaded.model, prompt, 6)
    assert len(out.token_ids) == 6
    assert all(0 <= t < len(GOLDEN["tokens"]) for t in out.token_ids)
    assert isinstance(tok.decode(out.token_ids), str)


def _small_runtime(path: Path, dtype: str = "float32") -> RuntimeConfig:
    return RuntimeConfig(
        model=str(path),
        dtype=dtype,
        max_model_len=64,
        max_num_seqs=2,
        max_num_batched_tokens=128,
        speculative=SpeculativeConfig(method=None),
    )


async def test_the_runtime_generates_text_with_it(tmp_path: Path) -> None:
    """A text prompt through the runtime: encoded, run, and streamed back as text that
    equals the decoded output ids."""
    path = tmp_path / "tiny-spm.gguf"
    write_spm_gguf(path)
    cfg = _small_runtime(path)
    with trio.fail_after(120):
        async with open_runtime(cfg) as rt:
            # (a prompt whose greedy output's byte tokens form valid UTF-8: Hugging Face's
            # byte fallback turns a whole run of byte tokens into U+FFFD once any of them
            # is invalid, which a stream cannot know before the run ends)
            deltas = [d async for d in rt.generate("café", SamplingParams(max_tokens=8))]
    ids = [t for d in deltas for t in d.token_ids]
    assert len(ids) == 8
    tok = load_tokenizer(path)
    assert tok is not None
    assert "".join(d.text for d in deltas) == tok.decode(ids)


async def test_a_text_prompt_starts_with_bos(tmp_path: Path) -> None:
    """The runtime runs a text prompt as the tokenizer would: BOS first (add_bos_token),
    as llama.cpp and Hugging Face do; the greedy output equals the reference generator's
    on [BOS, *text] and not on the text alone (float64: the same products either way)."""
    path = tmp_path / "tiny-spm.gguf"
    write_spm_gguf(path)
    text = "The quick brown fox"
    cfg = _small_runtime(path, dtype="float64")
    with trio.fail_after(120):
        async with open_runtime(cfg) as rt:
            params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            got = [t async for d in rt.generate(text, params) for t in d.token_ids]
    model = load(str(path), dtype="float64").model
    tok = load_tokenizer(path)
    assert tok is not None
    with_bos = reference.greedy_generate(model, [GOLDEN["bos_token_id"], *tok.encode(text)], 12)
    without = reference.greedy_generate(model, tok.encode(text), 12)
    assert got == list(with_bos.token_ids)
    assert list(with_bos.token_ids) != list(without.token_ids)  # the check can fail


def test_chat_stops_past_a_sentencepiece_space(tok: TextTokenizer) -> None:
    """The end-of-turn token after a space (a lone "▁" token) is still found."""
    template = "{% for m in messages %}{{ m['content'] }} <|im_end|>{% endfor %}"
    chat = ChatTemplate(template, tok, {})
    assert chat.stop_token_ids() == [GOLDEN["tokens"].index("<|im_end|>"), GOLDEN["eos_token_id"]]


def test_convert_writes_the_same_tokenizer(tmp_path: Path) -> None:
    """``spectrio convert``'s folder: the same ids, and the special tokens and BOS flag
    in tokenizer_config.json."""
    path = tmp_path / "tiny-spm.gguf"
    write_spm_gguf(path)
    out = convert_gguf(path, tmp_path / "hf")
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["unk_token"]) == (
        "<s>", "</s>", "<unk>"
    )  # fmt: skip
    assert tok_cfg["add_bos_token"] is True and tok_cfg["add_eos_token"] is False
    tok = load_tokenizer(out)
    assert tok is not None
    for text, ids, _ in CASES:
        assert tok.encode(text) == ids, text


def test_no_space_prefix(tmp_path: Path) -> None:
    """``add_space_prefix = false``: no "▁" is prepended, and none is stripped back."""
    path = tmp_path / "noprefix.gguf"
    write_spm_gguf(path, add_space_prefix=False)
    raw = GGUFFile(path).tokenizer_json()
    assert raw is not None
    from tokenizers import Tokenizer

    tok = TextTokenizer(Tokenizer.from_str(raw), None)
    pieces = GOLDEN["tokens"]
    ids = tok.encode("a the")
    assert [pieces[i] for i in ids] == ["a", "\u2581the"]
    assert tok.decode(ids) == "a the"


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"scores": None}, "tokenizer.ggml.model 'llama' .*needs tokenizer.ggml.scores"),
        ({"scores": [0.0] * 3}, "tokenizer.ggml.scores has 3 entries for 512 tokens"),
    ],
)
def test_refusals_name_the_field(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    path = tmp_path / "bad.gguf"
    write_spm_gguf(path, **changes)
    with pytest.raises(CheckpointError, match=message):
        load(path)


def test_another_tokenizer_model_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t5.gguf"
    spm = {k: v for k, v in GOLDEN.items() if k != "cases"}
    write_gguf(path, folder=spm_folder(tmp_path), tokenizer_model="t5", spm=spm)
    with pytest.raises(CheckpointError, match="tokenizer.ggml.model 't5' is not supported"):
        load(path)
