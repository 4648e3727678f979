"""The paged KV cache: fixed-size blocks addressed through per-sequence block tables."""

from __future__ import annotations

import numpy as np

from spectrio.models.architecture.config import DType
from spectrio.models.ops import fast_ops as fo
from spectrio.models.ops.native_ops import BoundLayers
from spectrio.models.ops.paddle_setup import paddle


class PagedKVCache:
    """Per-layer key and value pools, head-major: ``[num_kv_heads, num_blocks, block_size,
    head_dim]``, stored flat as ``[num_kv_heads * num_blocks * block_size, head_dim]``.

    Head-major because attention reads the context as ``[seqs, kv_heads, positions, D]``:
    gathering whole blocks of one head lands it in that layout with no transpose (a
    transpose of the gathered context cost more than the gather itself at batch 16). A
    step's new keys and values are written in place with one scatter per pool, each row
    ``(token, head)`` at :meth:`write_rows`; :meth:`gather` reads the blocks listed by
    :meth:`block_rows`.
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
        shape = [num_kv_heads * num_blocks * block_size, head_dim]
        self._k = [paddle.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self._v = [paddle.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        # Views of the same memory, one row per block and head (Paddle's reshape shares
        # storage), made once: a reshape is an op like any other.
        blocked = [num_kv_heads * num_blocks, block_size * head_dim]
        self._k_blocks = [t.reshape(blocked) for t in self._k]
        self._v_blocks = [t.reshape(blocked) for t in self._v]
        # The native layer op's arguments for the layers that last ran over these pools,
        # by layer count (SpectrioForCausalLM._bound): the target's layers, or a draft's
        # first N, or the MTP layer over its own cache.
        self.bound_layers: dict[int, BoundLayers] = {}
        heads = np.arange(num_kv_heads, dtype=np.int64)
        self._head_slots = (heads * self.num_slots)[None, :]  # for write_rows
        self._head_blocks = (heads * num_blocks)[None, :, None]  # for block_rows

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def write_rows(self, slots: np.ndarray) -> np.ndarray:
        """Pool rows ``[n * kv_heads]`` for tokens at flat ``slots`` ([n]), token-major, so
        ``k`` of shape ``[n, kv_heads, D]`` is written as it is laid out."""
        return (np.asarray(slots, dtype=np.int64)[:, None] + self._head_slots).reshape(-1)

    def block_rows(self, tables: np.ndarray) -> np.ndarray:
        """Block rows ``[B * kv_heads * W]`` of the blocked view for block ids ``tables``
        ([B, W], all valid): sequence-major, then head, then the sequence's blocks."""
        return (self._head_blocks + np.asarray(tables, dtype=np.int64)[:, None, :]).reshape(-1)

    def write(self, layer: int, rows: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor) -> None:
        """Store ``k``/``v`` ([n, kv_heads, head_dim], the cache's dtype) at pool ``rows``
        from :meth:`write_rows`."""
        d = self.head_dim
        fo.scatter_(self._k[layer], rows, fo.reshape(k, [-1, d]))
        fo.scatter_(self._v[layer], rows, fo.reshape(v, [-1, d]))

    def pools(self, layer: int) -> tuple[paddle.Tensor, paddle.Tensor]:
        """The layer's key and value pools, ``[kv_heads * num_slots, head_dim]`` each (the
        native layer op writes and reads them in place)."""
        return self._k[layer], self._v[layer]

    def gather(
        self, layer: int, blocks: paddle.Tensor, num_seqs: int, row_axis: bool = False
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """Keys and values of the blocks at ``blocks`` (from :meth:`block_rows`), as
        ``[num_seqs, kv_heads, W * block_size, head_dim]``, or with ``row_axis``
        ``[num_seqs, 1, kv_heads, W * block_size, head_dim]`` (to broadcast over query
        rows)."""
        lead = [num_seqs, 1] if row_axis else [num_seqs]
        shape = [*lead, self.num_kv_heads, -1, self.head_dim]
        return (
            fo.reshape(fo.lookup_rows(self._k_blocks[layer], blocks), shape),
            fo.reshape(fo.lookup_rows(self._v_blocks[layer], blocks), shape),
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
