"""Paged KV-cache block manager with prefix caching (pure: no I/O, no Trio, no Paddle).

A fixed pool of ``num_blocks`` blocks of ``block_size`` token positions each.
Every sequence owns a block table: the ordered block ids holding its positions
``0, 1, 2, ...``; position ``p`` lives in block ``table[p // block_size]`` at
offset ``p % block_size``. The target cache and a draft method's cache (MTP) share
the table, so a block id names both caches' entries for those positions.

**Prefix caching** (``enable_caching=True``). A *full* block whose KV is final can be
registered under a chained hash (:func:`block_hash`) of its parent block's hash, its
token ids and the sequence's :class:`PrefixKey` (cache salt, lookahead). Another
sequence whose tokens hash the same way shares the block instead of computing it:
:meth:`match` finds the longest chain of registered blocks, and :meth:`allocate`
with ``prefix=`` takes a reference on each. Blocks are reference-counted; a block no
table holds is *free* if it is not registered, or *cached* if it is. Cached blocks
stay readable until an allocation finds no free block: then the least recently
released one is evicted (its hash forgotten) and handed out.

Invariants (:meth:`check_invariants`): every block is exactly one of free,
cached (refcount 0, registered), or held (refcount = the number of tables listing
it); a table never lists a block twice; the hash map and the block-to-hash map are
inverse. :meth:`free` decrements references and never releases a block another
table still holds.

Free blocks are handed out lowest id first, and cached ones least recently released
first, so a given sequence of operations always yields the same tables.

**Promises.** A sequence admitted to compute prompt blocks that are not cached yet can
:meth:`promise` them: their hashes are known from the prompt before any KV exists.
:meth:`lookup` then tells a later sequence how many blocks past its hit a running
sequence is computing right now, so the scheduler may let it wait for them instead of
computing the same prefix a second time. A promise is only a hint: it ends when the
block is registered or the promising sequence is freed (finished, aborted, preempted).

This class does not know when a step in flight reads a block; the scheduler keeps that
promise (``stages/planning/scheduler.py``): blocks are registered only after the step that wrote
them has returned, and the device runs steps in plan order, so a block evicted and
rewritten by step N+1 is read by earlier steps only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence

import numpy as np

__all__ = [
    "BlockManager",
    "BlockManagerError",
    "OutOfBlocks",
    "PrefixKey",
    "PrefixStats",
    "block_hash",
]


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


@dataclasses.dataclass(frozen=True)
class PrefixKey:
    """What besides its tokens a block's KV identity depends on.

    ``salt``: the request's cache salt; blocks of different salts never match.
    ``lookahead``: tokens after a block that its KV also depends on. The MTP layer's KV
    at position ``p`` reads the token at ``p + 1``, so a block whose draft KV is cached
    with it depends on the first token of the next block (1); a target-only block on
    nothing more (0).
    ``draft``: the draft method whose KV the block carries besides the target's ("":
    none). Keys that differ in any field never share a chain: their root hashes differ.
    """

    salt: str = ""
    lookahead: int = 0
    draft: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.salt, str):
            raise TypeError(f"salt: must be a str, got {type(self.salt).__name__}")
        if not isinstance(self.draft, str):
            raise TypeError(f"draft: must be a str, got {type(self.draft).__name__}")
        if self.lookahead not in (0, 1):
            raise ValueError(f"lookahead: must be 0 or 1, got {self.lookahead!r}")

    def root(self) -> bytes:
        """The parent hash of a sequence's first block."""
        draft = f"/draft:{self.draft}" if self.draft else ""
        return hashlib.blake2b(
            f"spectrio-prefix/{self.lookahead}/{self.salt}{draft}".encode(), digest_size=16
        ).digest()


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The chained hash of one block: parent block's hash (or the key's root) and the
    block's token ids, lookahead included. A 128-bit cryptographic hash, so a crafted
    prompt cannot collide with another's block."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


@dataclasses.dataclass
class PrefixStats:
    """Prefix-cache counters since start (tokens and blocks)."""

    queries: int = 0  # tokens looked up (a sequence's context, each time it is admitted)
    hits: int = 0  # of which found in the cache
    evictions: int = 0  # cached blocks evicted to make room

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Allocates fixed-size KV blocks to sequences, keyed by any hashable sequence id."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = False) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks: must be a positive int, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: must be a positive int, got {block_size!r}")
        if not isinstance(enable_caching, bool):
            raise ValueError(f"enable_caching: must be a bool, got {enable_caching!r}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self.caching = enable_caching
        self._free: list[int] = list(range(num_blocks))  # a min-heap; sorted is a valid heap
        self._tables: dict[Hashable, list[int]] = {}
        self._refs: list[int] = [0] * num_blocks
        self._cached: dict[bytes, int] = {}  # hash -> registered block
        self._hash_of: dict[int, bytes] = {}  # registered block -> its hash
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, oldest first
        # Per sequence: the chain hashes of its leading full blocks computed so far (a
        # block it holds is registered under the hash, or a twin already was).
        self._chains: dict[Hashable, list[bytes]] = {}
        self._promised: dict[bytes, Hashable] = {}  # hash -> the sequence computing it
        self._promises: dict[Hashable, list[bytes]] = {}  # sequence -> hashes it promised
        self.stats = PrefixStats()

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
        """Blocks no sequence holds: free, or cached (evicted when needed)."""
        return len(self._free) + len(self._lru)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some sequence holds."""
        return self._num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks, held or not."""
        return len(self._hash_of)

    @property
    def num_evictable_blocks(self) -> int:
        """Registered blocks no sequence holds."""
        return len(self._lru)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions from scratch."""
        self._check_num_tokens(num_tokens)
        return _ceil_div(num_tokens, self._block_size)

    def ref_count(self, block: int) -> int:
        """Tables that list ``block``."""
        return self._refs[block]

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

    # ---------------------------------------------------------- prefix cache

    def match(self, token_ids: Sequence[int], key: PrefixKey, max_tokens: int) -> list[int]:
        """The registered blocks holding the longest cached prefix of ``token_ids``
        (at most ``max_tokens`` positions, whole blocks only): block ``i`` of the answer
        holds positions ``i * block_size ..``. Takes no reference and changes nothing;
        always [] with caching off. A block's lookahead tokens must be in ``token_ids``."""
        return self.lookup(token_ids, key, max_tokens)[0]

    def lookup(
        self, token_ids: Sequence[int], key: PrefixKey, max_tokens: int
    ) -> tuple[list[int], int]:
        """:meth:`match`, and how many blocks right after the hit other sequences have
        promised (:meth:`promise`): blocks being computed now that would extend the hit."""
        if not self.caching:
            return [], 0
        found: list[int] = []
        promised = 0
        for h in self._hashes(token_ids, key, max_tokens):
            block = self._cached.get(h)
            if block is not None and not promised:
                found.append(block)
            elif h in self._promised:
                promised += 1
            else:
                break
        return found, promised

    def promise(
        self, seq_id: Hashable, token_ids: Sequence[int], key: PrefixKey, num_tokens: int
    ) -> int:
        """Announce that ``seq_id`` (which holds a table) will :meth:`register` its full
        blocks among positions ``0 .. num_tokens - 1`` of ``token_ids``; returns how many
        were neither cached nor promised already. Ends with :meth:`free`."""
        if not self.caching:
            return 0
        mine = self._promises.setdefault(seq_id, [])
        for h in self._hashes(token_ids, key, num_tokens):
            if h not in self._cached and h not in self._promised:
                self._promised[h] = seq_id
                mine.append(h)
        return len(mine)

    def _hashes(self, token_ids: Sequence[int], key: PrefixKey, max_tokens: int) -> Iterator[bytes]:
        """The chain hashes of the full blocks of ``token_ids`` within ``max_tokens``
        positions whose lookahead tokens are known."""
        bs = self._block_size
        limit = min(max_tokens, len(token_ids) - key.lookahead) // bs
        parent = key.root()
        for b in range(max(0, limit)):
            parent = block_hash(parent, token_ids[b * bs : (b + 1) * bs + key.lookahead])
            yield parent

    def note_lookup(self, queried: int, hit: int) -> None:
        """Count one admission's lookup: ``queried`` context tokens, ``hit`` of them cached."""
        self.stats.queries += queried
        self.stats.hits += hit

    def register(
        self, seq_id: Hashable, token_ids: Sequence[int], key: PrefixKey, num_tokens: int
    ) -> int:
        """Register ``seq_id``'s full blocks among positions ``0 .. num_tokens - 1`` whose
        KV is final: the caller promises that a completed step wrote it, for the tokens
        ``token_ids`` (lookahead tokens included). A block whose hash is already
        registered (a twin computed at the same time) stays private. Returns the
        blocks newly registered; 0 with caching off."""
        if not self.caching:
            return 0
        table = self._tables[seq_id]
        bs = self._block_size
        chain = self._chains.setdefault(seq_id, [])
        full = min(num_tokens, len(token_ids) - key.lookahead) // bs
        full = min(full, len(table))
        added = 0
        parent = chain[-1] if chain else key.root()
        for b in range(len(chain), full):
            parent = block_hash(parent, token_ids[b * bs : (b + 1) * bs + key.lookahead])
            chain.append(parent)
            block = table[b]
            if block in self._hash_of:
                if self._hash_of[block] != parent:
                    raise BlockManagerError(
                        f"sequence {seq_id!r}: block {block} is cached under another hash"
                    )
                continue  # shared from the cache already
            if parent not in self._cached:
                self._cached[parent] = block
                self._hash_of[block] = parent
                added += 1
                self._promised.pop(parent, None)  # free() skips what is no longer promised
        return added

    # ------------------------------------------------------------- allocation

    def blocks_needed(self, seq_id: Hashable, num_tokens: int, prefix: Sequence[int] = ()) -> int:
        """More blocks ``seq_id`` needs to hold ``num_tokens`` positions (0 if it already
        can), beyond the shared ``prefix`` blocks a new sequence would start with."""
        have = len(self._tables.get(seq_id, ())) + len(prefix)
        return max(0, self.blocks_for_tokens(num_tokens) - have)

    def can_allocate(self, seq_id: Hashable, num_tokens: int, prefix: Sequence[int] = ()) -> bool:
        """True when ``allocate(seq_id, num_tokens, prefix)`` would succeed."""
        return self.blocks_needed(seq_id, num_tokens, prefix) <= self._available(prefix)

    def allocate(self, seq_id: Hashable, num_tokens: int, prefix: Sequence[int] = ()) -> list[int]:
        """Grow ``seq_id``'s table until it holds ``num_tokens`` positions.

        Registers an unknown sequence; ``prefix`` (from :meth:`match`, for a sequence
        with no table yet) are cached blocks it starts with, shared, one reference
        each. Never shrinks a table. Returns the block ids added after the prefix
        (free ones lowest id first, then evicted cached ones; possibly none). Raises
        :class:`OutOfBlocks`, allocating nothing, when too few blocks are free.
        """
        if prefix and seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks; prefix is for new ones")
        needed = self.blocks_needed(seq_id, num_tokens, prefix)
        available = self._available(prefix)
        if needed > available:
            raise OutOfBlocks(seq_id, needed, available)
        table = self._tables.setdefault(seq_id, [])
        for block in prefix:
            if block not in self._hash_of:
                raise BlockManagerError(f"prefix block {block} is not cached")
            if self._refs[block] == 0:
                del self._lru[block]
            self._refs[block] += 1
            table.append(block)
        if prefix:
            self._chains[seq_id] = [self._hash_of[b] for b in prefix]
        new = [self._take() for _ in range(needed)]
        table.extend(new)
        return new

    def free(self, seq_id: Hashable) -> int:
        """Drop ``seq_id``'s reference to each of its blocks and forget it. A block that
        no other table holds becomes cached if registered (most recently released
        last; the sequence's tail first, so a prefix outlives its continuations),
        free otherwise. Idempotent: freeing an unknown or already freed sequence
        returns 0. Returns the number of blocks the sequence held."""
        self._chains.pop(seq_id, None)
        for h in self._promises.pop(seq_id, ()):
            if self._promised.get(h) == seq_id:
                del self._promised[h]
        table = self._tables.pop(seq_id, None)
        if not table:
            return 0
        for block in reversed(table):
            if self._refs[block] <= 0:
                raise BlockManagerError(f"block {block} of {seq_id!r} freed with no reference")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._lru[block] = None
                else:
                    heapq.heappush(self._free, block)
        return len(table)

    def reset_cache(self) -> int:
        """Forget every cached block no sequence holds (they become free); returns how
        many. Held blocks keep their registration."""
        dropped = list(self._lru)
        self._lru.clear()
        for block in dropped:
            del self._cached[self._hash_of.pop(block)]
            heapq.heappush(self._free, block)
        return len(dropped)

    def _available(self, prefix: Sequence[int]) -> int:
        """Blocks an allocation may take: free ones, and cached ones not in ``prefix``."""
        taken = sum(1 for b in prefix if self._refs[b] == 0)
        return len(self._free) + len(self._lru) - taken

    def _take(self) -> int:
        """One block for new KV: the lowest free id, else the least recently released
        cached block, evicted (its hash forgotten, so no later match finds it)."""
        if self._free:
            block = heapq.heappop(self._free)
        else:
            block, _ = self._lru.popitem(last=False)
            del self._cached[self._hash_of.pop(block)]
            self.stats.evictions += 1
        self._refs[block] = 1
        return block

    # ------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Raise :class:`BlockManagerError` unless every block is exactly one of free,
        cached (unreferenced and registered) or held by as many tables as its reference
        count says, no table lists a block twice, the hash maps agree, and the free
        list is a valid min-heap."""
        holders: dict[int, list[Hashable]] = {}
        for seq_id, table in self._tables.items():
            if len(set(table)) != len(table):
                raise BlockManagerError(f"sequence {seq_id!r} lists a block twice: {table}")
            for block in table:
                if not 0 <= block < self._num_blocks:
                    raise BlockManagerError(f"sequence {seq_id!r} owns out-of-range block {block}")
                holders.setdefault(block, []).append(seq_id)
        for block, seqs in holders.items():
            if self._refs[block] != len(seqs):
                shared = "shared" if block in self._hash_of else "not cached, yet owned by both"
                raise BlockManagerError(
                    f"block {block} is held by {seqs} ({shared}) but its reference count "
                    f"is {self._refs[block]}"
                )
            if len(seqs) > 1 and block not in self._hash_of:
                raise BlockManagerError(
                    f"block {block} is owned by both {seqs[0]!r} and {seqs[1]!r}"
                )
        free_set: set[int] = set()
        for block in self._free:
            if not 0 <= block < self._num_blocks:
                raise BlockManagerError(f"free list holds out-of-range block {block}")
            if block in free_set:
                raise BlockManagerError(f"block {block} is on the free list twice")
            if block in holders:
                raise BlockManagerError(f"block {block} is free but owned by {holders[block]!r}")
            if block in self._hash_of:
                raise BlockManagerError(f"block {block} is free but still cached")
            free_set.add(block)
        for block in self._lru:
            if block in holders or self._refs[block] != 0:
                raise BlockManagerError(f"block {block} is evictable but held")
            if block not in self._hash_of:
                raise BlockManagerError(f"block {block} is evictable but not cached")
            if block in free_set:
                raise BlockManagerError(f"block {block} is both free and evictable")
        lost = self._num_blocks - len(holders) - len(free_set) - len(self._lru)
        if lost:
            known = free_set | holders.keys() | set(self._lru)
            missing = sorted(set(range(self._num_blocks)) - known)
            raise BlockManagerError(f"{lost} blocks are neither free nor owned: {missing[:16]}")
        for block in range(self._num_blocks):
            if block not in holders and self._refs[block] != 0:
                raise BlockManagerError(
                    f"block {block} has reference count {self._refs[block]} but no holder"
                )
        for h, seq_id in self._promised.items():
            if seq_id not in self._tables:
                raise BlockManagerError(f"sequence {seq_id!r} promises a block but holds none")
            if h in self._cached:
                raise BlockManagerError("a cached block is still promised")
        if len(self._cached) != len(self._hash_of) or any(
            self._hash_of.get(b) != h for h, b in self._cached.items()
        ):
            raise BlockManagerError("the hash map and the block-to-hash map disagree")
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
            f"free={len(self._free)}, cached={len(self._hash_of)}, seqs={len(self._tables)})"
        )
