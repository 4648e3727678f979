"""``spectrio quantize``: the K-quant quantizers against ``gguf``'s dequantizers, the
per-tensor type rule against llama.cpp's choices, GGUF files written from GGUF files and
from Hugging Face folders (every family, SmolLM2 and the bundled model) loading in
spectrio with their weights, tokenizer and greedy tokens, and the refusals.

The SmolLM2 tests compare with ``tests/data/smollm2_golden.json`` (transformers' greedy
tokens for the original file, which spectrio's float32 forward reproduces) rather than
loading the original again. A GGUF file written here is loaded directly (the GGUF cache
off), not converted into the cache.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quant_shape_to_byte_shape
from test_smollm2 import teacher_forced_top

from spectrio.errors import CheckpointError
from spectrio.models import LoadedModel, load, reference
from spectrio.models.architecture.config import BUNDLED_DIR
from spectrio.models.loading.block_serving import plan_blocks
from spectrio.models.loading.gguf_cache import cached_folder
from spectrio.models.loading.gguf_file import GGUFFile, rope_divisors
from spectrio.models.loading.gguf_quantize import (
    QUANT_TYPES,
    Choice,
    file_type,
    quantize,
    quantize_q4_k,
    quantize_q5_k,
    quantize_q6_k,
    tensor_type,
)
from spectrio.models.loading.gguf_write import TensorDone, write_gguf
from spectrio.models.loading.loader import state_dict_hf
from spectrio.models.ops import native_ops
from spectrio.tools.cli import quantize as quantize_cli
from spectrio.tools.cli.commands import main

DATA = Path(__file__).resolve().parent / "data"
ARCHS = DATA / "archs"
ARCH_GOLDEN = json.loads((ARCHS / "golden.json").read_text())
SMOL_GOLDEN = json.loads((DATA / "smollm2_golden.json").read_text())

# llama.cpp's round-trip error (RMS error over RMS value) on gaussian() below: its
# ggml_quantize_chunk then its to_float, from libggml-base of llama.cpp build 0c1e570.
LLAMA_CPP_RMS = {Q.Q4_K: 0.07135, Q.Q5_K: 0.03610, Q.Q6_K: 0.01774}
K_QUANTS = {Q.Q4_K: quantize_q4_k, Q.Q5_K: quantize_q5_k, Q.Q6_K: quantize_q6_k}

# The layers whose attn_v and ffn_down llama-quantize stored in Q6_K when it wrote
# SmolLM2 (30 layers) as Q4_K_M: the first and last eighth and every third in between.
MORE_BITS_OF_30 = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}


def gaussian() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(512, 1024)).astype(np.float32)


def rel_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))


def round_trip(x: np.ndarray, qtype: Q) -> np.ndarray:
    stored = quantize(x, qtype)
    assert stored.dtype == np.uint8
    assert stored.shape == quant_shape_to_byte_shape(x.shape, qtype)
    return np.asarray(dequantize(stored, qtype)).reshape(x.shape)


def min_max_rms(x: np.ndarray, qtype: Q) -> float:
    """The error of the plain scheme each K-quant refines, with exact float scales: per
    32-element sub-block its min (at most 0) and max on 16 or 32 levels (Q4_K, Q5_K); per
    16-element sub-block its largest magnitude on the symmetric levels -31..31 (Q6_K)."""
    if qtype == Q.Q6_K:
        blocks = x.reshape(-1, 16)
        scale = np.abs(blocks).max(axis=1, keepdims=True) / 31
        y = np.clip(np.rint(blocks / scale), -31, 31) * scale
    else:
        levels = 16 if qtype == Q.Q4_K else 32
        blocks = x.reshape(-1, 32)
        lo = np.minimum(blocks.min(axis=1, keepdims=True), 0)
        scale = (blocks.max(axis=1, keepdims=True) - lo) / (levels - 1)
        y = np.clip(np.rint((blocks - lo) / scale), 0, levels - 1) * scale + lo
    return rel_rms(y.reshape(x.shape), x)


# ---- the quantizers ------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", list(K_QUANTS), ids=lambda q: q.name)
def test_k_quants_round_trip_close_to_llama_cpp(qtype: Q) -> None:
    x = gaussian()
    err = rel_rms(round_trip(x, qtype), x)
    assert err <= min_max_rms(x, qtype), qtype.name
    assert err <= 1.01 * LLAMA_CPP_RMS[qtype], (qtype.name, err)
    # The block functions are the same quantizers, block by block.
    blocks = x.reshape(-1, 256)
    assert np.array_equal(K_QUANTS[qtype](blocks), quantize(x, qtype).reshape(blocks.shape[0], -1))


def test_more_bits_give_less_error() -> None:
    x = gaussian()
    errors = [rel_rms(round_trip(x, q), x) for q in (Q.Q6_K, Q.Q5_K, Q.Q4_K)]
    assert errors == sorted(errors) and errors[0] < errors[1] < errors[2]


@pytest.mark.parametrize("qtype", list(K_QUANTS), ids=lambda q: q.name)
def test_k_quants_take_awkward_blocks(qtype: Q) -> None:
    """Zeros, constants, one outlier, all-positive, all-negative and tiny values: finite,
    zeros exact, each block within a small share of its range."""
    rng = np.random.default_rng(1)
    rows = np.stack(
        [
            np.zeros(256),
            np.full(256, 0.5),
            np.full(256, -0.25),
            np.where(np.arange(256) == 7, 50.0, rng.normal(size=256)),
            np.abs(rng.normal(size=256)) + 1.0,
            -np.abs(rng.normal(size=256)) - 1.0,
            rng.normal(size=256) * 1e-4,
            np.linspace(-3, 3, 256),
        ]
    ).astype(np.float32)
    y = round_trip(rows, qtype)
    assert np.all(np.isfinite(y))
    assert np.array_equal(y[0], rows[0])
    span = np.maximum(np.abs(rows).max(axis=1), 1e-12)
    worst = np.abs(y - rows).max(axis=1) / span
    assert np.all(worst < {Q.Q4_K: 0.1, Q.Q5_K: 0.05, Q.Q6_K: 0.03}[qtype]), worst


# ---- the type rule -------------------------------------------------------------------------


def test_the_cli_lists_the_types() -> None:
    assert quantize_cli.TYPES == QUANT_TYPES
    assert (file_type("F32"), file_type("Q8_0"), file_type("Q4_K_M"), file_type("Q5_K_M")) == (
        0, 7, 15, 17,
    )  # fmt: skip


def test_the_mix_gives_more_bits_where_llama_cpp_does() -> None:
    def chosen(name: str) -> Q:
        return tensor_type(name, (64, 512), "Q4_K_M", 30, tied=True).qtype

    for part in ("attn_v.weight", "ffn_down.weight"):
        more = {i for i in range(30) if chosen(f"blk.{i}.{part}") == Q.Q6_K}
        assert more == MORE_BITS_OF_30, part
        assert all(chosen(f"blk.{i}.{part}") == Q.Q4_K for i in set(range(30)) - more)
    assert chosen("blk.0.attn_q.weight") == Q.Q4_K
    assert chosen("token_embd.weight") == Q.Q6_K  # tied: it is the output head
    untied = {n: tensor_type(n, (64, 512), "Q5_K_M", 30, tied=False).qtype
              for n in ("token_embd.weight", "output.weight", "blk.3.ffn_down.weight")}  # fmt: skip
    assert untied == {
        "token_embd.weight": Q.Q5_K, "output.weight": Q.Q6_K, "blk.3.ffn_down.weight": Q.Q5_K,
    }  # fmt: skip
    # A head whose rows 256 does not divide is Q8_0 by the rule itself, not a fallback.
    assert tensor_type("output.weight", (64, 576), "Q4_K_M", 30, False) == Choice(Q.Q8_0)
    # A single type applies to every matrix, as llama-quantize --pure does.
    assert tensor_type("output.weight", (64, 512), "Q4_K", 30, False) == Choice(Q.Q4_K)


def test_rows_the_block_does_not_divide_fall_back() -> None:
    def choice(target: str, row: int, name: str = "blk.4.attn_q.weight") -> Choice:
        return tensor_type(name, (8, row), target, 30, tied=True)

    assert choice("Q4_K", 576) == Choice(Q.Q5_0, wanted=Q.Q4_K)
    assert choice("Q5_K", 576) == Choice(Q.Q5_1, wanted=Q.Q5_K)
    assert choice("Q6_K", 576) == Choice(Q.Q8_0, wanted=Q.Q6_K)
    assert choice("Q4_K_M", 576, "blk.0.attn_v.weight") == Choice(Q.Q8_0, wanted=Q.Q6_K)
    assert choice("Q4_K", 100) == Choice(Q.F16, wanted=Q.Q4_K)
    assert choice("Q8_0", 100) == Choice(Q.F16, wanted=Q.Q8_0)
    assert choice("BF16", 100) == Choice(Q.BF16)
    for target in QUANT_TYPES:  # vectors stay F32
        assert tensor_type("blk.0.attn_norm.weight", (576,), target, 30, True) == Choice(Q.F32)


# ---- the bundled model and the tiny families: Hugging Face folder -> GGUF ----------------


@pytest.fixture
def direct_gguf(monkeypatch: pytest.MonkeyPatch) -> None:
    """Load GGUF files written here directly, not through the (session's) GGUF cache."""
    monkeypatch.setenv("SPECTRIO_GGUF_CACHE", "0")


@pytest.fixture(scope="module")
def bundled_f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bundled") / "bundled-f32.gguf"
    write_gguf(BUNDLED_DIR, out, "F32")
    return out


@pytest.fixture(scope="module")
def bundled_source(bundled_f32: Path) -> tuple[GGUFFile, dict[str, np.ndarray]]:
    source = GGUFFile(bundled_f32)
    return source, {n: source.read(n) for n in sorted(source.names())}


# Each type's bound on the relative RMS error of all the bundled model's weights (most of
# its matrices fall back from the K-quants: rows of 192).
BUNDLED_BOUND = {"F32": 0.0, "F16": 0.0, "BF16": 0.005, "Q8_0": 0.01, "Q6_K": 0.02,
                 "Q5_1": 0.05, "Q5_0": 0.05, "Q5_K": 0.05, "Q5_K_M": 0.05,
                 "Q4_1": 0.1, "Q4_0": 0.1, "Q4_K": 0.1, "Q4_K_M": 0.1}  # fmt: skip


@pytest.mark.parametrize("target", QUANT_TYPES)
def test_each_type_of_the_bundled_model_loads(
    target: str,
    bundled_source: tuple[GGUFFile, dict[str, np.ndarray]],
    tmp_path: Path,
    direct_gguf: None,
) -> None:
    """Each type from the bundled model's F32 GGUF: the file holds the types the rule
    chose, spectrio reads it (config and vocabulary as before), and the weights are within
    the type's error of the F32 ones."""
    source, want = bundled_source
    done: list[TensorDone] = []
    out = tmp_path / f"{target}.gguf"
    write_gguf(source.path, out, target, on_tensor=done.append)
    reader = gguf.GGUFReader(str(out))
    assert {t.name: Q(int(t.tensor_type)) for t in reader.tensors} == {
        t.name: t.choice.qtype for t in done
    }
    assert reader.fields["general.file_type"].contents() == file_type(target)
    got = GGUFFile(out)
    assert got.config == source.config and got.tokenizer_json() == source.tokenizer_json()
    values = np.concatenate([got.read(n).ravel() for n in want])
    error = rel_rms(values, np.concatenate([w.ravel() for w in want.values()]))
    assert error <= BUNDLED_BOUND[target], error


def test_a_gguf_file_keeps_its_metadata(bundled_f32: Path, tmp_path: Path) -> None:
    """Every key and value of the source, typed as stored, but general.file_type."""
    out = tmp_path / "q8_0.gguf"
    write_gguf(bundled_f32, out, "Q8_0")
    original = gguf.GGUFReader(str(bundled_f32)).fields
    written = gguf.GGUFReader(str(out)).fields
    assert set(written) == set(original)
    assert written["general.file_type"].contents() == file_type("Q8_0") != file_type("F32")
    for key in set(original) - {"general.file_type"}:
        assert written[key].contents() == original[key].contents(), key
        assert written[key].types == original[key].types, key


def test_the_bundled_folder_as_q4_k_m(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], direct_gguf: None
) -> None:
    """From the bundled Hugging Face folder through the CLI: hidden size 192 fits no
    256-element block, so those matrices fall back and the log names them; ffn_down (rows
    of 512) keeps its K-quants; the MTP layer is left out, saying so. It loads and
    generates as the original does for its first tokens."""
    out = tmp_path / "bundled-q4_k_m.gguf"
    assert main(["quantize", "bundled", str(out), "--type", "Q4_K_M"]) == 0
    captured = capsys.readouterr()
    summary = captured.out.strip().splitlines()[-1]
    assert summary.startswith(f"{out}: ") and " MB, Q4_K_M (" in summary
    assert "8 Q4_K" in summary and "8 Q6_K" in summary and "F32" in summary
    assert "MTP layer not written" in captured.err
    assert "type fell back" in captured.err and "blk.{0-15}.attn_q.weight" in captured.err
    assert "wanted=Q6_K" in captured.err and "used=Q8_0" in captured.err
    original, written = load("bundled", mtp_head=False), load(out)
    assert written.config == dataclasses.replace(original.config, num_nextn_predict_layers=0)
    prompt = original.tokenizer.encode("def fib(n):")
    want = reference.greedy_generate(original.model, prompt, 8).token_ids
    got = reference.greedy_generate(written.model, prompt, 8).token_ids
    assert got[:4] == want[:4]


def byte_level_tokenizer(folder: Path, size: int) -> None:
    """A byte-level BPE of ``size`` tokens (some bytes, two merges) into ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    first = [c for c in alphabet if c in "Ġthe"]
    chars = first + [c for c in alphabet if c not in first][: size - 2 - len(first)]
    vocab = {c: i for i, c in enumerate(chars)} | {"Ġt": size - 2, "he": size - 1}
    tok = Tokenizer(models.BPE(vocab, [("Ġ", "t"), ("h", "e")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))


def arch_folder(tmp_path: Path, case: str) -> Path:
    folder = tmp_path / case
    shutil.copytree(ARCHS / case, folder)
    byte_level_tokenizer(folder, 96)
    return folder


@pytest.mark.parametrize("case", ["llama", "llama_bias_llama3", "qwen2", "qwen3", "ernie4_5"])
def test_each_family_round_trips_exactly(case: str, tmp_path: Path, direct_gguf: None) -> None:
    """F32 from each family's tiny checkpoint: spectrio loads the same weights bit for bit
    (q/k rows permuted and back for llama and ERNIE, a llama3 rope scaling as rope_freqs)
    and emits transformers' greedy tokens."""
    out = tmp_path / f"{case}.gguf"
    write_gguf(arch_folder(tmp_path, case), out, "F32")
    original, written = load(ARCHS / case, dtype="float64"), load(out, dtype="float64")
    a, b = dict(original.model.named_parameters()), dict(written.model.named_parameters())
    assert set(a) == set(b)
    assert all(np.array_equal(a[n].numpy(), b[n].numpy()) for n in a)
    # A llama3 scaling comes back as one that gives the same divisors.
    assert np.allclose(rope_divisors(original.config), rope_divisors(written.config), rtol=1e-6)
    same = dataclasses.replace(written.config, rope_scaling=original.config.rope_scaling)
    assert same == original.config
    for prompt, want in zip(ARCH_GOLDEN["prompts"], ARCH_GOLDEN["cases"][case], strict=True):
        got = reference.greedy_generate(written.model, prompt, ARCH_GOLDEN["new_tokens"])
        assert got.token_ids == want


@pytest.mark.parametrize("case", ["llama_linear", "llama_dynamic"])
def test_rope_scalings_spectrio_cannot_read_back_are_refused(case: str, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="rope_scaling .* cannot be written as GGUF"):
        write_gguf(arch_folder(tmp_path, case), tmp_path / "out.gguf", "F32")
    assert not list(tmp_path.glob("out.gguf*"))


# ---- SmolLM2 ---------------------------------------------------------------------------------


def greedy_agrees(loaded: LoadedModel, prompt: int, tokens: int) -> int:
    """How many of its first ``tokens`` greedy tokens after golden prompt ``prompt`` equal
    the original's."""
    got = reference.greedy_generate(loaded.model, SMOL_GOLDEN["prompt_ids"][prompt], tokens)
    want = SMOL_GOLDEN["token_ids"][prompt][:tokens]
    same = [g == w for g, w in zip(got.token_ids, want, strict=True)]
    return same.index(False) if False in same else tokens


def test_smollm2_as_q8_0_generates_as_the_original(
    smollm2_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], direct_gguf: None
) -> None:
    """Q8_0 of the Q4_1 file's dequantized weights: the same greedy tokens on the golden
    prompts, and the vocabulary copied (it encodes the prompts as transformers did)."""
    out = tmp_path / "smollm2-q8_0.gguf"
    assert main(["quantize", str(smollm2_gguf), str(out), "--type", "Q8_0"]) == 0
    assert "Q8_0 (211 Q8_0, 61 F32)" in capsys.readouterr().out
    loaded = load(out, mtp_head=False)
    assert loaded.config.num_hidden_layers == 30 and loaded.config.hidden_size == 576
    assert loaded.tokenizer is not None
    for text, ids in zip(SMOL_GOLDEN["prompt_texts"], SMOL_GOLDEN["prompt_ids"], strict=True):
        assert loaded.tokenizer.encode(text) == ids
    assert greedy_agrees(loaded, 0, 16) == 16 and greedy_agrees(loaded, 2, 16) == 16


def test_smollm2_as_f32_is_the_original_bit_for_bit(
    smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = load(smollm2_gguf, mtp_head=False)  # through the session's GGUF cache
    out = tmp_path / "smollm2-f32.gguf"
    assert main(["quantize", str(smollm2_gguf), str(out), "--type", "F32"]) == 0
    monkeypatch.setenv("SPECTRIO_GGUF_CACHE", "0")
    written = load(out, mtp_head=False)
    assert written.config == original.config
    assert original.chat_template is not None
    assert written.chat_template == original.chat_template
    want, got = state_dict_hf(original.model), state_dict_hf(written.model)
    assert set(want) == set(got) and all(np.array_equal(want[n], got[n]) for n in want)
    assert greedy_agrees(written, 0, 8) == 8


def test_smollm2_from_its_hugging_face_folder(
    smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``spectrio convert smollm2 DIR`` then ``spectrio quantize DIR OUT --type F32``: the
    byte-level vocabulary (the ``smollm`` pre-tokenizer), the special tokens and the chat
    template come back; so do the weights, so the greedy tokens are the original's. The
    session's GGUF cache holds exactly the folder convert writes (convert_gguf's, in
    shards), so it is read from there when it is on."""
    folder = cached_folder(smollm2_gguf)
    if folder is None:
        folder = tmp_path / "smollm2-hf"
        assert main(["convert", str(smollm2_gguf), str(folder)]) == 0
    out = tmp_path / "smollm2-from-hf.gguf"
    assert main(["quantize", str(folder), str(out), "--type", "F32"]) == 0
    fields = gguf.GGUFReader(str(out)).fields
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert fields["tokenizer.ggml.pre"].contents() == "smollm"
    special = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")
    ids = [fields[f"tokenizer.ggml.{k}"].contents() for k in special]
    assert ids == [1, 2, 0, 2]
    assert fields["tokenizer.ggml.add_bos_token"].contents() is False
    monkeypatch.setenv("SPECTRIO_GGUF_CACHE", "0")
    written = load(out, mtp_head=False)
    template = json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    assert written.chat_template == template and "<|im_start|>" in template
    tok = written.tokenizer
    assert tok is not None and tok.eos_token_id == 2
    for text, ids_ in zip(SMOL_GOLDEN["prompt_texts"], SMOL_GOLDEN["prompt_ids"], strict=True):
        assert tok.encode(text) == ids_
        assert tok.raw.decode(ids_, skip_special_tokens=False) == text
    assert "Paris" in tok.decode(SMOL_GOLDEN["token_ids"][0])
    assert greedy_agrees(written, 0, 8) == 8


def test_smollm2_as_q4_k_m_falls_back_as_llama_cpp_does(
    smollm2_gguf: Path, tmp_path: Path, direct_gguf: None
) -> None:
    """Hidden size 576 = 2.25 x 256: every matrix reading the hidden state falls back
    (Q4_K to Q5_0, Q6_K to Q8_0), the tied embedding head is Q8_0, and only ffn_down
    (rows of 1536) keeps K-quants: Q6_K in the layers llama.cpp gives more bits. These are
    the types llama-quantize picks for this file. It loads and generates."""
    done: list[TensorDone] = []
    out = tmp_path / "smollm2-q4_k_m.gguf"
    result = write_gguf(smollm2_gguf, out, "Q4_K_M", on_tensor=done.append)
    types = {t.name: t.choice.qtype for t in done}
    for i in range(30):
        more = i in MORE_BITS_OF_30
        assert types[f"blk.{i}.ffn_down.weight"] == (Q.Q6_K if more else Q.Q4_K)
        assert types[f"blk.{i}.attn_v.weight"] == (Q.Q8_0 if more else Q.Q5_0)
        for part in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{part}.weight"] == Q.Q5_0
    assert types["token_embd.weight"] == Q.Q8_0
    assert result.types == {"Q5_0": 166, "F32": 61, "Q4_K": 16, "Q8_0": 15, "Q6_K": 14}
    assert len(result.fallbacks) == 180  # as llama-quantize reports for this file
    assert result.bytes == out.stat().st_size == 105_454_144  # llama-quantize's size too
    loaded = load(out, mtp_head=False)
    assert greedy_agrees(loaded, 2, 8) == 8
    if not native_ops.native_ops_available():
        return
    # Served from its blocks, every matrix: q|k|v mixing Q5_0 with attn_v's Q8_0 is
    # re-stored as Q8_0 (exact); ffn_down runs the K-quant kernels.
    float_top = teacher_forced_top(load(out, mtp_head=False, serving=False).model)
    plan = plan_blocks(GGUFFile(out), loaded.config)
    assert not plan.widened
    assert plan.counts() == {"Q5_0": 16 + 30 + 30, "Q8_0": 14 + 1, "Q4_K": 16, "Q6_K": 14}
    served = load(out, mtp_head=False, serving=True).model
    assert served.model.layers[0].mlp._down_weight.blocks
    block_top = teacher_forced_top(served)
    assert (float_top == block_top).mean() >= 0.93, (float_top == block_top).mean()


# ---- refusals --------------------------------------------------------------------------------


def one_error_line(capsys: pytest.CaptureFixture[str], *words: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def test_a_truncated_gguf_file_is_refused(
    bundled_f32: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = bundled_f32.read_bytes()
    for size in (200, len(data) // 2, len(data) - 10):
        bad = tmp_path / f"cut{size}.gguf"
        bad.write_bytes(data[:size])
        assert main(["quantize", str(bad), str(tmp_path / "out.gguf"), "--type", "Q8_0"]) == 2
        one_error_line(capsys, str(bad), "corrupt or unreadable GGUF")
    assert not list(tmp_path.glob("out.gguf*"))


def test_missing_and_unreadable_inputs_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "out.gguf")
    assert main(["quantize", str(tmp_path / "nowhere"), out, "--type", "Q4_0"]) == 2
    one_error_line(capsys, "nowhere", "no such file or directory")
    text = tmp_path / "notes.txt"
    text.write_text("not a model\n")
    assert main(["quantize", str(text), out, "--type", "Q4_0"]) == 2
    one_error_line(capsys, "notes.txt", "neither a GGUF file nor a Hugging Face folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["quantize", str(empty), out, "--type", "Q4_0"]) == 2
    one_error_line(capsys, "empty", "config.json")


def test_a_tokenizer_that_is_not_byte_level_bpe_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / "llama"
    shutil.copytree(ARCHS / "llama", folder)
    Tokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0)], 0)).save(str(folder / "tokenizer.json"))
    out = str(tmp_path / "out.gguf")
    assert main(["quantize", str(folder), out, "--type", "Q8_0"]) == 2
    one_error_line(capsys, "tokenizer.json", "'Unigram' is not supported", "byte-level BPE")
    # A BPE, but SentencePiece style: words marked with U+2581, not bytes.
    tok = Tokenizer(models.BPE({"a": 0, "b": 1}, []))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.save(str(folder / "tokenizer.json"))
    assert main(["quantize", str(folder), out, "--type", "Q8_0"]) == 2
    one_error_line(capsys, "tokenizer.json", "pre-tokenizer Metaspace")
    (folder / "tokenizer.json").unlink()
    assert main(["quantize", str(folder), out, "--type", "Q8_0"]) == 2
    one_error_line(capsys, "no tokenizer.json")
    assert not list(tmp_path.glob("out.gguf*"))


def test_an_unknown_type_is_refused_with_the_list(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["quantize", "smollm2", "out.gguf", "--type", "Q3_K"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'Q3_K'" in err and "'Q4_K_M'" in err and "'F32'" in err
