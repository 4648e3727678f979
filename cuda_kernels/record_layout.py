"""The persistent GPU record path's pure rules: sizes, capture plan, buffer reuse, reference.

Nothing here touches a device, so all of it is tested on the CPU:

* :func:`record_words` / :func:`capacity_words` size a record and the pinned buffer that
  holds the largest one a writer can produce (the layout is :mod:`spectrio.core.record`'s).
* :func:`record_capture_sizes` and :func:`capture_size_for` are the capture plan: one
  graph per planned batch size, a real batch running on the smallest captured size that
  holds it (its padded slots are not part of the record).
* :class:`RecordRing` is the reuse rule for the pinned buffers: a buffer is handed out
  only when every earlier holder has let it go, which a holder may tie to a condition
  (a ZeroMQ send tracker's ``done``) checked when a buffer is next wanted.
* :func:`step_record_ref` is the NumPy reference of ``step_record.cu``, which reads the
  logprob candidates per (slot, position) rather than in record order.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from spectrio.core.record import HEADER_WORDS, MAX_WIDTH, record_words

from .reference import pack_topk_ref, speculate_save_ref

__all__ = [
    "RecordRing",
    "RingExhausted",
    "capacity_words",
    "capture_size_for",
    "compact_rows",
    "record_capture_sizes",
    "record_words",
    "step_record_ref",
]

STEP_RECORD_MAX_BSZ = 1024
"""Largest batch the ``step_record`` kernel scans in shared memory; equals
``STEP_RECORD_MAX_BSZ`` in ``step_record.cu``."""


def capacity_words(max_bsz: int, max_cols: int, max_width: int) -> int:
    """Words of the largest record: every slot emits ``max_cols`` tokens at ``max_width``."""
    if max_bsz < 0 or max_cols < 1 or not 0 <= max_width <= MAX_WIDTH:
        raise ValueError(
            f"need max_bsz >= 0, max_cols >= 1, 0 <= max_width <= {MAX_WIDTH}; got "
            f"{max_bsz}, {max_cols}, {max_width}"
        )
    return record_words(max_bsz, max_bsz * max_cols, max_width)


def record_capture_sizes(base_sizes: Iterable[int], max_bsz: int) -> list[int]:
    """Batch sizes to capture: the base list capped at ``max_bsz``, plus ``max_bsz``.

    ``base_sizes`` is the runtime's planned list (``spectrio.core.config.
    BASE_CAPTURE_SIZES``): records are captured per batch, as the target is."""
    if not 1 <= max_bsz <= STEP_RECORD_MAX_BSZ:
        raise ValueError(f"max_bsz must be in [1, {STEP_RECORD_MAX_BSZ}], got {max_bsz}")
    sizes = {int(s) for s in base_sizes if 1 <= int(s) <= max_bsz}
    sizes.add(max_bsz)
    return sorted(sizes)


def capture_size_for(sizes: Sequence[int], bsz: int) -> int:
    """The smallest captured size holding ``bsz`` slots (``sizes`` ascending).

    Raises:
        ValueError: ``bsz`` is negative or larger than every captured size.
    """
    if bsz < 0:
        raise ValueError(f"bsz must be >= 0, got {bsz}")
    i = bisect.bisect_left(sizes, max(bsz, 1))
    if i == len(sizes):
        raise ValueError(f"bsz {bsz} is above the largest captured size {sizes[-1]}")
    return sizes[i]


class RingExhausted(RuntimeError):
    """Every pinned record buffer is still held: a consumer kept more records than the
    ring was sized for, or never let one go."""


class RecordRing:
    """Which of ``n`` buffers may be written next.

    Invariant: a buffer is never handed out while a holder may still read it. A buffer is
    held from :meth:`acquire` until :meth:`release`, or until the condition given to
    :meth:`release_when` returns true (checked on the next :meth:`acquire`). Buffers are
    handed out round robin, so the oldest released buffer is reused last-but-one rather
    than at once, which keeps a just-sent frame's memory untouched for a while longer.
    """

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"a ring needs at least one buffer, got {n}")
        self._held: list[bool] = [False] * n
        self._until: list[Callable[[], bool] | None] = [None] * n
        self._next = 0

    @property
    def size(self) -> int:
        return len(self._held)

    def held(self, i: int) -> bool:
        return self._held[i]

    def acquire(self) -> int:
        """Hold and return the next free buffer.

        Raises:
            RingExhausted: every buffer is held and no pending condition is met.
        """
        n = len(self._held)
        for step in range(n):
            i = (self._next + step) % n
            until = self._until[i]
            if until is not None and until():
                self._held[i] = False
                self._until[i] = None
            if not self._held[i]:
                self._held[i] = True
                self._next = (i + 1) % n
                return i
        raise RingExhausted(
            f"all {n} record buffers are held; release each record once its frame is sent"
        )

    def release(self, i: int) -> None:
        """Buffer ``i`` may be written again."""
        if not self._held[i]:
            raise ValueError(f"record buffer {i} is not held")
        self._held[i] = False
        self._until[i] = None

    def release_when(self, i: int, done: Callable[[], bool]) -> None:
        """Buffer ``i`` may be written again once ``done()`` is true (a send tracker)."""
        if not self._held[i]:
            raise ValueError(f"record buffer {i} is not held")
        self._until[i] = done


def compact_rows(per_slot: np.ndarray, accept_num: np.ndarray) -> np.ndarray:
    """Rows of a per-(slot, position) array ``[bsz, cols, ...]`` in record order: slot
    after slot, the first ``max(accept_num[s], 0)`` positions of each."""
    arr = np.asarray(per_slot)
    cols = arr.shape[1]
    emit = np.arange(cols)[None, :] < np.maximum(np.asarray(accept_num), 0)[:, None]
    return arr[emit]


def step_record_ref(
    accepted_tokens: np.ndarray,
    accept_counts: np.ndarray,
    preempted: np.ndarray,
    seq_lens_decoder: np.ndarray,
    prompt_lens: np.ndarray,
    *,
    kind: int,
    width: int = 0,
    topn: np.ndarray | None = None,
    topk_ids: np.ndarray | None = None,
    topk_vals: np.ndarray | None = None,
    ranks: np.ndarray | None = None,
) -> np.ndarray:
    """The whole record as little-endian int32 words, as ``step_record.cu`` writes it.

    ``accepted_tokens`` is ``[bsz, cols]``; ``accept_counts`` must lie in
    ``[0, cols]`` (the kernel clamps, the reference refuses). With ``width > 0``,
    ``topn`` is ``[bsz]`` (the top-N each slot asked for, -1 none, at most
    ``width - 1``) and ``topk_ids`` / ``topk_vals`` / ``ranks`` are per (slot, position):
    ``[bsz, cols, w_max]`` / ``[bsz, cols, w_max]`` / ``[bsz, cols]``.
    """
    head = speculate_save_ref(
        accepted_tokens, accept_counts, preempted, seq_lens_decoder, prompt_lens, kind, width
    )
    if width == 0:
        return head
    if topn is None or topk_ids is None or topk_vals is None or ranks is None:
        raise ValueError("width > 0 needs topn, topk_ids, topk_vals and ranks")
    bsz = int(head[2])
    accept_num = head[HEADER_WORDS : HEADER_WORDS + bsz]
    per_token_topn = np.repeat(np.asarray(topn), np.maximum(accept_num, 0))
    ids = compact_rows(topk_ids, accept_num)
    vals = compact_rows(topk_vals, accept_num)
    rk = compact_rows(ranks, accept_num)
    lp_ids, lp_vals, out_ranks = pack_topk_ref(ids, vals, rk, per_token_topn, width)
    return np.concatenate(
        [head, lp_ids.reshape(-1), lp_vals.reshape(-1).view("<i4"), out_ranks]
    ).astype("<i4", copy=False)
