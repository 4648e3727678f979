"""spectrio.models.loading: checkpoints in and out. ``load`` (``loader``) reads Hugging Face
folders (``checkpoint``) and GGUF files (``gguf_header``, ``gguf_file``, ``gguf_vocab``),
serving a GGUF file from its blocks (``block_serving``) or from a converted folder it caches
(``gguf_cache``, ``convert``); MTP layers in each model's layout (``mtp_layout``) and heads
kept beside a model (``mtp_head``); ``spectrio quantize``'s writer (``gguf_quantize``,
``gguf_write``).

Public names: ``load``, ``LoadedModel``, ``CheckpointError``, ``save_checkpoint``,
``GGUFFile``, ``is_gguf``, ``convert_gguf``, ``write_gguf``; each imported on first use."""

from typing import TYPE_CHECKING

from spectrio._lazy import lazy_exports

_EXPORTS = {
    "load": "spectrio.models.loading.loader",
    "LoadedModel": "spectrio.models.loading.loader",
    "CheckpointError": "spectrio.models.loading.loader",
    "save_checkpoint": "spectrio.models.loading.loader",
    "GGUFFile": "spectrio.models.loading.gguf_file",
    "is_gguf": "spectrio.models.loading.gguf_file",
    "convert_gguf": "spectrio.models.loading.convert",
    "write_gguf": "spectrio.models.loading.gguf_write",
}

__all__ = [
    "CheckpointError",
    "GGUFFile",
    "LoadedModel",
    "convert_gguf",
    "is_gguf",
    "load",
    "save_checkpoint",
    "write_gguf",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from spectrio.models.loading.convert import convert_gguf
    from spectrio.models.loading.gguf_file import GGUFFile, is_gguf
    from spectrio.models.loading.gguf_write import write_gguf
    from spectrio.models.loading.loader import CheckpointError, LoadedModel, load, save_checkpoint
