"""The per-step output record: packing (NumPy reference) and unpacking.

The publisher sends one record per step as frame 1 of its multipart output
message (frame 0 is the msgpack envelope with the slot -> request-id map).
It is one contiguous, little-endian byte string of 4-byte words, so a
consumer in any language can read it with plain array views.

Layout, in order (``i32`` = little-endian int32, ``f32`` = little-endian
IEEE-754 float32; every field starts on a 4-byte boundary)::

    offset (words)              field        type   shape
    0                           header       i32    [4]
    4                           accept_num   i32    [bsz]
    4 + bsz                     token_ids    i32    [num_tokens]
    -- only when width > 0 --
    4 + bsz + N                 lp_ids       i32    [num_tokens, width]  row-major
    4 + bsz + N + N*W           lp_vals      f32    [num_tokens, width]  row-major
    4 + bsz + N + 2*N*W         ranks        i32    [num_tokens]

    (N = num_tokens, W = width; total bytes = 4 * (4 + bsz + N + (2*N*W + N if W else 0)))

``header`` i32[4]
    ``[0]`` version: ``RECORD_VERSION`` (1). A reader rejects other versions.
    ``[1]`` packed: ``kind | (width << 8)``. ``kind = packed & 0xFF`` is
    3 (``KIND_TARGET``, verified tokens) or 4 (``KIND_DRAFT``, draft tokens);
    the writer refuses kinds above 255. ``width = packed >> 8`` is the number of
    logprob columns: 0 when no slot wants logprobs, otherwise 1 + the largest
    top-N any slot of the batch asked for.
    ``[2]`` bsz: number of slots.
    ``[3]`` num_tokens: emitted tokens in this record, the sum of the
    positive ``accept_num`` entries.

``accept_num`` i32[bsz]
    Tokens emitted by each slot this step. ``-9`` (``PREEMPTED``): the slot was
    preempted or aborted; the consumer reschedules or recycles it. ``0``: no
    output (chunked prefill still in progress, stopped, or empty slot).

``token_ids`` i32[num_tokens]
    Only the emitted tokens, slot after slot (CSR by ``max(accept_num, 0)``).
    Slot ``i``'s tokens are ``token_ids[off[i]:off[i+1]]`` with ``off`` the
    exclusive prefix sum. No padding is ever sent.

``lp_ids`` i32[num_tokens, width] / ``lp_vals`` f32[num_tokens, width]
    Column 0: the emitted token and its logprob. Columns 1..: the top
    alternatives, best first. Only ``width`` columns are sent; columns beyond
    what a token's request asked for hold ``-1`` / ``0.0``, and every column
    of a token whose request asked for no logprobs holds ``-1`` / ``0.0``.

``ranks`` i32[num_tokens]
    Rank of each emitted token in its distribution (-1 when its request asked
    for no logprobs).

This module owns the format: its constants, header rules and sizes are defined here
and nowhere else. The kernels in :mod:`spectrio.cuda_kernels` (``speculate_save``,
``pack_topk``) produce these fields on the GPU and import the format from here; their
NumPy references live in :mod:`spectrio.cuda_kernels.reference`, whose
``pack_step_record`` combines them into a whole record. :func:`unpack` returns zero-copy
NumPy views with no per-row loops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "HEADER_WORDS",
    "KIND_DRAFT",
    "KIND_TARGET",
    "MAX_WIDTH",
    "PREEMPTED",
    "RECORD_VERSION",
    "RecordError",
    "StepRecord",
    "pack_header",
    "record_nbytes",
    "record_width",
    "record_words",
    "select_slots",
    "unpack_header",
    "unpack",
]

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")

RECORD_VERSION = 1
"""Version word of the step record (header[0])."""
KIND_TARGET = 3
"""Record kind: verified (target) tokens."""
KIND_DRAFT = 4
"""Record kind: draft tokens."""
PREEMPTED = -9
"""``accept_num`` value of a slot preempted or aborted this step."""
HEADER_WORDS = 4
"""int32 words in the header: version, kind | (width << 8), bsz, num_tokens."""
MAX_WIDTH = (1 << 23) - 1
"""Largest width that keeps ``kind | (width << 8)`` a non-negative int32."""


def pack_header(kind: int, width: int, bsz: int, num_tokens: int) -> np.ndarray:
    """The 4-word header as little-endian int32."""
    if not 0 <= kind <= 0xFF:
        raise ValueError(f"record kind must fit in 8 bits (0..255), got {kind}")
    if not 0 <= width <= MAX_WIDTH:
        raise ValueError(f"record width must be in [0, {MAX_WIDTH}], got {width}")
    if bsz < 0 or num_tokens < 0:
        raise ValueError(f"bsz and num_tokens must be >= 0, got {bsz}, {num_tokens}")
    return np.array([RECORD_VERSION, (kind & 0xFF) | (width << 8), bsz, num_tokens], dtype=_I32)


def unpack_header(packed: int) -> tuple[int, int]:
    """Split header[1] into ``(kind, width)``."""
    return packed & 0xFF, packed >> 8


def record_width(topn_per_slot: np.ndarray | None) -> int:
    """Logprob block width for a batch: 0 when no slot wants logprobs
    (every entry < 0, or None), else 1 + the largest top-N any slot asked for.
    Column 0 always holds the sampled token."""
    if topn_per_slot is None:
        return 0
    topn = np.asarray(topn_per_slot)
    if topn.size == 0 or int(topn.max()) < 0:
        return 0
    return 1 + int(topn.max())


def record_words(bsz: int, num_tokens: int, width: int) -> int:
    """int32 words of a record with these dimensions."""
    words = HEADER_WORDS + bsz + num_tokens
    if width:
        words += 2 * num_tokens * width + num_tokens
    return words


class RecordError(ValueError):
    """A byte string is not a well-formed step record."""


@dataclass(frozen=True, slots=True)
class StepRecord:
    """A parsed step record. Array fields are views of the buffer (read-only
    when it was ``bytes``)."""

    version: int
    kind: int
    width: int
    bsz: int
    num_tokens: int
    accept_num: np.ndarray
    token_ids: np.ndarray
    lp_ids: np.ndarray | None
    lp_vals: np.ndarray | None
    ranks: np.ndarray | None

    @property
    def offsets(self) -> np.ndarray:
        """CSR offsets int64 [bsz + 1]: slot ``i`` owns ``token_ids[off[i]:off[i+1]]``."""
        off = np.zeros(self.bsz + 1, dtype=np.int64)
        np.cumsum(np.maximum(self.accept_num, 0), out=off[1:])
        return off

    @property
    def preempted(self) -> np.ndarray:
        """bool [bsz]: slots preempted or aborted this step."""
        return self.accept_num == PREEMPTED

    @property
    def slot_of_token(self) -> np.ndarray:
        """int64 [num_tokens]: the slot each emitted token belongs to."""
        return np.repeat(np.arange(self.bsz), np.maximum(self.accept_num, 0))


def record_nbytes(bsz: int, num_tokens: int, width: int) -> int:
    """Size in bytes of a record with these dimensions."""
    return 4 * record_words(bsz, num_tokens, width)


def unpack(buf: bytes | bytearray | memoryview | np.ndarray) -> StepRecord:
    """Split a record into NumPy views (no copies, no per-row loops)."""
    raw = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    raw = raw.reshape(-1).view(np.uint8)
    if raw.size % 4 or raw.size < 4 * HEADER_WORDS:
        raise RecordError(f"record of {raw.size} bytes is not a whole number of >= 4 words")
    words = raw.view(_I32)
    version, packed, bsz, num_tokens = (int(x) for x in words[:HEADER_WORDS])
    if version != RECORD_VERSION:
        raise RecordError(f"unsupported record version {version} (expected {RECORD_VERSION})")
    kind, width = unpack_header(packed)
    if bsz < 0 or num_tokens < 0 or width < 0:
        raise RecordError(f"negative size in header: bsz={bsz} num_tokens={num_tokens}")
    expected = record_nbytes(bsz, num_tokens, width)
    if raw.size != expected:
        raise RecordError(
            f"record is {raw.size} bytes, header says {expected} "
            f"(bsz={bsz}, num_tokens={num_tokens}, width={width})"
        )
    at = HEADER_WORDS
    accept_num = words[at : at + bsz]
    at += bsz
    if int(np.maximum(accept_num, 0).sum()) != num_tokens:
        raise RecordError("accept_num does not sum to num_tokens")
    token_ids = words[at : at + num_tokens]
    at += num_tokens
    lp_ids = lp_vals = ranks = None
    if width:
        block = num_tokens * width
        lp_ids = words[at : at + block].reshape(num_tokens, width)
        at += block
        lp_vals = words[at : at + block].view(_F32).reshape(num_tokens, width)
        at += block
        ranks = words[at : at + num_tokens]
    return StepRecord(
        version=version,
        kind=kind,
        width=width,
        bsz=bsz,
        num_tokens=num_tokens,
        accept_num=accept_num,
        token_ids=token_ids,
        lp_ids=lp_ids,
        lp_vals=lp_vals,
        ranks=ranks,
    )


def select_slots(
    buf: bytes | bytearray | memoryview | StepRecord, slots: np.ndarray | list[int]
) -> bytes:
    """The record of the same step restricted to ``slots`` (ascending slot indices), in
    the same layout: the slots' ``accept_num`` entries, their tokens, and their logprob
    rows. The width is that of the widest kept row (0 when no kept token carries a
    logprob), so a consumer that asked for none is never sent padding: the rule of the
    full record (only the requested columns) holds for each slice. A wire server sends
    each client the slice of its own requests."""
    rec = buf if isinstance(buf, StepRecord) else unpack(buf)  # unpack once, slice many
    keep = np.asarray(slots, dtype=np.int64)
    if keep.size and (int(keep.min()) < 0 or int(keep.max()) >= rec.bsz):
        raise ValueError(f"slots {keep.tolist()} outside a record of {rec.bsz} slots")
    accept = rec.accept_num[keep]
    off = rec.offsets
    if keep.size == 1:
        rows = np.arange(off[keep[0]], off[keep[0] + 1], dtype=np.int64)
    elif keep.size:
        rows = np.concatenate([np.arange(off[i], off[i + 1]) for i in keep.tolist()])
    else:
        rows = np.zeros(0, dtype=np.int64)
    width = 0
    if rec.width and rows.size:
        assert rec.lp_ids is not None
        width = int((rec.lp_ids[rows] != -1).sum(axis=1).max())
    header = pack_header(rec.kind, width, int(keep.size), int(rows.size))
    parts = [header.tobytes(), accept.astype(_I32).tobytes(), rec.token_ids[rows].tobytes()]
    if width:
        assert rec.lp_ids is not None and rec.lp_vals is not None and rec.ranks is not None
        parts += [
            np.ascontiguousarray(rec.lp_ids[rows, :width]).tobytes(),
            np.ascontiguousarray(rec.lp_vals[rows, :width]).tobytes(),
            rec.ranks[rows].tobytes(),
        ]
    return b"".join(parts)


def __getattr__(name: str) -> object:
    """``pack_step_record`` moved to :mod:`spectrio.cuda_kernels.reference` (the kernels'
    CPU path, above this module): the old name keeps working, with a warning."""
    if name == "pack_step_record":
        import importlib
        import warnings

        warnings.warn(
            "spectrio.core.record.pack_step_record moved to "
            "spectrio.cuda_kernels.reference.pack_step_record "
            "(spectrio.wire.record re-exports it)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module("spectrio.cuda_kernels.reference").pack_step_record
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
