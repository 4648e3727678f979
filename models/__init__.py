"""spectrio.models: the Paddle target model, its MTP layer, the paged KV cache, loading,
the tokenizer and the reference (oracle) generator."""

from spectrio.models import reference
from spectrio.models.batch import PackedBatch
from spectrio.models.config import ModelConfig, ModelConfigError
from spectrio.models.kv_cache import PagedKVCache, slots_for_positions
from spectrio.models.loader import (
    BUNDLED_DIR,
    CheckpointError,
    LoadedModel,
    load,
    save_checkpoint,
)
from spectrio.models.model import ForwardOutput, SpectrioForCausalLM, build_model
from spectrio.models.tokenizer import IncrementalDetokenizer, TextTokenizer

__all__ = [
    "BUNDLED_DIR",
    "CheckpointError",
    "ForwardOutput",
    "IncrementalDetokenizer",
    "LoadedModel",
    "ModelConfig",
    "ModelConfigError",
    "PackedBatch",
    "PagedKVCache",
    "SpectrioForCausalLM",
    "TextTokenizer",
    "build_model",
    "load",
    "reference",
    "save_checkpoint",
    "slots_for_positions",
]
