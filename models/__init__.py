"""spectrio.models: the Paddle target model, its MTP layer, the paged KV cache, loading,
the tokenizer and the reference (oracle) generator.

One sub-package per job: ``architecture`` (the model), ``ops`` (the CPU ops and native
kernels it runs on), ``loading`` (checkpoints and GGUF files in and out), ``text``
(tokenizer, chat templates) and ``doubles`` (the oracle and the synthetic device: tests and
benchmarks, not serving). ``bundled/`` and ``heads/`` hold the shipped weights. The names
below are re-exported from those rooms, each imported on first use; the modules' old flat
paths (``spectrio.models.loader``, ...) still import, with a ``DeprecationWarning`` naming
the new one.
"""

from typing import TYPE_CHECKING

from spectrio._lazy import lazy_exports
from spectrio._moved import moved_modules

_EXPORTS = {
    # the module itself, through its room's lazy export (lazy_exports maps a submodule
    # only when it sits directly in the package)
    "reference": "spectrio.models.doubles",
    "PackedBatch": "spectrio.models.architecture.batch",
    "ModelConfig": "spectrio.models.architecture.config",
    "ModelConfigError": "spectrio.models.architecture.config",
    "PagedKVCache": "spectrio.models.architecture.kv_cache",
    "slots_for_positions": "spectrio.models.architecture.kv_cache",
    "BUNDLED_DIR": "spectrio.models.architecture.config",
    "CheckpointError": "spectrio.models.loading.loader",
    "LoadedModel": "spectrio.models.loading.loader",
    "load": "spectrio.models.loading.loader",
    "save_checkpoint": "spectrio.models.loading.loader",
    "ForwardOutput": "spectrio.models.architecture.model",
    "SpectrioForCausalLM": "spectrio.models.architecture.model",
    "build_model": "spectrio.models.architecture.model",
    "IncrementalDetokenizer": "spectrio.models.text.tokenizer",
    "TextTokenizer": "spectrio.models.text.tokenizer",
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

#: each module's old flat path (issue 59: one sub-package per job) -> where it lives now
_MOVED = {
    f"spectrio.models.{name}": f"spectrio.models.{room}.{name}"
    for room, names in {
        "architecture": ("batch", "config", "kv_cache", "layers", "model", "parallel"),
        "ops": (
            "cpu_paths",
            "fast_ops",
            "gguf_blocks",
            "host_state",
            "memory_floor",
            "mkl_dispatch",
            "native_ops",
            "paddle_setup",
            "serving_matrix",
            "staging",
        ),
        "loading": (
            "block_serving",
            "checkpoint",
            "convert",
            "gguf_cache",
            "gguf_file",
            "gguf_header",
            "gguf_quantize",
            "gguf_write",
            "loader",
            "mtp_head",
            "mtp_layout",
        ),
        "text": ("chat", "tokenizer"),
        "doubles": ("reference", "synthetic"),
    }.items()
    for name in names
}
moved_modules(
    _MOVED,
    {  # modules that were split: the other new modules holding some of their names
        "spectrio.models.model": (
            "spectrio.models.architecture.head",
            "spectrio.models.architecture.mtp_layer",
        ),
        "spectrio.models.gguf_file": ("spectrio.models.loading.gguf_vocab",),
    },
)

if TYPE_CHECKING:
    from spectrio.models.architecture.batch import PackedBatch
    from spectrio.models.architecture.config import BUNDLED_DIR, ModelConfig, ModelConfigError
    from spectrio.models.architecture.kv_cache import PagedKVCache, slots_for_positions
    from spectrio.models.architecture.model import ForwardOutput, SpectrioForCausalLM, build_model
    from spectrio.models.doubles import reference
    from spectrio.models.loading.loader import CheckpointError, LoadedModel, load, save_checkpoint
    from spectrio.models.text.tokenizer import IncrementalDetokenizer, TextTokenizer
