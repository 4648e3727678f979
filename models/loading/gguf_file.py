"""GGUF files (llama.cpp's format), read through the ``gguf`` package.

* **Config** from the ``{arch}.*`` metadata, for the architectures the decoder runs
  (``llama``, ``qwen2``, ``qwen3``, ``ernie4_5``); anything it does not implement (another
  architecture, RoPE scaling metadata, partial rotary dimensions, another kind of
  vocabulary) is refused, naming it.
* **RoPE scaling** from a ``rope_freqs.weight`` tensor: llama.cpp stores Llama 3.x's
  ``llama3`` rope scaling as one divisor per frequency. The equivalent Hugging Face
  ``rope_scaling`` is recovered from it (:func:`llama3_scaling`) and checked by
  recomputing the divisors with spectrio's own RoPE; divisors that no ``llama3`` rule
  gives are refused, naming the tensor.
* **Weights** dequantized at load by ``gguf.quants.dequantize`` (F32, F16, BF16, Q8_0,
  Q4_0, Q4_1, Q5_0, Q5_1, the K-quants and whatever else it implements), renamed to
  Hugging Face names, with llama.cpp's q/k row permutation undone where its RoPE mode
  rotates adjacent pairs (``llama``, ``ernie4_5``).
* **Tokenizer** built with ``tokenizers`` from ``tokenizer.ggml.*`` (:mod:`.gguf_vocab`),
  of either kind ``tokenizer.ggml.model`` names:

  - ``gpt2``, a byte-level BPE: the vocabulary, the merges, the pre-tokenizer named by
    ``tokenizer.ggml.pre``; control tokens become special tokens, user-defined ones added
    tokens.
  - ``llama``, a SentencePiece BPE (Llama 2, Mistral, TinyLlama, ERNIE 4.5), rebuilt as
    Hugging Face's Llama tokenizer does: a BPE with byte fallback (``<0xNN>`` tokens)
    whose merges come from the pieces and ``tokenizer.ggml.scores`` (:func:`spm_merges`);
    a normalizer that writes spaces as U+2581 and prepends one to each run of text
    (``tokenizer.ggml.add_space_prefix``, default true), a decoder that undoes both and
    the byte fallback; control and unknown tokens special, user-defined ones added; BOS
    and EOS in the post-processor per ``add_bos_token`` (default true) and
    ``add_eos_token``. It encodes as sentencepiece does, and as llama.cpp does around
    special tokens (each run of text after one gets its own prefix space). Without
    scores it is refused, naming the field.

  The chat template comes from ``tokenizer.chat_template``.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np

from spectrio.errors import CheckpointError, ModelConfigError
from spectrio.models.architecture.config import ModelConfig, RopeScaling
from spectrio.models.loading import gguf_vocab
from spectrio.models.loading.checkpoint import interleaved_to_half, is_qk_rows
from spectrio.models.loading.gguf_cache import cached_tokenizer_json
from spectrio.models.loading.gguf_header import GGUFHeader, GGUFHeaderError, TensorInfo

__all__ = ["GGUFFile", "GGUF_MAGIC", "is_gguf", "llama3_scaling"]

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


def _decimal(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not
    9.999999747378752e-06): the value the original config held."""
    return float(repr(np.float32(value)).removeprefix("np.float32(").removesuffix(")"))


ROPE_FREQS = "rope_freqs.weight"
ORIGINAL_CONTEXT = 8192
"""``original_max_position_embeddings`` of a ``llama3`` rope scaling whose file does not
state it (``{arch}.rope.scaling.original_context_length``): Llama 3.1's and 3.2's."""
ROPE_FREQS_RTOL = 1e-5
"""How closely the recovered rope scaling must give back each stored divisor (they are
float32)."""


def rope_divisors(cfg: ModelConfig) -> np.ndarray:
    """The per-frequency divisors ``cfg``'s rope scaling applies, as llama.cpp's
    ``rope_freqs`` holds them: unscaled inverse frequency over scaled."""
    unscaled = dataclasses.replace(cfg, rope_scaling=None).inv_freq()
    return np.asarray(unscaled / cfg.inv_freq(), dtype=np.float64)


def _fit_llama3(divisors: np.ndarray, x: np.ndarray) -> tuple[float, float, float] | None:
    """(factor, low_freq_factor, high_freq_factor) of a ``llama3`` rule giving
    ``divisors`` at frequencies ``x = original_max_position_embeddings / wavelength``; None
    where none can. The rule divides by ``factor`` where ``x < low``, by 1 where
    ``x > high``, and in between ``1 / divisor`` is linear in ``x``: ``1/factor`` at
    ``low``, 1 at ``high``."""
    factor = float(divisors.max())
    if factor <= 1.0:
        return None
    inv = 1.0 / divisors
    ones = np.abs(divisors - 1.0) <= ROPE_FREQS_RTOL
    full = np.abs(divisors - factor) <= ROPE_FREQS_RTOL * factor
    blend = ~ones & ~full
    x_full = float(x[full].max())  # the shortest wavelength divided by the whole factor
    x_one = float(x[ones].min()) if ones.any() else None  # the longest one kept
    if blend.sum() >= 2:  # the blend's line, fitted
        b, a = np.polyfit(x[blend], inv[blend], 1)
        if b <= 0:
            return None
        return factor, float((1.0 / factor - a) / b), float((1.0 - a) / b)
    if blend.sum() == 1:  # one point on the line: any line through it that the others allow
        xm = float(x[blend][0])
        s = float((inv[blend][0] - 1.0 / factor) / (1.0 - 1.0 / factor))
        low, high = x_full, x_full + (xm - x_full) / s
        if x_one is not None and high > x_one:
            low, high = (xm - s * x_one) / (1.0 - s), x_one
        return factor, low, high
    # a step: the band lies between the last frequency divided and the first kept
    return factor, x_full, x_one if x_one is not None else 2.0 * x_full


def llama3_scaling(
    divisors: np.ndarray, cfg: ModelConfig, original: int = ORIGINAL_CONTEXT
) -> RopeScaling | None:
    """The ``llama3`` rope scaling (with ``original_max_position_embeddings`` ``original``)
    whose per-frequency divisors are ``divisors`` (llama.cpp's ``rope_freqs``) for the
    unscaled RoPE of ``cfg``; None for all ones (no scaling). Raises
    :class:`ModelConfigError` saying why where no ``llama3`` rule gives them within
    :data:`ROPE_FREQS_RTOL`."""
    want = cfg.head_dim // 2
    divisors = np.asarray(divisors, dtype=np.float64).reshape(-1)
    if divisors.size != want:
        raise ModelConfigError(
            f"it has {divisors.size} values, but RoPE over heads of {cfg.head_dim} has "
            f"{want} frequencies"
        )
    if not np.all(np.isfinite(divisors)) or np.any(divisors <= 0):
        raise ModelConfigError("it holds a value that is not a positive number")
    if np.all(np.abs(divisors - 1.0) <= ROPE_FREQS_RTOL):
        return None
    base = dataclasses.replace(cfg, rope_scaling=None)
    x = original * base.inv_freq() / (2 * np.pi)
    fitted = _fit_llama3(divisors, x)
    error = np.inf
    if fitted is not None:
        factor, low, high = fitted
        rounded = (round(factor, 4), round(low, 4), round(high, 4))
        for f, lo, hi in (rounded, fitted):  # the values a config would hold, if they fit
            if not (f > 1.0 and 0.0 < lo < hi):
                continue
            scaling = RopeScaling("llama3", f, lo, hi, original)
            got = rope_divisors(dataclasses.replace(base, rope_scaling=scaling))
            rel = float(np.max(np.abs(got - divisors) / divisors))
            if rel < ROPE_FREQS_RTOL:
                return scaling
            error = min(error, rel)
    raise ModelConfigError(
        "its per-frequency divisors are not those of a Llama 3 'llama3' rope scaling "
        f"(original_max_position_embeddings {original}; the closest fit is off by a "
        f"relative {error:.2g}, more than {ROPE_FREQS_RTOL:g})"
    )


#: rows read at once past which :meth:`GGUFFile.read_rows` drops the mapping's pages
_DROP_AFTER_ROWS = 1024


def _qtype(t: TensorInfo) -> Any:
    from gguf.constants import GGMLQuantizationType

    return GGMLQuantizationType(t.ggml_type)


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic."""
    try:
        with path.open("rb") as fh:
            return fh.read(4) == GGUF_MAGIC
    except OSError:
        return False


@dataclasses.dataclass
class _Tensor:
    raw: TensorInfo
    shape: list[int]  # Hugging Face order: [out, in] for a matrix


class GGUFFile:
    """One GGUF file: its config, its tensors (a :class:`TensorSource`) and its
    tokenizer. Opening memory-maps the file and reads the metadata; tensors are
    dequantized when read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.where = str(path)
        try:
            self._header = GGUFHeader(path)
        except GGUFHeaderError as exc:
            raise CheckpointError(f"corrupt or unreadable GGUF file: {exc}") from exc
        self.arch = str(self._field("general.architecture"))
        if self.arch not in _ARCHS:
            raise CheckpointError(
                f"{path}: GGUF architecture {self.arch!r} is not supported "
                f"(supported: {', '.join(_ARCHS)})"
            )
        self._tensors: dict[str, _Tensor] = {}
        self._rope_freqs: TensorInfo | None = None  # rope_freqs.weight, if any
        for t in self._header.tensors:
            if t.name == ROPE_FREQS:
                self._rope_freqs = t
                continue
            name = self._hf_tensor_name(t.name)
            self._tensors[name] = _Tensor(t, [int(n) for n in reversed(t.dims)])
        try:
            self.config = self._config()
        except ModelConfigError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc

    # ---- metadata ----------------------------------------------------------------------

    def _field(self, key: str, default: Any = ...) -> Any:
        if key not in self._header.fields:
            if default is ...:
                raise CheckpointError(f"{self.path}: GGUF metadata {key!r} is missing")
            return default
        return self._header.fields[key]

    def _arch_field(self, key: str, default: Any = ...) -> Any:
        return self._field(f"{self.arch}.{key}", default)

    def _hf_tensor_name(self, name: str) -> str:
        if name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[name]
        match = _BLOCK.fullmatch(name)
        if match and match.group(2) in _LAYER_NAMES:
            return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
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
        cfg = ModelConfig(
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
        if self._rope_freqs is None:
            return cfg
        return dataclasses.replace(cfg, rope_scaling=self._rope_scaling(cfg))

    def _rope_scaling(self, cfg: ModelConfig) -> RopeScaling | None:
        """The ``llama3`` rope scaling ``rope_freqs.weight`` stands for (None: all ones)."""
        from gguf.quants import dequantize

        t = self._rope_freqs
        assert t is not None
        where = f"{self.path}: tensor {ROPE_FREQS!r} (per-frequency RoPE scaling)"
        try:
            divisors = np.asarray(dequantize(t.data, _qtype(t)), dtype=np.float64)
        except (NotImplementedError, ValueError) as exc:
            raise CheckpointError(f"{where} is unreadable ({exc})") from exc
        original = int(self._arch_field("rope.scaling.original_context_length", ORIGINAL_CONTEXT))
        try:
            return llama3_scaling(divisors, cfg, original)
        except ModelConfigError as exc:
            raise CheckpointError(f"{where} is not supported: {exc}") from exc

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
            arr = np.asarray(dequantize(t.raw.data, _qtype(t.raw))).reshape(t.shape)
        except NotImplementedError as exc:
            raise CheckpointError(
                f"{self.path}: tensor {t.raw.name!r}: {exc} (type {_qtype(t.raw).name})"
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

    def type_name(self, name: str) -> str:
        """The ggml type tensor ``name`` is stored in (``"Q4_1"``, ``"F32"``, ...)."""
        return str(_qtype(self._tensors[name].raw).name)

    def _matrix_rows(self, name: str) -> tuple[TensorInfo, int]:
        """A matrix's tensor, checked to hold whole blocks, and its bytes per row."""
        from spectrio.models.ops.gguf_blocks import check_tensor_bytes

        t = self._tensors[name]
        if len(t.shape) != 2:
            raise CheckpointError(f"{self.path}: tensor {t.raw.name!r} is not a matrix")
        check_tensor_bytes(t.raw.name, t.raw.ggml_type, tuple(reversed(t.shape)), t.raw.data.nbytes)
        return t.raw, t.raw.data.nbytes // t.shape[0]

    def read_blocks(self, name: str) -> np.ndarray:
        """A matrix's blocks as stored, uint8 ``[out, row bytes]`` (q/k rows of an
        interleaved-RoPE family reordered as :meth:`read` reorders them), in a new array
        filled by reading the file, so the mapping's pages are not made resident."""
        raw, row_bytes = self._matrix_rows(name)
        flat = np.empty(self._tensors[name].shape[0] * row_bytes, dtype=np.uint8)
        with open(self.path, "rb") as f:
            f.seek(self._header.offset_of(raw))
            if f.readinto(flat.data) != flat.nbytes:
                raise CheckpointError(f"{self.path}: tensor {raw.name!r} is truncated")
        out = flat.reshape(-1, row_bytes)
        if self.arch in _INTERLEAVED_ROPE and is_qk_rows(name):
            out = interleaved_to_half(out, self.config.head_dim)
        return out

    def read_rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` of matrix ``name`` (not a q/k matrix), dequantized to float32
        ``[len(ids), in]``: an embedding's rows for a step's tokens, or a draft
        vocabulary's head rows. Reading many rows at once touches most of the mapped
        matrix, so its pages are dropped again afterwards and do not stay resident."""
        from gguf.quants import dequantize

        t = self._tensors[name]
        picked = t.raw.data.reshape(t.shape[0], -1)[ids]
        out = np.asarray(dequantize(picked, _qtype(t.raw)), dtype=np.float32)
        if len(ids) >= _DROP_AFTER_ROWS:
            self.drop_mapped_pages()
        return out.reshape(len(ids), t.shape[1])

    def drop_mapped_pages(self) -> None:
        """Let the kernel drop the mapping's resident pages (they are read again on use)."""
        self._header.drop_pages()

    # ---- tokenizer -----------------------------------------------------------------------

    def tokenizer_json(self) -> str | None:
        """The vocabulary as a ``tokenizers`` JSON document, or None when the file has
        none. Refuses a vocabulary it cannot rebuild exactly (:mod:`.gguf_vocab`). Kept
        in the cache folder once built (:func:`.gguf_cache.cached_tokenizer_json`)."""
        return cached_tokenizer_json(
            self.path, lambda: gguf_vocab.tokenizer_json(self._field, self.path)
        )

    def tokenizer_config(self) -> dict[str, Any]:
        """``tokenizer_config.json`` content: the chat template and the special tokens."""
        return gguf_vocab.tokenizer_config(
            self._field, self.config.max_position_embeddings, self.chat_template
        )
