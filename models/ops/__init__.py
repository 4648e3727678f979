"""spectrio.models.ops: the CPU ops the serving forward runs on. Paddle imported once and set
up (``paddle_setup``, with ``host_state`` and ``mkl_dispatch``), Paddle's eager ops bound
directly (``fast_ops``), spectrio's own C++ kernels (``native_ops`` over ``csrc/``, built once
per machine for the path ``cpu_paths`` picks; every kernel has a Paddle fallback), weights
as the kernels multiply by them (``serving_matrix``, ``gguf_blocks``), input staging
(``staging``) and the forward's memory floor (``memory_floor``).

Public names: ``configure_paddle``, ``native_ops_available``, ``ServingMatrix``,
``Staging``, ``BLOCK_TYPES``; each imported on first use (most import Paddle)."""

from typing import TYPE_CHECKING

from spectrio._lazy import lazy_exports

_EXPORTS = {
    "configure_paddle": "spectrio.models.ops.paddle_setup",
    "native_ops_available": "spectrio.models.ops.native_ops",
    "ServingMatrix": "spectrio.models.ops.serving_matrix",
    "Staging": "spectrio.models.ops.staging",
    "BLOCK_TYPES": "spectrio.models.ops.gguf_blocks",
}

__all__ = [
    "BLOCK_TYPES",
    "ServingMatrix",
    "Staging",
    "configure_paddle",
    "native_ops_available",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from spectrio.models.ops.gguf_blocks import BLOCK_TYPES
    from spectrio.models.ops.native_ops import native_ops_available
    from spectrio.models.ops.paddle_setup import configure_paddle
    from spectrio.models.ops.serving_matrix import ServingMatrix
    from spectrio.models.ops.staging import Staging
