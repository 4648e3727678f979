"""spectrio.models.architecture: the model itself, in Paddle. One decoder with switches runs
every family (``config``), packed rows over a paged KV cache (``batch``, ``kv_cache``), its
layers (``layers``), output head (``head``) and MTP layer (``mtp_layer``), the whole model
(``model``) and its tensor-parallel shards (``parallel``).

Public names: ``ModelConfig``, ``RopeScaling``, ``BUNDLED_DIR``, ``PackedBatch``,
``PagedKVCache``, ``slots_for_positions``, ``ForwardOutput``, ``SpectrioForCausalLM``,
``MTPLayer``, ``build_model``, ``TPShard``, ``load_sharded``; each imported on first use,
so that importing the package imports no Paddle."""

from typing import TYPE_CHECKING

from spectrio._lazy import lazy_exports

_EXPORTS = {
    "BUNDLED_DIR": "spectrio.models.architecture.config",
    "ModelConfig": "spectrio.models.architecture.config",
    "RopeScaling": "spectrio.models.architecture.config",
    "PackedBatch": "spectrio.models.architecture.batch",
    "PagedKVCache": "spectrio.models.architecture.kv_cache",
    "slots_for_positions": "spectrio.models.architecture.kv_cache",
    "ForwardOutput": "spectrio.models.architecture.model",
    "SpectrioForCausalLM": "spectrio.models.architecture.model",
    "build_model": "spectrio.models.architecture.model",
    "MTPLayer": "spectrio.models.architecture.mtp_layer",
    "TPShard": "spectrio.models.architecture.parallel",
    "load_sharded": "spectrio.models.architecture.parallel",
}

__all__ = [
    "BUNDLED_DIR",
    "ForwardOutput",
    "MTPLayer",
    "ModelConfig",
    "PackedBatch",
    "PagedKVCache",
    "RopeScaling",
    "SpectrioForCausalLM",
    "TPShard",
    "build_model",
    "load_sharded",
    "slots_for_positions",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from spectrio.models.architecture.batch import PackedBatch
    from spectrio.models.architecture.config import BUNDLED_DIR, ModelConfig, RopeScaling
    from spectrio.models.architecture.kv_cache import PagedKVCache, slots_for_positions
    from spectrio.models.architecture.model import ForwardOutput, SpectrioForCausalLM, build_model
    from spectrio.models.architecture.mtp_layer import MTPLayer
    from spectrio.models.architecture.parallel import TPShard, load_sharded
