"""Paged KV-cache block manager (pure: no I/O, no Trio, no Paddle).

A fixed pool of ``num_blocks`` blocks of ``block_size`` token positions each.
Every sequence owns a block table: the ordered block ids holding its positions
``0, 1, 2, ...``; position ``p`` lives in block ``table[p // block_size]`` at
offset ``p % block_size``. Free blocks are handed out lowest id first, so a
given sequence of operations always yields the same tables.

The target cache and the MTP cache each get their own instance.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator

__all__ = ["BlockManager", "BlockManagerError", "OutOfBlocks"]


class BlockManagerError(RuntimeError):
    """The block manager's bookkeeping is inconsistent (raised by ``check_invariants``)."""


class OutOfBlocks(RuntimeError):
    """Not enough free blocks to grow a sequence; nothing was allocated."""

    def __init__(self, seq_id: Hashable, needed: int, available: int) -> None:
        super().__init__(
            f"sequence {seq_id!r} needs {needed} more KV blocks, only {available} are free"
        )
        self.seq_id = seq_id
        self.needed = needed
        self.available = available


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Allocates fixed-size KV blocks to sequences, keyed by any hashable sequence id."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks: must be a positive int, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: must be a positive int, got {block_size!r}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._free: list[int] = list(range(num_blocks))  # a min-heap; sorted is a valid heap
        self._tables: dict[Hashable, list[int]] = {}

    # ------------------------------------------------------------------ sizes

    @property
    def num_blocks(self) -> int:
        """Total blocks in the pool."""
        return self._num_blocks

    @property
    def block_size(self) -> int:
        """Token positions per block."""
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks owned by no sequence."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks owned by some sequence."""
        return self._num_blocks - len(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions from scratch."""
        self._check_num_tokens(num_tokens)
        return _ceil_div(num_tokens, self._block_size)

    # -------------------------------------------------------------- sequences

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tables

    def seq_ids(self) -> Iterator[Hashable]:
        """Ids of the sequences that currently hold a table (in allocation order)."""
        return iter(list(self._tables))

    def block_table(self, seq_id: Hashable) -> list[int]:
        """A copy of ``seq_id``'s block table. Raises KeyError for an unknown sequence."""
        return list(self._tables[seq_id])

    def capacity(self, seq_id: Hashable) -> int:
        """Positions ``seq_id``'s blocks can hold (0 for an unknown sequence)."""
        return len(self._tables.get(seq_id, ())) * self._block_size

    def slot(self, seq_id: Hashable, position: int) -> int:
        """Flat cache slot of token ``position``: ``table[p // bs] * bs + p % bs``.

        Raises IndexError when the position lies beyond the allocated blocks.
        """
        table = self._tables[seq_id]
        if position < 0 or position >= len(table) * self._block_size:
            raise IndexError(
                f"position {position} of sequence {seq_id!r} is outside its "
                f"{len(table)} allocated blocks"
            )
        block, offset = divmod(position, self._block_size)
        return table[block] * self._block_size + offset

    def slots(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Flat cache slots of positions ``start .. end - 1``."""
        return [self.slot(seq_id, p) for p in range(start, end)]

    # ------------------------------------------------------------- allocation

    def blocks_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        """More blocks ``seq_id`` needs to hold ``num_tokens`` positions (0 if it already can)."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, self.blocks_for_tokens(num_tokens) - have)

    def can_allocate(self, seq_id: Hashable, num_tokens: int) -> bool:
        """True when ``allocate(seq_id, num_tokens)`` would succeed."""
        return self.blocks_needed(seq_id, num_tokens) <= len(self._free)

    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Grow ``seq_id``'s table until it holds ``num_tokens`` positions.

        Registers an unknown sequence. Never shrinks a table. Returns the block
        ids added (lowest free ids first, possibly none). Raises
        :class:`OutOfBlocks`, allocating nothing, when too few blocks are free.
        """
        needed = self.blocks_needed(seq_id, num_tokens)
        if needed > len(self._free):
            raise OutOfBlocks(seq_id, needed, len(self._free))
        new = [heapq.heappop(self._free) for _ in range(needed)]
        self._tables.setdefault(seq_id, []).extend(new)
        return new

    def free(self, seq_id: Hashable) -> int:
        """Return every block of ``seq_id`` to the pool and forget it.

        Idempotent: freeing an unknown or already freed sequence returns 0.
        Returns the number of blocks freed.
        """
        table = self._tables.pop(seq_id, None)
        if not table:
            return 0
        for block in table:
            heapq.heappush(self._free, block)
        return len(table)

    # ------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Raise :class:`BlockManagerError` unless every block is either free or owned
        by exactly one sequence, once, and the free list is a valid min-heap."""
        owner: dict[int, Hashable] = {}
        for seq_id, table in self._tables.items():
            for block in table:
                if not 0 <= block < self._num_blocks:
                    raise BlockManagerError(f"sequence {seq_id!r} owns out-of-range block {block}")
                if block in owner:
                    raise BlockManagerError(
                        f"block {block} is owned by both {owner[block]!r} and {seq_id!r}"
                    )
                owner[block] = seq_id
        free_set: set[int] = set()
        for block in self._free:
            if not 0 <= block < self._num_blocks:
                raise BlockManagerError(f"free list holds out-of-range block {block}")
            if block in free_set:
                raise BlockManagerError(f"block {block} is on the free list twice")
            if block in owner:
                raise BlockManagerError(f"block {block} is free but owned by {owner[block]!r}")
            free_set.add(block)
        lost = self._num_blocks - len(owner) - len(free_set)
        if lost:
            missing = sorted(set(range(self._num_blocks)) - free_set - owner.keys())
            raise BlockManagerError(f"{lost} blocks are neither free nor owned: {missing[:16]}")
        heap = self._free
        for i in range(1, len(heap)):
            if heap[(i - 1) // 2] > heap[i]:
                raise BlockManagerError("free list is not a min-heap")

    # ---------------------------------------------------------------- helpers

    @staticmethod
    def _check_num_tokens(num_tokens: int) -> None:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens: must be a non-negative int, got {num_tokens!r}")

    def __repr__(self) -> str:
        return (
            f"BlockManager(num_blocks={self._num_blocks}, block_size={self._block_size}, "
            f"free={len(self._free)}, seqs={len(self._tables)})"
        )
