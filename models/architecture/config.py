"""Model configuration with Hugging Face field names.

One decoder runs every supported family; a family is a set of switches on it:

========================  ===========  =====================================================
architecture              family       switches
========================  ===========  =====================================================
``LlamaForCausalLM``      ``llama``    ``attention_bias`` (q/k/v/o), ``mlp_bias``,
                                       ``rope_scaling`` (``linear``, ``dynamic``, ``llama3``)
``Qwen2ForCausalLM``      ``qwen2``    q/k/v bias always, o without
``Qwen3ForCausalLM``      ``qwen3``    per-head RMSNorm of q and k (``q_norm``/``k_norm``),
                                       ``attention_bias``
``Ernie4_5ForCausalLM``   ``ernie4_5`` ``use_bias`` (every linear), interleaved RoPE pairs
                                       (the loader permutes q/k rows into rotate-half order)
``MiMoForCausalLM``       ``mimo``     Qwen2's decoder (q/k/v bias always, o without); its
                                       MTP layer in MiMo's layout
========================  ===========  =====================================================

Where a checkpoint keeps its MTP layer (DeepSeek-V3's, MiMo's or ERNIE 4.5's names) is
:mod:`spectrio.models.loading.mtp_layout`'s business; the loader records it in ``mtp_layout``.

:meth:`ModelConfig.from_dict` reads a ``config.json`` strictly: every field is either
used, known not to change the forward pass (``_INERT``), or refused with a message
naming it. A checkpoint is never loaded as a different model than it is.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Literal

import numpy as np

from spectrio.errors import ModelConfigError
from spectrio.models.loading.mtp_layout import LAYOUTS, MTPLayoutName

BUNDLED_DIR = Path(__file__).resolve().parents[1] / "bundled"  # models/bundled
"""The checkpoint shipped with spectrio (``load("bundled")``)."""

DType = Literal["float32", "float64"]
"""Compute dtypes a model runs in (float64 for exactness tests)."""

Family = Literal["llama", "qwen2", "qwen3", "ernie4_5", "mimo"]

ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": "llama",
    # The name of the first bundled checkpoint (model_type ``spectrio_mtp``): a Llama.
    "SpectrioMTPForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Ernie4_5ForCausalLM": "ernie4_5",
    "MiMoForCausalLM": "mimo",
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

_ARCH_OF: dict[Family, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "mimo": "MiMoForCausalLM",
}

MODEL_TYPE = "llama"
"""Checkpoints spectrio trains are written as Llamas, so any Llama loader (Hugging Face
transformers among them) reads the target; the MTP layer rides along as
``model.layers.{num_hidden_layers}.*`` with ``num_nextn_predict_layers: 1``, as DeepSeek-V3
stores its own, and such loaders skip it as unused weights."""

# Each family's defaults for fields a config.json may leave out: the values Hugging Face's
# config class of the family uses, so an absent field means what it means there.
_FAMILY_DEFAULTS: dict[Family, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "max_position_embeddings": 2048},
    "qwen2": {"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "max_position_embeddings": 32768},
    "qwen3": {"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "max_position_embeddings": 32768},
    "ernie4_5": {"tie_word_embeddings": True, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                 "max_position_embeddings": 131072},
    # MiMo's config class is Qwen2's with num_nextn_predict_layers added.
    "mimo": {"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
             "max_position_embeddings": 32768},
}  # fmt: skip

# Fields that do not change the forward pass of a causal LM at inference: bookkeeping,
# training-only settings (dropout, init), token ids the tokenizer owns, generation
# defaults, and implementation toggles.
_INERT = frozenset(
    {
        "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype",
        "dtype", "use_cache", "initializer_range", "pad_token_id", "attention_dropout",
        "pretraining_tp", "auto_map", "output_attentions", "output_hidden_states",
        "return_dict", "id2label", "label2id", "problem_type", "tokenizer_class",
        "is_encoder_decoder", "bad_words_ids", "chunk_size_feed_forward", "max_length",
        "min_length", "do_sample", "num_beams", "temperature", "top_k", "top_p",
        "repetition_penalty", "length_penalty", "decoder_start_token_id", "sep_token_id",
        "use_flash_attention", "tie_encoder_decoder", "torchscript", "finetuning_task",
        "task_specific_params", "prefix", "cross_attention_hidden_size",
        "add_cross_attention", "use_bfloat16", "output_scores",
        "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
        "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
        "begin_suppress_tokens", "typical_p", "num_return_sequences", "early_stopping",
        "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "diversity_penalty",
        "num_beam_groups", "pruned_heads", "tf_legacy_loss",
        "max_window_layers",  # which layers slide: moot while use_sliding_window is false
        "multi_token_pred_lambda",  # ERNIE's MTP loss weight in training
    }
)  # fmt: skip

# Fields that each family reads (besides the common ones); another family's field is
# refused as not implemented for this one.
_FAMILY_FIELDS: dict[Family, frozenset[str]] = {
    "llama": frozenset({"attention_bias", "mlp_bias"}),
    "qwen2": frozenset({"use_sliding_window", "sliding_window", "layer_types"}),
    "qwen3": frozenset({"attention_bias", "use_sliding_window", "sliding_window", "layer_types"}),
    "ernie4_5": frozenset({"use_bias", "use_rmsnorm"}),
    # MiMo-7B's config.json carries attention_bias, but its decoder is Qwen2's, whose q/k/v
    # bias is always on and o bias always off whatever the field says (transformers'
    # Qwen2Attention, and vLLM's and SGLang's MiMo). A stored bias spectrio does not
    # expect is refused as an unexpected tensor, so the field cannot mislead the loader.
    "mimo": frozenset({"use_sliding_window", "sliding_window", "layer_types", "attention_bias"}),
}

_COMMON_FIELDS = frozenset(
    {
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "intermediate_size", "max_position_embeddings", "rope_theta",
        "rms_norm_eps", "tie_word_embeddings", "num_nextn_predict_layers", "bos_token_id",
        "eos_token_id", "head_dim", "hidden_act", "rope_scaling", "rope_parameters",
        "partial_rotary_factor", "sliding_window",
    }
)  # fmt: skip

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
"""RoPE scaling types the decoder implements (Hugging Face ``rope_type`` names)."""

# The keys each RoPE type reads from ``rope_scaling`` / ``rope_parameters``.
_ROPE_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling rule, as Hugging Face's ``rope_scaling`` names its parts.

    * ``linear``: every inverse frequency divided by ``factor`` (positions stretched).
    * ``dynamic`` (NTK): the base grows with the sequence length, but only past
      ``max_position_embeddings``; below it the frequencies are the unscaled ones. spectrio
      serves at most ``max_position_embeddings`` positions of such a model, where the two
      agree exactly, and refuses a position beyond (see :meth:`ModelConfig.position_limit`).
    * ``llama3``: Llama 3.1's band rule: wavelengths above
      ``original_max_position_embeddings / low_freq_factor`` divided by ``factor``, below
      ``... / high_freq_factor`` kept, and a smooth blend in between.
    """

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": self.rope_type}
        for key in sorted(_ROPE_KEYS[self.rope_type]):
            out[key] = getattr(self, key)
        return out


def _parse_rope(raw: dict[str, Any]) -> tuple[float | None, RopeScaling | None]:
    """``(rope_theta or None, scaling or None)`` from ``rope_scaling`` (with a top-level
    ``rope_theta``) or ``rope_parameters`` (transformers 5: theta inside)."""
    theta: float | None = raw.get("rope_theta")
    spec = raw.get("rope_scaling")
    where = "rope_scaling"
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ModelConfigError(
                f"rope_parameters={params!r} is not supported (expected an object)"
            )
        if spec is not None and spec != params:
            raise ModelConfigError("rope_scaling and rope_parameters disagree; keep one")
        spec, where = dict(params), "rope_parameters"
        if "rope_theta" in spec:
            theta = spec.pop("rope_theta")
    if spec is None:
        return theta, None
    if not isinstance(spec, dict):
        raise ModelConfigError(f"{where}={spec!r} is not supported (expected an object or null)")
    spec = dict(spec)
    kind = spec.pop("rope_type", None) or spec.pop("type", None) or "default"
    spec.pop("type", None)
    if kind not in ROPE_TYPES:
        raise ModelConfigError(
            f"{where} type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    partial = spec.pop("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ModelConfigError(f"partial_rotary_factor={partial!r} is not supported (only 1.0)")
    extra = sorted(set(spec) - _ROPE_KEYS[kind])
    if extra:
        raise ModelConfigError(
            f"{where} field {extra[0]!r} is not supported for rope type {kind!r}"
        )
    if kind == "default":
        return theta, None
    if "factor" not in spec:
        raise ModelConfigError(f"{where} type {kind!r} needs 'factor'")
    values = {k: spec[k] for k in _ROPE_KEYS[kind] if k in spec}
    if kind == "llama3":
        missing = sorted(_ROPE_KEYS[kind] - set(values))
        if missing:
            raise ModelConfigError(f"{where} type 'llama3' needs {missing[0]!r}")
    for key, value in values.items():
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise ModelConfigError(f"{where}.{key} must be a positive number, got {value!r}")
    if kind == "llama3" and values["high_freq_factor"] <= values["low_freq_factor"]:
        raise ModelConfigError(f"{where}: high_freq_factor must exceed low_freq_factor")
    return theta, RopeScaling(rope_type=kind, **values)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    num_nextn_predict_layers: int = 1
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    architectures: tuple[str, ...] = ("LlamaForCausalLM",)
    #: size of one attention head; None means ``hidden_size // num_attention_heads``
    #: (filled in at construction, so it is always an int afterwards)
    head_dim: int = None  # type: ignore[assignment]
    rope_scaling: RopeScaling | None = None
    #: bias on q/k/v/o (Llama, Qwen3 ``attention_bias``; ERNIE ``use_bias``)
    attention_bias: bool = False
    #: bias on gate/up/down (Llama ``mlp_bias``; ERNIE ``use_bias``)
    mlp_bias: bool = False
    #: every token id that ends generation (a config's ``eos_token_id`` list); the first
    #: is ``eos_token_id``
    eos_token_ids: tuple[int, ...] = ()
    #: where the checkpoint keeps its MTP layer and how that layer is wired
    #: (:mod:`spectrio.models.loading.mtp_layout`). Not a config.json field: the loader reads it
    #: off the tensor names, so it is always the layout of the weights in hand.
    mtp_layout: MTPLayoutName = "deepseek"

    def __post_init__(self) -> None:
        if self.head_dim is None:
            heads = self.num_attention_heads
            if isinstance(heads, int) and heads > 0 and self.hidden_size % heads:
                raise ModelConfigError(
                    f"hidden_size ({self.hidden_size}) must be divisible by "
                    f"num_attention_heads ({heads}) when head_dim is not given"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // max(heads, 1))
        if self.eos_token_id is not None and not self.eos_token_ids:
            object.__setattr__(self, "eos_token_ids", (self.eos_token_id,))
        positive = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "max_position_embeddings",
            "head_dim",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.mtp_layout not in LAYOUTS:
            raise ModelConfigError(
                f"mtp_layout must be one of {', '.join(LAYOUTS)}, got {self.mtp_layout!r}"
            )
        if self.num_nextn_predict_layers not in (0, 1):
            raise ModelConfigError(
                f"num_nextn_predict_layers must be 0 or 1, got {self.num_nextn_predict_layers}"
            )
        unknown = [a for a in self.architectures if a not in ARCHITECTURES]
        if unknown:
            raise ModelConfigError(
                f"unknown architecture {unknown[0]!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if len({ARCHITECTURES[a] for a in self.architectures}) > 1:
            raise ModelConfigError(f"architectures {list(self.architectures)} name two families")

    # ---- the switches ------------------------------------------------------------------

    @property
    def family(self) -> Family:
        return ARCHITECTURES[self.architectures[0]] if self.architectures else "llama"

    @property
    def qkv_bias(self) -> bool:
        """q, k and v projections carry a bias (Qwen2 and MiMo always)."""
        return self.attention_bias or self.family in ("qwen2", "mimo")

    @property
    def o_bias(self) -> bool:
        return self.attention_bias

    @property
    def qk_norm(self) -> bool:
        """RMSNorm over each head of q and of k before RoPE (Qwen3)."""
        return self.family == "qwen3"

    @property
    def rope_interleaved(self) -> bool:
        """The checkpoint rotates adjacent pairs ``(2i, 2i+1)`` (ERNIE 4.5); the decoder
        rotates ``(i, i + D/2)``, so the loader permutes q/k rows between the two."""
        return self.family == "ernie4_5"

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies ``[head_dim / 2]`` in float64, scaling applied."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        rs = self.rope_scaling
        if rs is None or rs.rope_type == "dynamic":
            return inv  # dynamic equals unscaled within max_position_embeddings
        if rs.rope_type == "linear":
            return inv / rs.factor
        # llama3
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        blended = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, blended, scaled)

    @property
    def position_limit(self) -> int | None:
        """The first position this model cannot run, or None when RoPE extends past
        ``max_position_embeddings`` unchanged (dynamic NTK scaling changes every
        frequency there, so it stops at the limit)."""
        rs = self.rope_scaling
        return self.max_position_embeddings if rs and rs.rope_type == "dynamic" else None

    # ---- config.json ---------------------------------------------------------------------

    def to_dict(self, torch_dtype: str = "float32") -> dict[str, Any]:
        """config.json content: the family's Hugging Face fields plus
        ``num_nextn_predict_layers``. ``torch_dtype`` names the dtype the weights are
        stored in."""
        family = self.family
        out: dict[str, Any] = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (
                list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_id
            ),
            "architectures": [_ARCH_OF[family]],
            "model_type": family,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_dict(),
            "torch_dtype": torch_dtype,
        }
        if family in ("llama", "qwen3"):
            out["attention_bias"] = self.attention_bias
        if family == "llama":
            out["mlp_bias"] = self.mlp_bias
        if family in ("qwen2", "qwen3", "mimo"):
            out["use_sliding_window"] = False
        if family == "ernie4_5":
            out["use_bias"] = self.attention_bias
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or ["LlamaForCausalLM"]
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ModelConfigError(f"architectures must be a list of names, got {archs!r}")
        unknown = [a for a in archs if a not in ARCHITECTURES]
        if unknown:
            raise ModelConfigError(
                f"unknown architecture {unknown[0]!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = ARCHITECTURES[archs[0]]
        allowed = _COMMON_FIELDS | _FAMILY_FIELDS[family] | _INERT
        for name in raw:
            if name not in allowed:
                other = [f for f, fields in _FAMILY_FIELDS.items() if name in fields]
                why = f" (a {other[0]} field)" if other else ""
                raise ModelConfigError(
                    f"config field {name!r}{why} is not implemented for {archs[0]}; "
                    "refusing to load a model that may compute something else"
                )
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size")  # fmt: skip
        missing = [name for name in required if name not in raw]
        if missing:
            raise ModelConfigError(
                f"config.json is missing required field(s): {', '.join(missing)}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"hidden_act={act!r} is not supported (only 'silu')")
        _refuse_sliding(raw, family)
        if family == "ernie4_5" and raw.get("use_rmsnorm", True) is not True:
            raise ModelConfigError(
                f"use_rmsnorm={raw['use_rmsnorm']!r} is not supported (only True)"
            )
        if raw.get("partial_rotary_factor", 1.0) != 1.0:
            raise ModelConfigError(
                f"partial_rotary_factor={raw['partial_rotary_factor']!r} is not supported "
                "(only 1.0)"
            )
        theta, scaling = _parse_rope(raw)
        defaults = _FAMILY_DEFAULTS[family]
        if family == "ernie4_5":
            bias = _flag(raw, "use_bias")
            attention_bias, mlp_bias = bias, bias
        elif family == "mimo":
            _flag(raw, "attention_bias")  # checked, then ignored (see _FAMILY_FIELDS)
            attention_bias, mlp_bias = False, False
        else:
            attention_bias, mlp_bias = _flag(raw, "attention_bias"), _flag(raw, "mlp_bias")
        eos = raw.get("eos_token_id")
        eos_ids: tuple[int, ...] = ()
        if isinstance(eos, list):
            eos_ids = tuple(int(e) for e in eos)
            eos = eos_ids[0] if eos_ids else None
        kv_heads = raw.get("num_key_value_heads")
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw["num_attention_heads"] if kv_heads is None else kv_heads,
            intermediate_size=raw["intermediate_size"],
            max_position_embeddings=raw.get(
                "max_position_embeddings", defaults["max_position_embeddings"]
            ),
            rope_theta=float(theta if theta is not None else defaults["rope_theta"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", defaults["rms_norm_eps"])),
            tie_word_embeddings=bool(
                raw.get("tie_word_embeddings", defaults["tie_word_embeddings"])
            ),
            # Hugging Face configs without the field have no MTP layer.
            num_nextn_predict_layers=raw.get("num_nextn_predict_layers", 0),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos,
            eos_token_ids=eos_ids,
            architectures=tuple(archs),
            head_dim=raw.get("head_dim"),  # type: ignore[arg-type]  # None: derived
            rope_scaling=scaling,
            attention_bias=attention_bias,
            mlp_bias=mlp_bias,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelConfigError(f"cannot read model config {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise ModelConfigError(f"{path}: expected a JSON object")
        return cls.from_dict(raw)

    def save(self, path: str | Path, torch_dtype: str = "float32") -> None:
        Path(path).write_text(json.dumps(self.to_dict(torch_dtype), indent=2) + "\n")


def _flag(raw: dict[str, Any], name: str) -> bool:
    value = raw.get(name, False)
    if not isinstance(value, bool):
        raise ModelConfigError(f"{name}={value!r} is not supported (expected true or false)")
    return value


def _refuse_sliding(raw: dict[str, Any], family: Family) -> None:
    """Sliding-window attention is not implemented: refuse a config that turns it on."""
    if family in ("qwen2", "qwen3", "mimo"):
        if raw.get("use_sliding_window", False):
            raise ModelConfigError(
                "use_sliding_window=True is not supported (sliding-window attention)"
            )
        kinds = set(raw.get("layer_types") or ["full_attention"])
        if kinds != {"full_attention"}:
            other = sorted(kinds - {"full_attention"})[0]
            raise ModelConfigError(f"layer_types with {other!r} layers are not supported")
    elif raw.get("sliding_window") is not None:
        raise ModelConfigError(
            f"sliding_window={raw['sliding_window']!r} is not supported (only null)"
        )
