"""The paged KV cache: fixed-size blocks addressed through per-sequence block tables."""

from __future__ import annotations

import numpy as np

from spectrio.models.config import DType
from spectrio.models.paddle_setup import paddle


class PagedKVCache:
    """Per-layer key and value pools of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    The pools are stored flat (``[num_blocks * block_size, ...]``) so a step's new keys
    and values are written in place with one scatter per layer; ``key(i)`` and
    ``value(i)`` give the blocked view.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: DType = "float32",
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = [num_blocks * block_size, num_kv_heads, head_dim]
        self._k = [paddle.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self._v = [paddle.zeros(shape, dtype=dtype) for _ in range(num_layers)]

    @property
    def block_shape(self) -> list[int]:
        return [self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim]

    def key(self, layer: int) -> paddle.Tensor:
        return self._k[layer].reshape(self.block_shape)

    def value(self, layer: int) -> paddle.Tensor:
        return self._v[layer].reshape(self.block_shape)

    def write(self, layer: int, slots: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor) -> None:
        """Store ``k``/``v`` ([n, kv_heads, head_dim]) at flat ``slots`` ([n])."""
        paddle.scatter_(self._k[layer], slots, k.astype(self.dtype), overwrite=True)
        paddle.scatter_(self._v[layer], slots, v.astype(self.dtype), overwrite=True)

    def gather(self, layer: int, slots: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """Read keys and values at flat ``slots`` in order ([n, kv_heads, head_dim])."""
        return (
            paddle.gather(self._k[layer], slots, axis=0),
            paddle.gather(self._v[layer], slots, axis=0),
        )

    def bytes_per_block(self) -> int:
        itemsize = np.dtype(self.dtype).itemsize
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize


def slots_for_positions(
    block_table: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """Flat cache slots of ``positions`` for a sequence whose blocks are ``block_table``."""
    positions = np.asarray(positions, dtype=np.int64)
    blocks_needed = int(positions.max()) // block_size + 1 if positions.size else 0
    if blocks_needed > len(block_table) or (positions.size and positions.min() < 0):
        raise ValueError(
            f"block table of {len(block_table)} blocks cannot hold position {int(positions.max())} "
            f"(block_size={block_size})"
        )
    table = np.asarray(block_table, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size
