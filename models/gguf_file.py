"""GGUF files (llama.cpp's format), read through the ``gguf`` package.

* **Config** from the ``{arch}.*`` metadata, for the architectures the decoder runs
  (``llama``, ``qwen2``, ``qwen3``, ``ernie4_5``); anything it does not implement (another
  architecture, RoPE scaling metadata or a ``rope_freqs`` tensor, partial rotary
  dimensions, a SentencePiece vocabulary) is refused, naming it.
* **Weights** dequantized at load by ``gguf.quants.dequantize`` (F32, F16, BF16, Q8_0,
  Q4_0, Q4_1, Q5_0, Q5_1, the K-quants and whatever else it implements), renamed to
  Hugging Face names, with llama.cpp's q/k row permutation undone where its RoPE mode
  rotates adjacent pairs (``llama``, ``ernie4_5``).
* **Tokenizer** built with ``tokenizers`` from ``tokenizer.ggml.*`` (a byte-level BPE: the
  vocabulary, the merges, the pre-tokenizer named by ``tokenizer.ggml.pre``; control
  tokens become special tokens), and the chat template from ``tokenizer.chat_template``.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np

from spectrio.errors import CheckpointError, ModelConfigError
from spectrio.models.checkpoint import interleaved_to_half, is_qk_rows
from spectrio.models.config import ModelConfig

__all__ = ["GGUFFile", "GGUF_MAGIC", "is_gguf"]

GGUF_MAGIC = b"GGUF"

_ARCHS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
}
# llama.cpp's RoPE mode per architecture: "normal" rotates adjacent pairs, so the
# converter permuted q/k rows (Llama) or kept them interleaved (ERNIE); "neox" rotates
# halves, as the decoder does.
_INTERLEAVED_ROPE = frozenset({"llama", "ernie4_5"})

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_down.bias": "mlp.down_proj.bias",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")

# Pre-tokenizer regexes of the byte-level BPE vocabularies, by ``tokenizer.ggml.pre``.
# None: the GPT-2 split that ``tokenizers``' ByteLevel applies itself.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = ("default", "gpt-2", "gpt2", "smollm", "llama-bpe", "llama3", "qwen2")

# gguf's token types (llama.cpp ``llama_token_type``).
_CONTROL, _USER_DEFINED = 3, 4


def _decimal(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not
    9.999999747378752e-06): the value the original config held."""
    return float(repr(np.float32(value)).removeprefix("np.float32(").removesuffix(")"))


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic."""
    try:
        with path.open("rb") as fh:
            return fh.read(4) == GGUF_MAGIC
    except OSError:
        return False


@dataclasses.dataclass
class _Tensor:
    raw: Any  # gguf.ReaderTensor
    shape: list[int]  # Hugging Face order: [out, in] for a matrix


class GGUFFile:
    """One GGUF file: its config, its tensors (a :class:`TensorSource`) and its
    tokenizer. Opening memory-maps the file and reads the metadata; tensors are
    dequantized when read."""

    def __init__(self, path: Path) -> None:
        import gguf

        self.path = path
        self.where = str(path)
        try:
            self._reader = gguf.GGUFReader(str(path))
        except (ValueError, OSError, IndexError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path}: corrupt or unreadable GGUF file ({exc})") from exc
        self.arch = str(self._field("general.architecture"))
        if self.arch not in _ARCHS:
            raise CheckpointError(
                f"{path}: GGUF architecture {self.arch!r} is not supported "
                f"(supported: {', '.join(_ARCHS)})"
            )
        self._tensors: dict[str, _Tensor] = {}
        for t in self._reader.tensors:
            name = self._hf_tensor_name(t.name)
            self._tensors[name] = _Tensor(t, [int(n) for n in reversed(list(t.shape))])
        try:
            self.config = self._config()
        except ModelConfigError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc

    # ---- metadata ----------------------------------------------------------------------

    def _field(self, key: str, default: Any = ...) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            if default is ...:
                raise CheckpointError(f"{self.path}: GGUF metadata {key!r} is missing")
            return default
        return field.contents()

    def _arch_field(self, key: str, default: Any = ...) -> Any:
        return self._field(f"{self.arch}.{key}", default)

    def _hf_tensor_name(self, name: str) -> str:
        if name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[name]
        match = _BLOCK.fullmatch(name)
        if match and match.group(2) in _LAYER_NAMES:
            return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
        if name == "rope_freqs.weight":
            raise CheckpointError(
                f"{self.path}: tensor 'rope_freqs.weight' (per-frequency RoPE scaling, as "
                "llama.cpp stores Llama 3.1's) is not supported; load the original Hugging "
                "Face checkpoint, whose rope_scaling spectrio implements"
            )
        raise CheckpointError(f"{self.path}: unexpected GGUF tensor {name!r}")

    def _config(self) -> ModelConfig:
        heads = int(self._arch_field("attention.head_count"))
        hidden = int(self._arch_field("embedding_length"))
        head_dim = int(self._arch_field("attention.key_length", hidden // heads))
        value_dim = int(self._arch_field("attention.value_length", head_dim))
        rope_dim = int(self._arch_field("rope.dimension_count", head_dim))
        if value_dim != head_dim:
            raise ModelConfigError(f"attention.value_length {value_dim} != key_length {head_dim}")
        if rope_dim != head_dim:
            raise ModelConfigError(
                f"rope.dimension_count {rope_dim} is not supported (partial rotary; "
                f"only the head size {head_dim})"
            )
        scaling = str(self._arch_field("rope.scaling.type", "none"))
        if scaling != "none":
            raise ModelConfigError(f"GGUF rope.scaling.type {scaling!r} is not supported")
        window = self._arch_field("attention.sliding_window", None)
        if window is not None:
            raise ModelConfigError(f"attention.sliding_window={window} is not supported")
        names = set(self._tensors)
        # The embedding's rows are the vocabulary the model has; metadata must agree.
        embed = self._tensors.get("model.embed_tokens.weight")
        stated = self._arch_field("vocab_size", None)
        if embed is None:
            raise CheckpointError(f"{self.path}: missing tensor 'token_embd.weight'")
        vocab = embed.shape[0]
        if stated is not None and int(stated) != vocab:
            raise ModelConfigError(
                f"{self.arch}.vocab_size is {stated} but token_embd.weight has {vocab} rows"
            )
        kv = self._arch_field("attention.head_count_kv", heads)
        if isinstance(kv, list):
            raise ModelConfigError("per-layer attention.head_count_kv is not supported")
        eos = self._field("tokenizer.ggml.eos_token_id", None)
        bos = self._field("tokenizer.ggml.bos_token_id", None)
        qkv_bias = "model.layers.0.self_attn.q_proj.bias" in names
        o_bias = "model.layers.0.self_attn.o_proj.bias" in names
        mlp_bias = "model.layers.0.mlp.gate_proj.bias" in names
        attention_bias = o_bias if self.arch == "qwen2" else qkv_bias
        if self.arch == "qwen2" and o_bias:
            raise ModelConfigError("qwen2 with an attn_output bias is not supported")
        if self.arch == "ernie4_5" and attention_bias != mlp_bias:
            raise ModelConfigError("ernie4_5 with bias on only some linears is not supported")
        return ModelConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=int(self._arch_field("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(kv),
            intermediate_size=int(self._arch_field("feed_forward_length")),
            max_position_embeddings=int(self._arch_field("context_length")),
            rope_theta=_decimal(self._arch_field("rope.freq_base", 10000.0)),
            rms_norm_eps=_decimal(self._arch_field("attention.layer_norm_rms_epsilon")),
            tie_word_embeddings="lm_head.weight" not in names,
            num_nextn_predict_layers=0,
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=None if eos is None else int(eos),
            architectures=(_ARCHS[self.arch],),
            head_dim=head_dim,
            attention_bias=attention_bias,
            mlp_bias=mlp_bias if self.arch == "llama" else attention_bias,
        )

    @property
    def chat_template(self) -> str | None:
        value = self._field("tokenizer.chat_template", None)
        return None if value is None else str(value)

    # ---- tensors (TensorSource) ----------------------------------------------------------

    def names(self) -> set[str]:
        return set(self._tensors)

    def shape(self, name: str) -> list[int]:
        return list(self._tensors[name].shape)

    def read(self, name: str, axis: int | None = None, lo: int = 0, hi: int = 0) -> np.ndarray:
        from gguf.quants import dequantize

        t = self._tensors[name]
        try:
            arr = np.asarray(dequantize(t.raw.data, t.raw.tensor_type)).reshape(t.shape)
        except NotImplementedError as exc:
            raise CheckpointError(
                f"{self.path}: tensor {t.raw.name!r}: {exc} (type {t.raw.tensor_type.name})"
            ) from exc
        except ValueError as exc:
            raise CheckpointError(
                f"{self.path}: tensor {t.raw.name!r} is corrupt or truncated ({exc})"
            ) from exc
        if self.arch in _INTERLEAVED_ROPE and is_qk_rows(name):
            arr = interleaved_to_half(arr, self.config.head_dim)
        if axis == 0:
            arr = arr[lo:hi]
        elif axis == 1:
            arr = arr[:, lo:hi]
        return arr

    # ---- tokenizer -----------------------------------------------------------------------

    def tokenizer_json(self) -> str | None:
        """The vocabulary as a ``tokenizers`` JSON document, or None when the file has
        none. Refuses a vocabulary it cannot rebuild exactly."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

        kind = self._field("tokenizer.ggml.model", None)
        if kind is None:
            return None
        if kind != "gpt2":
            raise CheckpointError(
                f"{self.path}: tokenizer.ggml.model {kind!r} is not supported (only 'gpt2', "
                "a byte-level BPE)"
            )
        pre = str(self._field("tokenizer.ggml.pre", "default"))
        if pre not in PRE_TOKENIZERS:
            raise CheckpointError(
                f"{self.path}: tokenizer.ggml.pre {pre!r} is not supported "
                f"(supported: {', '.join(PRE_TOKENIZERS)})"
            )
        tokens = [str(t) for t in self._field("tokenizer.ggml.tokens")]
        types = [int(t) for t in self._field("tokenizer.ggml.token_type", [1] * len(tokens))]
        merges = [tuple(str(m).split(" ", 1)) for m in self._field("tokenizer.ggml.merges", [])]
        if any(len(m) != 2 for m in merges):
            raise CheckpointError(f"{self.path}: tokenizer.ggml.merges has a malformed entry")
        vocab = {tok: i for i, tok in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise CheckpointError(f"{self.path}: tokenizer.ggml.tokens repeats a token")
        ignore_merges = pre in ("llama-bpe", "llama3")
        try:
            bpe = models.BPE(
                vocab, [(a, b) for a, b in merges], fuse_unk=False, ignore_merges=ignore_merges
            )
        except Exception as exc:  # tokenizers raises a bare Exception
            raise CheckpointError(
                f"{self.path}: tokenizer.ggml.tokens and merges do not agree ({exc})"
            ) from exc
        tok = Tokenizer(bpe)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        split = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
        if pre in split:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split[pre]), behavior="isolated", invert=False),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        elif pre == "smollm":
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        added = [
            AddedToken(t, special=(kind_ == _CONTROL), normalized=False)
            for t, kind_ in zip(tokens, types, strict=True)
            if kind_ in (_CONTROL, _USER_DEFINED)
        ]
        tok.add_tokens(added)
        return str(tok.to_str())

    def tokenizer_config(self) -> dict[str, Any]:
        """``tokenizer_config.json`` content: the chat template and the special tokens."""
        tokens = self._field("tokenizer.ggml.tokens", None)
        out: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for key, field in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        ):
            index = self._field(f"tokenizer.ggml.{field}", None)
            if tokens is not None and index is not None and 0 <= int(index) < len(tokens):
                out[key] = str(tokens[int(index)])
        add_bos = self._field("tokenizer.ggml.add_bos_token", None)
        if add_bos is not None:
            out["add_bos_token"] = bool(add_bos)
        out["model_max_length"] = self.config.max_position_embeddings
        if self.chat_template is not None:
            out["chat_template"] = self.chat_template
        return out
