"""The GPU step record at the copy floor: persistent buffers, one record in one pinned
buffer, a captured graph per batch size.

A :class:`RecordWriter` is built once over the framework tensors a GPU sampler writes
every step (accepted tokens, counts, flags, and the logprob candidates). Their device
pointers are taken once, with every dtype, shape and device check; nothing is converted,
allocated or checked per step beyond a few integer comparisons. Each step then costs
four integer stores into pinned memory, one graph launch and one wait:

* ``mode="mapped"`` (the default): the ``step_record`` kernel writes the record, in the
  wire layout, straight into pinned host memory mapped into the device's address
  space. Exactly the record's bytes cross the bus, with no separate copy.
* ``mode="copy"``: the kernel writes into device memory and one copy moves a bound known
  on the host (the captured batch's largest record at this width) into pinned memory;
  the kernel zeroes the words between the record's end and that bound, so the copy
  reads only written memory.

The per-step scalars (batch size, k + 1, kind and width) are written into pinned memory
and reach the kernel through a 16-byte copy captured with it, so one graph serves every
step of a captured batch size (a kernel reading pinned memory directly pays a serial bus
round trip per load). A real batch runs on the smallest captured size that holds it; its
padded slots are not in the record. Each size has two graphs, one with and one without
a logprob block, because the grid is sized by the words the record can hold.

Records come out of a :class:`~spectrio.cuda_kernels.record_layout.RecordRing` of
pinned buffers: a buffer is written again only after its holder let it go
(:meth:`RecordBuffer.release`, or :meth:`RecordBuffer.release_when` a send tracker is
done), so up to ``ring_size`` records can be in flight or on their way out at once.

CuPy is imported when a writer is built, never at import.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .loader import _cupy, _kernel
from .record_layout import (
    STEP_RECORD_MAX_BSZ,
    RecordRing,
    capacity_words,
    capture_size_for,
    record_words,
)
from .reference import MAX_WIDTH, RECORD_VERSION

__all__ = ["PendingRecord", "RecordBuffer", "RecordInputs", "RecordWriter"]

STEP_RECORD_THREADS = 256
"""Threads per block; equals ``STEP_RECORD_THREADS`` in ``step_record.cu``."""
_PARAM_WORDS = 4
_DLPACK_CUDA = 2  # kDLCUDA
_HOST_ALLOC_PORTABLE = 1  # cudaHostAllocPortable
_HOST_ALLOC_MAPPED = 2  # cudaHostAllocMapped
_CAPTURE_THREAD_LOCAL = 1  # cudaStreamCaptureModeThreadLocal


@dataclass(frozen=True)
class RecordInputs:
    """The persistent device tensors a writer reads (any ``__dlpack__`` CUDA arrays).

    Slot rows run to ``max_bsz`` and token columns to ``max_cols`` (the largest k + 1);
    a step uses the first ``bsz`` rows and ``cols`` columns. The logprob candidates are
    either per (slot, position), ``topk_ids``/``topk_vals`` ``[max_bsz, max_cols, w_max]``
    and ``ranks`` ``[max_bsz, max_cols]``, or already in record order,
    ``[rows, w_max]`` and ``[rows]`` with ``rows >= max_bsz * max_cols``. Column 0 of a
    candidate row is the emitted token. Leave all four logprob fields out for a writer
    that never carries logprobs.
    """

    accepted_tokens: Any  # int32 [max_bsz, max_cols]
    accept_counts: Any  # int32 [max_bsz]
    preempted: Any  # bool or uint8 [max_bsz]
    seq_lens_decoder: Any  # int32 [max_bsz]
    prompt_lens: Any  # int32 [max_bsz]
    topn: Any = None  # int32 [max_bsz], top-N per slot, -1 none
    topk_ids: Any = None  # int32
    topk_vals: Any = None  # float32
    ranks: Any = None  # int32


class RecordBuffer:
    """One finished record in pinned memory. ``data`` is valid until the buffer is let go;
    send it without a copy, then release it (or tie its release to the send)."""

    __slots__ = ("_slot", "_writer", "data")

    def __init__(self, writer: RecordWriter, slot: int, data: memoryview) -> None:
        self._writer = writer
        self._slot = slot
        self.data = data

    def release(self) -> None:
        """The buffer may be written again."""
        self._writer._ring.release(self._slot)

    def release_when(self, done: Callable[[], bool]) -> None:
        """The buffer may be written again once ``done()`` is true (pyzmq's
        ``MessageTracker.done``, say): checked when the writer next needs a buffer."""
        self._writer._ring.release_when(self._slot, done)


class PendingRecord:
    """A record launched on the writer's stream; :meth:`wait` blocks until it is written."""

    __slots__ = ("_buffer", "_slot", "_writer")

    def __init__(self, writer: RecordWriter, slot: int) -> None:
        self._writer = writer
        self._slot = slot
        self._buffer: RecordBuffer | None = None

    def wait(self) -> RecordBuffer:
        if self._buffer is None:
            self._buffer = self._writer._finish(self._slot)
        return self._buffer


class _Pinned:
    """Page-locked host memory mapped into the device's address space."""

    def __init__(self, cp: Any, nbytes: int) -> None:
        rt = cp.cuda.runtime
        flags = getattr(rt, "hostAllocPortable", _HOST_ALLOC_PORTABLE) | getattr(
            rt, "hostAllocMapped", _HOST_ALLOC_MAPPED
        )
        self.nbytes = max(nbytes, 4)
        self.host_ptr = int(rt.hostAlloc(self.nbytes, flags))
        self._finalizer = weakref.finalize(self, rt.freeHost, self.host_ptr)
        # Under unified addressing (every 64-bit CUDA platform) the host pointer is also
        # the device's; ask the runtime where it can say.
        get_device_pointer = getattr(rt, "hostGetDevicePointer", None)
        self.device_ptr = (
            int(get_device_pointer(self.host_ptr, 0))
            if get_device_pointer is not None
            else self.host_ptr
        )
        raw = (ctypes.c_char * self.nbytes).from_address(self.host_ptr)
        self.bytes = memoryview(raw).cast("B")
        self.words = np.frombuffer(self.bytes, dtype="<i4")

    def free(self) -> None:
        self._finalizer()


def _as_device(cp: Any, x: Any, name: str, dtypes: Sequence[str], ndim: tuple[int, ...]) -> Any:
    """``x`` as a CuPy view (DLPack, once), after checking what a per-step launch trusts."""
    if x is None:
        raise ValueError(f"{name} is required")
    device = getattr(x, "__dlpack_device__", None)
    if not isinstance(x, cp.ndarray) and (device is None or int(device()[0]) != _DLPACK_CUDA):
        raise ValueError(f"{name} must be a CUDA array (a persistent device buffer)")
    arr = x if isinstance(x, cp.ndarray) else cp.from_dlpack(x)
    if arr.dtype.name not in dtypes:
        raise ValueError(
            f"{name} must be {' or '.join(dtypes)} (no per-step conversion), got {arr.dtype}"
        )
    if arr.ndim not in ndim:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndim))} dims, got {arr.shape}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return arr


class RecordWriter:
    """Writes one step record per call into a ring of pinned buffers (module docstring).

    Args:
        inputs: the persistent device tensors (:class:`RecordInputs`).
        stream: the CuPy stream the producer of ``inputs`` orders on; the record's
            launch follows that work on it. Not the legacy default stream (graphs are
            captured on it).
        capture_sizes: batch sizes to capture a graph for, ascending (the runtime's
            plan, :func:`~spectrio.cuda_kernels.record_layout.record_capture_sizes`);
            default ``[max_bsz]``.
        ring_size: pinned record buffers (at least the steps in flight plus the records
            a publisher may still be sending).
        mode: ``"mapped"`` or ``"copy"`` (module docstring).
        graphs: replay captured graphs (default); False launches the kernel directly.
        blocks_per_sm: the grid's cap, per multiprocessor. Every block rescans the
            slots, so more blocks cost more scans, and fewer leave each thread more words
            to write one after another.
    """

    def __init__(
        self,
        inputs: RecordInputs,
        *,
        stream: Any,
        capture_sizes: Sequence[int] | None = None,
        ring_size: int = 3,
        mode: str = "mapped",
        graphs: bool = True,
        blocks_per_sm: int = 2,
    ) -> None:
        cp = _cupy()
        self._cp = cp
        if mode not in ("mapped", "copy"):
            raise ValueError(f"mode must be 'mapped' or 'copy', got {mode!r}")
        if stream is None or stream.ptr == 0:
            raise ValueError("the writer needs a non-default stream= (graphs are captured on it)")
        self._stream = stream
        self._mode = mode
        self._graphs_on = graphs

        i32 = ("int32",)
        tokens = _as_device(cp, inputs.accepted_tokens, "accepted_tokens", i32, (2,))
        self.max_bsz, self.max_cols = (int(s) for s in tokens.shape)
        if not 1 <= self.max_bsz <= STEP_RECORD_MAX_BSZ or self.max_cols < 1:
            raise ValueError(
                f"accepted_tokens must be [max_bsz <= {STEP_RECORD_MAX_BSZ}, max_cols >= 1], "
                f"got {tokens.shape}"
            )
        slot_arrays = {
            "accept_counts": _as_device(cp, inputs.accept_counts, "accept_counts", i32, (1,)),
            "preempted": _as_device(cp, inputs.preempted, "preempted", ("bool", "uint8"), (1,)),
            "seq_lens_decoder": _as_device(
                cp, inputs.seq_lens_decoder, "seq_lens_decoder", i32, (1,)
            ),
            "prompt_lens": _as_device(cp, inputs.prompt_lens, "prompt_lens", i32, (1,)),
        }
        lp_fields = (inputs.topn, inputs.topk_ids, inputs.topk_vals, inputs.ranks)
        self.w_max = 0
        compact = 0
        lp: dict[str, Any] = {}
        if any(x is not None for x in lp_fields):
            slot_arrays["topn"] = _as_device(cp, inputs.topn, "topn", i32, (1,))
            ids = _as_device(cp, inputs.topk_ids, "topk_ids", i32, (2, 3))
            vals = _as_device(cp, inputs.topk_vals, "topk_vals", ("float32",), (2, 3))
            ranks = _as_device(cp, inputs.ranks, "ranks", i32, (1, 2))
            if vals.shape != ids.shape:
                raise ValueError(f"topk_vals {vals.shape} must match topk_ids {ids.shape}")
            self.w_max = int(ids.shape[-1])
            if ids.ndim == 3:
                want = (self.max_bsz, self.max_cols)
                if tuple(ids.shape[:2]) != want or tuple(ranks.shape) != want:
                    raise ValueError(
                        f"per-slot candidates must be [{want[0]}, {want[1]}, w_max] and ranks "
                        f"{list(want)}, got {ids.shape} and {ranks.shape}"
                    )
            else:
                compact = 1
                rows = self.max_bsz * self.max_cols
                if ids.shape[0] < rows or ranks.ndim != 1 or ranks.shape[0] < rows:
                    raise ValueError(
                        f"record-order candidates need >= {rows} rows, got {ids.shape} and "
                        f"ranks {ranks.shape}"
                    )
            if not 1 <= self.w_max <= MAX_WIDTH:
                raise ValueError(f"topk width must be in [1, {MAX_WIDTH}], got {self.w_max}")
            lp = {"ids": ids, "vals": vals, "ranks": ranks}
        for name, arr in slot_arrays.items():
            if arr.shape[0] < self.max_bsz:
                raise ValueError(f"{name} must hold >= {self.max_bsz} slots, got {arr.shape}")
        self._device_id = int(tokens.device.id)
        for arr in (*slot_arrays.values(), *lp.values()):
            if int(arr.device.id) != self._device_id:
                raise ValueError("every input must live on the same device")
        # Keep the views alive: the kernel reads through their pointers for our lifetime.
        self._keep = (tokens, slot_arrays, lp)

        sizes = sorted({int(s) for s in (capture_sizes or [self.max_bsz])})
        if not sizes or sizes[0] < 1 or sizes[-1] > self.max_bsz:
            raise ValueError(f"capture sizes must lie in [1, {self.max_bsz}], got {sizes}")
        self.capture_sizes = sizes

        self._ring = RecordRing(ring_size)
        self._cap = capacity_words(self.max_bsz, self.max_cols, self.w_max)
        self._records = _Pinned(cp, 4 * self._cap * ring_size)
        self._params = _Pinned(cp, 4 * _PARAM_WORDS * ring_size)
        self._dparams = cp.empty(_PARAM_WORDS * ring_size, dtype=cp.int32)
        self._staging = cp.empty(self._cap * ring_size, dtype=cp.int32) if mode == "copy" else None
        self._events = [cp.cuda.Event(block=False, disable_timing=True) for _ in range(ring_size)]
        self._graphs: dict[tuple[int, int, int], Any] = {}

        with cp.cuda.Device(self._device_id):
            props = cp.cuda.runtime.getDeviceProperties(self._device_id)
            sm = int(props["multiProcessorCount"])
            self._kernel = _kernel("step_record", self._device_id)
        if blocks_per_sm < 1:
            raise ValueError(f"blocks_per_sm must be >= 1, got {blocks_per_sm}")
        self._max_blocks = blocks_per_sm * sm
        null = np.uint64(0)
        pointers = [np.uint64(tokens.data.ptr), np.int32(self.max_cols)]
        pointers += [
            np.uint64(slot_arrays[n].data.ptr)
            for n in ("accept_counts", "preempted", "seq_lens_decoder", "prompt_lens")
        ]
        pointers.append(np.uint64(slot_arrays["topn"].data.ptr) if lp else null)
        pointers += [np.uint64(lp[n].data.ptr) if lp else null for n in ("ids", "vals", "ranks")]
        pointers += [np.int32(self.w_max), np.int32(compact), np.int32(RECORD_VERSION)]
        self._args: list[tuple[Any, ...]] = []
        for slot in range(ring_size):
            params = np.uint64(int(self._dparams.data.ptr) + 4 * _PARAM_WORDS * slot)
            self._args.append((params, *pointers, np.uint64(self._out_ptr(slot))))

    # ------------------------------------------------------------------ per step

    def launch(self, bsz: int, *, cols: int, kind: int, width: int = 0) -> PendingRecord:
        """Enqueue the record of the step whose inputs the stream has just produced.

        Args:
            bsz: slots in the record (the first ``bsz`` input rows).
            cols: k + 1 of this step (counts are clamped to it).
            kind: record kind, 0..255.
            width: logprob columns, 0 or ``1 + max(topn[:bsz])`` (at most ``w_max``).
        """
        if not 0 <= bsz <= self.max_bsz:
            raise ValueError(f"bsz must be in [0, {self.max_bsz}], got {bsz}")
        if not 1 <= cols <= self.max_cols:
            raise ValueError(f"cols must be in [1, {self.max_cols}], got {cols}")
        if not 0 <= kind <= 0xFF:
            raise ValueError(f"record kind must fit in 8 bits (0..255), got {kind}")
        if not 0 <= width <= self.w_max:
            raise ValueError(f"width must be in [0, {self.w_max}] for this writer, got {width}")
        size = capture_size_for(self.capture_sizes, bsz)
        slot = self._ring.acquire()
        bound = 0
        if self._mode == "copy":
            bound = record_words(size, size * self.max_cols, width)
        base = _PARAM_WORDS * slot
        words = self._params.words
        words[base] = bsz
        words[base + 1] = cols
        words[base + 2] = kind | (width << 8)
        words[base + 3] = bound
        stream = self._stream
        lp = width > 0
        if self._graphs_on:
            key = (size, slot, width if self._mode == "copy" else int(lp))
            graph = self._graphs.get(key)
            if graph is None:
                graph = self._capture(size, slot, bound, lp)
                self._graphs[key] = graph
            graph.launch(stream)
        else:
            with stream:
                self._enqueue(size, slot, bound, lp)
        self._events[slot].record(stream)
        return PendingRecord(self, slot)

    def write(self, bsz: int, *, cols: int, kind: int, width: int = 0) -> RecordBuffer:
        """:meth:`launch` then wait: the finished record."""
        return self.launch(bsz, cols=cols, kind=kind, width=width).wait()

    def close(self) -> None:
        """Wait for the stream and free the pinned memory (records become invalid)."""
        self._stream.synchronize()
        self._graphs.clear()
        self._records.free()
        self._params.free()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _out_ptr(self, slot: int) -> int:
        if self._staging is not None:
            return int(self._staging.data.ptr) + 4 * self._cap * slot
        return self._records.device_ptr + 4 * self._cap * slot

    def _grid(self, size: int, lp: bool) -> int:
        """Blocks for the largest record of a captured size: one thread per word of its
        token ids or logprob block, at most ``blocks_per_sm`` per multiprocessor."""
        items = max(size * self.max_cols * (self.w_max if lp else 1), 4 + size)
        return max(1, min(self._max_blocks, -(-items // STEP_RECORD_THREADS)))

    def _enqueue(self, size: int, slot: int, bound: int, lp: bool) -> None:
        """The scalars' copy, the launch and, in copy mode, the bounded copy, on the
        current stream."""
        rt = self._cp.cuda.runtime
        off = 4 * _PARAM_WORDS * slot
        rt.memcpyAsync(
            int(self._dparams.data.ptr) + off,
            self._params.host_ptr + off,
            4 * _PARAM_WORDS,
            rt.memcpyHostToDevice,
            self._stream.ptr,
        )
        self._kernel((self._grid(size, lp),), (STEP_RECORD_THREADS,), self._args[slot])
        if self._staging is not None:
            rt.memcpyAsync(
                self._records.host_ptr + 4 * self._cap * slot,
                self._out_ptr(slot),
                4 * bound,
                rt.memcpyDeviceToHost,
                self._stream.ptr,
            )

    def _capture(self, size: int, slot: int, bound: int, lp: bool) -> Any:
        stream = self._stream
        with stream:
            self._enqueue(size, slot, bound, lp)  # loads the module outside the capture
        stream.synchronize()
        rt = self._cp.cuda.runtime
        stream.begin_capture(
            mode=getattr(rt, "streamCaptureModeThreadLocal", _CAPTURE_THREAD_LOCAL)
        )
        try:
            with stream:
                self._enqueue(size, slot, bound, lp)
        finally:
            graph = stream.end_capture()
        graph.upload(stream)
        return graph

    def _finish(self, slot: int) -> RecordBuffer:
        self._events[slot].synchronize()
        base = self._cap * slot
        words = self._records.words
        packed, bsz, n = int(words[base + 1]), int(words[base + 2]), int(words[base + 3])
        nbytes = 4 * record_words(bsz, n, packed >> 8)
        data = self._records.bytes[4 * base : 4 * base + nbytes]
        return RecordBuffer(self, slot, data)
