"""Model configuration with Hugging Face field names."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

from spectrio.errors import ModelConfigError

BUNDLED_DIR = Path(__file__).resolve().parent / "bundled"
"""The checkpoint shipped with spectrio (``load("bundled")``)."""

DType = Literal["float32", "float64"]
"""Compute dtypes a model runs in (float64 for exactness tests)."""

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "SpectrioMTPForCausalLM")
"""``LlamaForCausalLM`` is what spectrio writes; ``SpectrioMTPForCausalLM`` (model_type
``spectrio_mtp``) is the name of the first bundled checkpoint and still loads."""

MODEL_TYPE = "llama"
"""Checkpoints are written as Llamas, so any Llama loader (Hugging Face transformers among
them) reads the target; the MTP layer rides along as ``model.layers.{num_hidden_layers}.*``
with ``num_nextn_predict_layers: 1``, as DeepSeek-V3 stores its own, and such loaders skip
it as unused weights."""

# Fields written so a Llama loader builds exactly the model this package runs.
_LLAMA_FIELDS: dict[str, object] = {
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "rope_scaling": None,
}

# Hugging Face fields this implementation does not honour, with the only value it can
# run with; any other value is refused rather than silently ignored.
_UNSUPPORTED_UNLESS: dict[str, object] = {
    "rope_scaling": None,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "sliding_window": None,
}


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

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ModelConfigError(
                f"hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.num_nextn_predict_layers not in (0, 1):
            raise ModelConfigError(
                f"num_nextn_predict_layers must be 0 or 1, got {self.num_nextn_predict_layers}"
            )
        unknown = [a for a in self.architectures if a not in SUPPORTED_ARCHITECTURES]
        if unknown:
            raise ModelConfigError(
                f"unknown architecture {unknown[0]!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    def to_dict(self, torch_dtype: str = "float32") -> dict[str, Any]:
        """config.json content: Hugging Face Llama fields plus ``num_nextn_predict_layers``.

        ``torch_dtype`` names the dtype the weights are stored in."""
        out = dataclasses.asdict(self)
        out["architectures"] = ["LlamaForCausalLM"]
        out["model_type"] = MODEL_TYPE
        out["head_dim"] = self.head_dim
        out.update(_LLAMA_FIELDS)
        out["torch_dtype"] = torch_dtype
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.name not in raw
        ]
        if missing:
            raise ModelConfigError(
                f"config.json is missing required field(s): {', '.join(missing)}"
            )
        for name, allowed in _UNSUPPORTED_UNLESS.items():
            if raw.get(name, allowed) != allowed:
                raise ModelConfigError(f"{name}={raw[name]!r} is not supported (only {allowed!r})")
        if "head_dim" in raw and raw["head_dim"] * raw["num_attention_heads"] != raw["hidden_size"]:
            raise ModelConfigError(
                f"head_dim={raw['head_dim']} is not supported: it must equal "
                "hidden_size / num_attention_heads"
            )
        kwargs = {k: v for k, v in raw.items() if k in fields}
        # Hugging Face configs without the field have no MTP layer.
        kwargs.setdefault("num_nextn_predict_layers", 0)
        if "architectures" in kwargs:
            kwargs["architectures"] = tuple(kwargs["architectures"])
        return cls(**kwargs)

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
