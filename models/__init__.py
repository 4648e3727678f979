"""spectrio.models: the Paddle target model, its MTP layer, the paged KV cache, loading,
the tokenizer and the reference (oracle) generator."""

from typing import TYPE_CHECKING

from spectrio._lazy import lazy_exports

_EXPORTS = {
    "reference": "spectrio.models.reference",
    "PackedBatch": "spectrio.models.batch",
    "ModelConfig": "spectrio.models.config",
    "ModelConfigError": "spectrio.models.config",
    "PagedKVCache": "spectrio.models.kv_cache",
    "slots_for_positions": "spectrio.models.kv_cache",
    "BUNDLED_DIR": "spectrio.models.config",
    "CheckpointError": "spectrio.models.loader",
    "LoadedModel": "spectrio.models.loader",
    "load": "spectrio.models.loader",
    "save_checkpoint": "spectrio.models.loader",
    "ForwardOutput": "spectrio.models.model",
    "SpectrioForCausalLM": "spectrio.models.model",
    "build_model": "spectrio.models.model",
    "IncrementalDetokenizer": "spectrio.models.tokenizer",
    "TextTokenizer": "spectrio.models.tokenizer",
}

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

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from spectrio.models import reference
    from spectrio.models.batch import PackedBatch
    from spectrio.models.config import BUNDLED_DIR, ModelConfig, ModelConfigError
    from spectrio.models.kv_cache import PagedKVCache, slots_for_positions
    from spectrio.models.loader import CheckpointError, LoadedModel, load, save_checkpoint
    from spectrio.models.model import ForwardOutput, SpectrioForCausalLM, build_model
    from spectrio.models.tokenizer import IncrementalDetokenizer, TextTokenizer
