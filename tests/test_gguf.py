"""GGUF files: weights in every type ``gguf`` writes (dequantized at load, llama.cpp's q/k
permutation undone), the vocabulary rebuilt from metadata, ``spectrio convert``, and a
named refusal for each way a file can be wrong.

The files are written here with ``gguf.GGUFWriter`` from the tiny Llama of
``tests/data/archs/llama`` (transformers' goldens exist for it), laid out as llama.cpp's
converter lays a Llama out: q/k rows permuted for its interleaved RoPE, names like
``blk.0.attn_q.weight``.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file

from spectrio.errors import CheckpointError
from spectrio.models import load, reference
from spectrio.models.loading.checkpoint import half_to_interleaved
from spectrio.models.loading.convert import convert_gguf
from spectrio.models.loading.gguf_file import GGUFFile

ARCHS = Path(__file__).resolve().parent / "data" / "archs"
GOLDEN = json.loads((ARCHS / "golden.json").read_text())


_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}

# A byte-level BPE small enough to read: every byte-level character of "hello world",
# some merges, and two control tokens.
TOKENS = ["<|endoftext|>", "<|im_end|>", "h", "e", "l", "o", "Ġ", "w", "r", "d",
          "he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "Ġworld", "ld"]  # fmt: skip
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_TO_GGUF[rest]}"


def write_spm_vocab(w: gguf.GGUFWriter, spm: dict[str, Any]) -> None:
    """A SentencePiece vocabulary's metadata, as llama.cpp's converter writes it: the
    pieces, their scores and types, the special token ids and the flags (keys missing
    from ``spm`` are not written)."""
    w.add_token_list(spm["tokens"])
    if "scores" in spm:
        w.add_token_scores(spm["scores"])
    w.add_token_types(spm["token_types"])
    for key, add in (
        ("unknown_token_id", w.add_unk_token_id),
        ("bos_token_id", w.add_bos_token_id),
        ("eos_token_id", w.add_eos_token_id),
        ("add_bos_token", w.add_add_bos_token),
        ("add_eos_token", w.add_add_eos_token),
        ("add_space_prefix", w.add_add_space_prefix),
    ):
        if key in spm:
            add(spm[key])


def stored(arr: np.ndarray, qtype: Q) -> np.ndarray:
    """What a weight becomes through a file of ``qtype``: quantized, then dequantized."""
    if qtype == Q.F32:
        return arr.astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(arr.astype(np.float32), qtype), qtype)


def write_gguf(
    path: Path,
    case: str = "llama",
    qtype: Q = Q.F32,
    *,
    drop: str | None = None,
    extra_tensor: str | None = None,
    tokens: list[str] | None = None,
    tokenizer_model: str = "gpt2",
    pre: str = "smollm",
    arch: str = "llama",
    folder: Path | None = None,
    rope_freqs: np.ndarray | None = None,
    original_context: int | None = None,
    spm: dict[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """Write the tiny ``case`` checkpoint (or the Hugging Face ``folder``) as llama.cpp
    would, with ``rope_freqs.weight`` and ``rope.scaling.original_context_length`` when
    given; return the Hugging Face tensors spectrio should load from it (quantization
    applied, q/k in HF order). ``spm``: a SentencePiece vocabulary instead of the
    byte-level one (``tests/data/spm_golden.json``'s keys; those it lacks are left out of
    the file)."""
    folder = ARCHS / case if folder is None else folder
    cfg = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(hd)
    if original_context is not None:
        w.add_rope_scaling_orig_ctx_len(original_context)
    w.add_tokenizer_model(tokenizer_model)
    if spm is not None:
        write_spm_vocab(w, spm)
    else:
        w.add_tokenizer_pre(pre)
        rows = cfg["vocab_size"]
        vocab = TOKENS + [f"[unused{i}]" for i in range(rows - 19)]
        vocab = tokens if tokens is not None else vocab
        w.add_token_list(vocab)
        w.add_token_types([3 if t.startswith("<|") else 1 for t in vocab])
        w.add_token_merges(MERGES)
        w.add_eos_token_id(1)
    w.add_chat_template("{{ messages[0]['content'] }}<|im_end|>")
    want: dict[str, np.ndarray] = {}
    for hf, arr in sorted(tensors.items()):
        if hf == drop:
            continue
        q = qtype if arr.ndim == 2 else Q.F32
        value = stored(arr, q)
        want[hf] = value
        if hf.endswith(("q_proj.weight", "k_proj.weight")):
            # llama.cpp's converter permutes q/k rows (HF rotate-half -> its interleaved
            # RoPE); quantization runs along rows, so permuting rows commutes with it.
            arr = half_to_interleaved(arr, hd)
        if q in (Q.F32, Q.F16):
            w.add_tensor(gguf_name(hf), arr.astype(np.float32 if q == Q.F32 else np.float16))
        else:
            w.add_tensor(gguf_name(hf), gguf.quants.quantize(arr.astype(np.float32), q),
                         raw_dtype=q)  # fmt: skip
    if extra_tensor is not None:
        w.add_tensor(extra_tensor, np.ones(4, np.float32))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return want


@pytest.mark.parametrize("cache", ["converted once", "read directly"])
@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_1])
def test_every_weight_is_the_dequantized_value_in_hugging_face_order(
    tmp_path: Path, qtype: Q, cache: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the converted folder models/loading/gguf_cache.py keeps, and from the file."""
    if cache == "read directly":
        monkeypatch.setenv("SPECTRIO_GGUF_CACHE", "0")
    path = tmp_path / "tiny.gguf"
    want = write_gguf(path, qtype=qtype)
    loaded = load(path, dtype="float64")
    got = {name: p.numpy() for name, p in loaded.model.named_parameters()}
    assert set(got) == set(want)
    for name, arr in want.items():
        value = got[name].T if got[name].ndim == 2 and "embed" not in name else got[name]
        np.testing.assert_array_equal(value, arr.astype(np.float64), err_msg=name)
    if qtype == Q.F32:  # exactly the checkpoint transformers ran: its tokens
        for prompt, tokens in zip(GOLDEN["prompts"], GOLDEN["cases"]["llama"], strict=True):
            out = reference.greedy_generate(loaded.model, prompt, GOLDEN["new_tokens"])
            assert out.token_ids == tokens


def test_tokenizer_and_template_come_from_the_metadata(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    loaded = load(path)
    tok = loaded.tokenizer
    assert tok is not None and tok.eos_token_id == 1
    assert tok.encode("hello world") == [TOKENS.index("hello"), TOKENS.index("Ġworld")]
    # A control token is one special token, dropped when decoding.
    assert tok.encode("hello<|im_end|>") == [13, 1]
    assert tok.decode([13, 1, 17]) == "hello world"
    assert loaded.chat_template == "{{ messages[0]['content'] }}<|im_end|>"


def test_convert_writes_a_folder_that_loads_bit_for_bit(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, qtype=Q.Q4_1)
    out = convert_gguf(path, tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"
    ]  # fmt: skip
    # every file as readable as a file this process creates (0666 less the umask), where
    # safetensors alone would leave 0600
    probe = tmp_path / "probe"
    probe.touch()
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert set(modes.values()) == {stat.S_IMODE(probe.stat().st_mode)}, modes
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>" and "chat_template" in tok_cfg
    a, b = load(path), load(out)
    assert a.config == b.config
    for (name, p), (_, q) in zip(
        a.model.named_parameters(), b.model.named_parameters(), strict=True
    ):
        np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=name)
    assert a.tokenizer is not None and b.tokenizer is not None
    text = "hello world<|im_end|>"
    assert b.tokenizer.encode(text) == a.tokenizer.encode(text)
    assert b.chat_template == a.chat_template


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"drop": "model.layers.1.mlp.up_proj.weight"}, "missing tensor 'model.layers.1.mlp"),
        ({"extra_tensor": "blk.0.attn_sinks.weight"}, "unexpected GGUF tensor 'blk.0.attn_sinks"),
        ({"rope_freqs": np.array([1, 3, 1, 2])}, "'rope_freqs.weight'.*not supported"),
        ({"arch": "gpt2"}, "GGUF architecture 'gpt2' is not supported"),
        ({"tokenizer_model": "bert"}, "tokenizer.ggml.model 'bert' is not supported"),
        ({"tokenizer_model": "llama"}, "tokenizer.ggml.model 'llama'.* tokenizer.ggml.scores"),
        ({"pre": "deepseek-coder"}, "tokenizer.ggml.pre 'deepseek-coder' is not supported"),
        ({"tokens": TOKENS + [f"t{i}" for i in range(181)]}, "tokenizer has 200 tokens but .* 96"),
        ({"tokens": ["x"] * 96}, "tokenizer.ggml.tokens repeats a token"),
    ],
)
def test_bad_files_are_refused_naming_the_problem(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    path = tmp_path / "bad.gguf"
    write_gguf(path, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match=message):
        load(path)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_file_is_refused(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "bad.gguf"
    write_gguf(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"GGUF" + b"\x07" * 64)
    with pytest.raises(CheckpointError, match="bad.gguf"):
        load(path)


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match="is a file but not a GGUF file"):
        load(path)


def test_config_comes_from_the_metadata(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    cfg = GGUFFile(path).config
    hf = json.loads((ARCHS / "llama" / "config.json").read_text())
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (
        hf["hidden_size"], hf["num_hidden_layers"], hf["intermediate_size"]
    )  # fmt: skip
    assert cfg.rms_norm_eps == 1e-6 and cfg.rope_theta == 10000.0  # float32 metadata, decimal
    assert cfg.tie_word_embeddings and cfg.num_nextn_predict_layers == 0
