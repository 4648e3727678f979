"""GGUF files written with ``gguf``'s writer: ``spectrio quantize IN OUT --type TYPE``.

The input is either

* **a GGUF file**: every metadata key is copied as stored (architecture, hyperparameters,
  ``tokenizer.*``, chat template, ``general.*``) except those the new file states afresh
  (``general.file_type``, ``general.quantization_version``, ``general.alignment``); each
  tensor keeps its name and shape, and is dequantized (``gguf.quants.dequantize``) and
  stored in the type :func:`~spectrio.models.loading.gguf_quantize.tensor_type` gives it, or
  copied as stored when it already has that type; or
* **a Hugging Face folder** (``config.json``, safetensors, ``tokenizer.json``, optionally
  ``tokenizer_config.json``) of a family :mod:`spectrio.models.loading.gguf_file` reads (Llama,
  Qwen2, Qwen3, ERNIE 4.5): the inverse of that reader and of
  :mod:`spectrio.models.loading.convert`. It writes the ``{arch}.*`` hyperparameters, llama.cpp's
  tensor names, q/k rows in interleaved pair order for the architectures whose RoPE
  rotates adjacent pairs (``llama``, ``ernie4_5``), a ``llama3`` rope scaling as the
  ``rope_freqs.weight`` divisors, and the tokenizer. Only a byte-level BPE
  ``tokenizer.json`` is written (``tokenizer.ggml.model = gpt2``); its pre-tokenizer must
  be one llama.cpp names (:data:`PRE_TOKENIZERS`). Special token ids, the add-BOS/EOS
  flags, the merges and the chat template are read by ``gguf.SpecialVocab``, as
  llama.cpp's converter reads them. An MTP layer is left out (llama.cpp's decoders have
  no place for it), saying so in the log.

Tensors are written one at a time (the header is sized first), so memory holds one
tensor's values and its quantized copy, not the model. The file is written under a
temporary name beside ``out`` and renamed into place at the end: a failure leaves no
partial file.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import structlog

from spectrio.errors import CheckpointError
from spectrio.models.architecture.config import ModelConfig
from spectrio.models.loading.checkpoint import SafetensorsSource, half_to_interleaved, is_qk_rows
from spectrio.models.loading.gguf_file import (
    # gguf_file's own tables, read backwards, so that reader and writer cannot drift.
    _ARCHS,
    _GLOBAL_NAMES,
    _INTERLEAVED_ROPE,
    _LAYER_NAMES,
    ORIGINAL_CONTEXT,
    ROPE_FREQS,
    is_gguf,
    rope_divisors,
)
from spectrio.models.loading.gguf_quantize import (
    QUANT_TYPES,
    Choice,
    file_type,
    quantize,
    tensor_type,
)
from spectrio.models.loading.gguf_vocab import _LLAMA3_SPLIT, _QWEN2_SPLIT
from spectrio.models.loading.loader import read_config
from spectrio.models.loading.mtp_layout import is_layout_tensor, tolerated, with_layout

log = structlog.get_logger("spectrio.models.loading.gguf_write")

__all__ = ["PRE_TOKENIZERS", "QuantizeResult", "TensorDone", "write_gguf"]

Q = gguf.GGMLQuantizationType

_HF_TO_GGUF_GLOBAL = {hf: g for g, hf in _GLOBAL_NAMES.items()}
_HF_TO_GGUF_LAYER = {hf: g for g, hf in _LAYER_NAMES.items()}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_FAMILIES = tuple(_ARCHS)  # gguf_file's architectures, named as spectrio's families are

# Keys the new file states itself rather than copying: the type, the quantization
# format version, and the data alignment (the writer pads to its own).
_RESTATED = frozenset(
    {"general.architecture", "general.file_type", "general.quantization_version",
     "general.alignment"}
)  # fmt: skip

PRE_TOKENIZERS = {
    (("ByteLevel", True),): "gpt-2",
    (("Digits", True), ("ByteLevel", True)): "smollm",
    (("Split", _LLAMA3_SPLIT, "isolated", False), ("ByteLevel", False)): "llama-bpe",
    (("Split", _QWEN2_SPLIT, "isolated", False), ("ByteLevel", False)): "qwen2",
}
"""``tokenizer.ggml.pre`` of each ``tokenizer.json`` pre-tokenizer written: GPT-2's
byte-level split, SmolLM's (digits one by one first), Llama 3's and Qwen2's regexes."""


@dataclasses.dataclass(frozen=True)
class TensorDone:
    """One tensor written (for progress): its name and the type it was stored in."""

    name: str
    choice: Choice


@dataclasses.dataclass(frozen=True)
class QuantizeResult:
    """What :func:`write_gguf` wrote, for its summary and its log."""

    path: Path
    bytes: int
    target: str
    #: tensors per stored type name (``{"Q8_0": 211, "F32": 61}``)
    types: dict[str, int]
    #: (tensor, type the rule picked, type stored, row length) of each that fell back
    fallbacks: list[tuple[str, str, str, int]]


@dataclasses.dataclass
class _Tensor:
    name: str  # llama.cpp's
    shape: tuple[int, ...]  # NumPy order: rows last
    read: Callable[[], np.ndarray]  # float32 values, llama.cpp's layout
    #: a GGUF input's tensor as stored (its type, its bytes): copied when its type stays
    stored: tuple[gguf.GGMLQuantizationType, np.ndarray] | None = None


@dataclasses.dataclass
class _Model:
    arch: str
    tensors: list[_Tensor]
    num_layers: int
    write_metadata: Callable[[gguf.GGUFWriter], None]


def write_gguf(
    src: str | Path,
    out: str | Path,
    target: str,
    on_tensor: Callable[[TensorDone], None] | None = None,
) -> QuantizeResult:
    """Write the GGUF file or Hugging Face folder ``src`` as the GGUF file ``out`` with
    weights in ``target`` (a name of :data:`~spectrio.models.loading.gguf_quantize.QUANT_TYPES`).
    ``on_tensor`` hears of each tensor once written. A source that cannot be read or
    written as GGUF raises :class:`CheckpointError` naming the file and the reason."""
    if target not in QUANT_TYPES:
        raise ValueError(f"unknown type {target!r} (one of {', '.join(QUANT_TYPES)})")
    src, out = Path(src), Path(out)
    if src.is_dir():
        model = _from_folder(src)
    elif is_gguf(src):
        model = _from_gguf(src)
    elif src.is_file():
        raise CheckpointError(f"{src}: neither a GGUF file nor a Hugging Face folder")
    else:
        raise CheckpointError(f"{src}: no such file or directory")
    if out.is_dir():
        raise CheckpointError(f"{out}: is a directory (the output is a .gguf file)")
    tied = not any(t.name == "output.weight" for t in model.tensors)
    plan = [
        (t, tensor_type(t.name, t.shape, target, model.num_layers, tied)) for t in model.tensors
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(partial, model.arch)
    try:
        writer.add_file_type(file_type(target))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        model.write_metadata(writer)
        for t, choice in plan:
            writer.add_tensor_info(
                t.name, t.shape, np.dtype(np.float32), _nbytes(t.shape, choice.qtype), choice.qtype
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t, choice in plan:
            writer.write_tensor_data(_stored(t, choice.qtype))
            if on_tensor is not None:
                on_tensor(TensorDone(t.name, choice))
        writer.close()
        partial.replace(out)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    types = Counter(choice.qtype.name for _, choice in plan)
    fallbacks = [
        (t.name, choice.wanted.name, choice.qtype.name, t.shape[-1])
        for t, choice in plan
        if choice.wanted is not None
    ]
    return QuantizeResult(out, out.stat().st_size, target, dict(types.most_common()), fallbacks)


def _nbytes(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape[:-1])) * (shape[-1] // block) * size


def _stored(t: _Tensor, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    if t.stored is not None and t.stored[0] == qtype:
        return t.stored[1]  # already in its type: the bytes as they were
    return quantize(t.read(), qtype)


# ---- a GGUF file ---------------------------------------------------------------------------


def _from_gguf(path: Path) -> _Model:
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: corrupt or unreadable GGUF file ({exc})") from exc
    fields = reader.fields
    arch_field = fields.get("general.architecture")
    if arch_field is None:
        raise CheckpointError(f"{path}: GGUF metadata 'general.architecture' is missing")
    arch = str(arch_field.contents())
    if arch not in _FAMILIES:
        # The type rule and the tensor names are llama.cpp's for these decoders; another
        # architecture's file may hold tensors llama.cpp keeps unquantized (routers,
        # position embeddings), and spectrio could not load the result.
        raise CheckpointError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: "
            f"{', '.join(_FAMILIES)})"
        )
    splits = fields.get("split.count")
    if splits is not None and int(splits.contents()) > 1:
        raise CheckpointError(
            f"{path}: one part of a GGUF split in {int(splits.contents())} files; merge the "
            "parts first (llama-gguf-split --merge)"
        )
    kept = [_field(path, key, field) for key, field in fields.items() if _copied(key)]

    def write_metadata(writer: gguf.GGUFWriter) -> None:
        for key, vtype, sub_type, value in kept:
            if vtype == gguf.GGUFValueType.ARRAY and not value:
                # the writer refuses empty arrays; an empty list states nothing
                log.warning("empty metadata array not copied", file=str(path), key=key)
                continue
            writer.add_key_value(key, value, vtype, sub_type=sub_type)

    tensors = [_gguf_tensor(path, t) for t in reader.tensors]
    block_count = fields.get(f"{arch}.block_count")
    layers = [int(m.group(1)) for t in tensors if (m := re.match(r"blk\.(\d+)\.", t.name))]
    num_layers = (
        int(block_count.contents()) if block_count is not None else max(layers, default=-1) + 1
    )
    return _Model(arch, tensors, num_layers, write_metadata)


def _copied(key: str) -> bool:
    return not key.startswith("GGUF.") and key not in _RESTATED


def _field(
    path: Path, key: str, field: Any
) -> tuple[str, gguf.GGUFValueType, gguf.GGUFValueType | None, Any]:
    """(key, type, element type of an array, value) of a metadata field, read before
    anything is written; a value the writer cannot copy is refused."""
    types = list(field.types)
    if not types:
        raise CheckpointError(f"{path}: GGUF metadata {key!r} has no type")
    array = types[0] == gguf.GGUFValueType.ARRAY
    if array and len(types) > 2:
        raise CheckpointError(f"{path}: GGUF metadata {key!r} is a nested array (not supported)")
    try:
        value = field.contents()
    except (UnicodeDecodeError, ValueError, IndexError) as exc:
        raise CheckpointError(f"{path}: GGUF metadata {key!r} is unreadable ({exc})") from exc
    return key, types[0], types[-1] if array else None, value


def _gguf_tensor(path: Path, t: Any) -> _Tensor:
    shape = tuple(int(n) for n in reversed(list(t.shape)))
    qtype = Q(int(t.tensor_type))

    def read() -> np.ndarray:
        try:
            values = gguf.quants.dequantize(t.data, qtype)
        except NotImplementedError as exc:
            raise CheckpointError(f"{path}: tensor {t.name!r}: {exc} (type {qtype.name})") from exc
        except ValueError as exc:
            raise CheckpointError(
                f"{path}: tensor {t.name!r} is corrupt or truncated ({exc})"
            ) from exc
        return np.asarray(values, dtype=np.float32).reshape(shape)

    return _Tensor(t.name, shape, read, stored=(qtype, t.data))


# ---- a Hugging Face folder -----------------------------------------------------------------


def _from_folder(folder: Path) -> _Model:
    cfg = read_config(folder)
    if cfg.family not in _FAMILIES:
        raise CheckpointError(
            f"{folder}: {cfg.architectures[0]} cannot be written as GGUF (spectrio's GGUF "
            f"reader takes {', '.join(_FAMILIES)})"
        )
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type != "llama3":
        raise CheckpointError(
            f"{folder}: rope_scaling {cfg.rope_scaling.rope_type!r} cannot be written as GGUF "
            "(spectrio's GGUF reader takes only llama3's, as rope_freqs)"
        )
    source = SafetensorsSource(folder, cfg)
    cfg = with_layout(cfg, source.names(), str(folder))
    tensors = list(_folder_tensors(folder, cfg, source))
    vocab = _byte_level_vocab(folder, cfg.vocab_size)
    if cfg.rope_scaling is not None:
        divisors = rope_divisors(cfg).astype(np.float32)
        tensors.append(_Tensor(ROPE_FREQS, divisors.shape, lambda: divisors))

    def write_metadata(writer: gguf.GGUFWriter) -> None:
        _write_config(writer, folder, cfg)
        vocab.write(writer)

    return _Model(cfg.family, tensors, cfg.num_hidden_layers, write_metadata)


def _expected(cfg: ModelConfig) -> dict[str, list[int]]:
    """The Hugging Face names and shapes of the decoder's tensors, in llama.cpp's file
    order."""
    hidden, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    rows = {"q": cfg.num_attention_heads * hd, "k": cfg.num_key_value_heads * hd}
    rows["v"] = rows["k"]
    out = {"model.embed_tokens.weight": [cfg.vocab_size, hidden]}
    for i in range(cfg.num_hidden_layers):
        layer = f"model.layers.{i}."
        out[layer + "input_layernorm.weight"] = [hidden]
        for proj in ("q", "k", "v"):
            out[f"{layer}self_attn.{proj}_proj.weight"] = [rows[proj], hidden]
            if cfg.qkv_bias:
                out[f"{layer}self_attn.{proj}_proj.bias"] = [rows[proj]]
        out[layer + "self_attn.o_proj.weight"] = [hidden, rows["q"]]
        if cfg.o_bias:
            out[layer + "self_attn.o_proj.bias"] = [hidden]
        if cfg.qk_norm:
            out[layer + "self_attn.q_norm.weight"] = [hd]
            out[layer + "self_attn.k_norm.weight"] = [hd]
        out[layer + "post_attention_layernorm.weight"] = [hidden]
        for proj, shape in (("gate", [inter, hidden]), ("up", [inter, hidden]),
                            ("down", [hidden, inter])):  # fmt: skip
            out[f"{layer}mlp.{proj}_proj.weight"] = shape
            if cfg.mlp_bias:
                out[f"{layer}mlp.{proj}_proj.bias"] = shape[:1]
    out["model.norm.weight"] = [hidden]
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = [cfg.vocab_size, hidden]
    return out


def _gguf_name(hf: str) -> str:
    if hf in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[hf]
    match = _HF_LAYER.fullmatch(hf)
    assert match is not None and match.group(2) in _HF_TO_GGUF_LAYER, hf
    return f"blk.{match.group(1)}.{_HF_TO_GGUF_LAYER[match.group(2)]}"


def _folder_tensors(folder: Path, cfg: ModelConfig, source: SafetensorsSource) -> Iterator[_Tensor]:
    expected = _expected(cfg)
    names = source.names()
    for hf, shape in expected.items():
        if hf not in names:
            raise CheckpointError(f"{folder}: missing tensor {hf!r} (expected shape {shape})")
        if source.shape(hf) != shape:
            raise CheckpointError(
                f"{folder}: tensor {hf!r} has shape {source.shape(hf)}, expected {shape}"
            )
    extra = names - set(expected)
    mtp = {n for n in extra if cfg.has_mtp and is_layout_tensor(n, cfg)}
    if mtp:
        log.warning(
            "MTP layer not written (GGUF's decoders have no place for it)",
            folder=str(folder),
            tensors=len(mtp),
        )
    for name in sorted(extra - mtp):
        if tolerated(name, cfg) or name.endswith("rotary_emb.inv_freq"):
            continue
        raise CheckpointError(
            f"{folder}: unexpected tensor {name!r} (not part of this architecture)"
        )
    interleave = cfg.family in _INTERLEAVED_ROPE
    for hf in expected:

        def read(hf: str = hf) -> np.ndarray:
            arr = np.asarray(source.read(hf), dtype=np.float32)
            if interleave and is_qk_rows(hf):  # llama.cpp's pair order, as gguf_file undoes
                arr = half_to_interleaved(arr, cfg.head_dim)
            return arr

        yield _Tensor(_gguf_name(hf), tuple(source.shape(hf)), read)


def _write_config(writer: gguf.GGUFWriter, folder: Path, cfg: ModelConfig) -> None:
    writer.add_type("model")
    writer.add_name(folder.resolve().name)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    if cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads:  # else llama.cpp derives it
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.rope_scaling is not None:
        original = cfg.rope_scaling.original_max_position_embeddings or ORIGINAL_CONTEXT
        writer.add_rope_scaling_orig_ctx_len(int(original))


# ---- the tokenizer -------------------------------------------------------------------------


@dataclasses.dataclass
class _Vocab:
    pre: str
    tokens: list[str]
    types: list[int]
    special: Any  # gguf.SpecialVocab: merges, special ids, add-BOS/EOS, chat template

    def write(self, writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.types)
        self.special.add_to_gguf(writer, quiet=True)


def _byte_level_vocab(folder: Path, rows: int) -> _Vocab:
    """``tokenizer.json`` as llama.cpp's ``gpt2`` vocabulary of ``rows`` tokens (the
    embedding's rows; ids the tokenizer leaves unused become ``[PAD{id}]``, as llama.cpp's
    converter names them). Any other kind of tokenizer is refused, naming it."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no tokenizer.json (a GGUF file carries its vocabulary)")
    try:
        raw = json.loads(path.read_text())
        model = raw["model"]
        kind = model.get("type")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: unreadable tokenizer ({exc})") from exc
    supported = "only a byte-level BPE, tokenizer.ggml.model 'gpt2', is written"
    if kind != "BPE":
        raise CheckpointError(f"{path}: tokenizer model {kind!r} is not supported ({supported})")
    if model.get("byte_fallback"):
        raise CheckpointError(
            f"{path}: a BPE with byte fallback (SentencePiece style) is not supported ({supported})"
        )
    normalizer = raw.get("normalizer")
    # NFC changes no text a byte-level BPE's tokens spell; llama.cpp's converter drops it.
    if normalizer is not None and normalizer.get("type") != "NFC":
        raise CheckpointError(
            f"{path}: normalizer {normalizer.get('type')!r} is not supported ({supported})"
        )
    pre = _pre_tokenizer(path, raw.get("pre_tokenizer"))
    by_id: dict[int, tuple[str, int]] = {}
    for token, index in model.get("vocab", {}).items():
        by_id[int(index)] = (token, int(gguf.TokenType.NORMAL))
    for added in raw.get("added_tokens", []):
        kind_ = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        by_id[int(added["id"])] = (str(added["content"]), int(kind_))
    if by_id and max(by_id) >= rows:
        raise CheckpointError(
            f"{path}: token id {max(by_id)} is past the embedding's {rows} rows: the tokenizer "
            "does not belong to this model"
        )
    unused = int(gguf.TokenType.UNUSED)
    entries = [by_id.get(i) or (f"[PAD{i}]", unused) for i in range(rows)]
    try:
        special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=rows)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{folder}: unreadable tokenizer files ({exc})") from exc
    return _Vocab(pre, [t for t, _ in entries], [k for _, k in entries], special)


def _pre_tokenizer(path: Path, pre: Any) -> str:
    """``tokenizer.ggml.pre`` for a ``tokenizer.json`` pre-tokenizer (:data:`PRE_TOKENIZERS`)."""
    if not isinstance(pre, dict):
        raise CheckpointError(f"{path}: no pre-tokenizer (not a byte-level BPE)")
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    signature: list[tuple[Any, ...]] = []
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel":
            if step.get("add_prefix_space"):
                raise CheckpointError(
                    f"{path}: ByteLevel with add_prefix_space is not supported (llama.cpp "
                    "adds no space before the text)"
                )
            signature.append(("ByteLevel", bool(step.get("use_regex", True))))
        elif kind == "Digits":
            signature.append(("Digits", bool(step.get("individual_digits", False))))
        elif kind == "Split":
            pattern = step.get("pattern", {})
            signature.append(
                ("Split", pattern.get("Regex", pattern.get("String")),
                 str(step.get("behavior", "")).lower(), bool(step.get("invert", False)))
            )  # fmt: skip
        else:
            signature.append((kind,))
    name = PRE_TOKENIZERS.get(tuple(signature))
    if name is None:
        described = " + ".join(str(s[0]) for s in signature) or "none"
        raise CheckpointError(
            f"{path}: pre-tokenizer {described} is not one llama.cpp names (supported: "
            "ByteLevel; Digits + ByteLevel (SmolLM); Llama 3's or Qwen2's Split + ByteLevel)"
        )
    return name
