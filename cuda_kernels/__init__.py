"""spectrio.cuda_kernels: CUDA sources, the CuPy loader and NumPy references.

Two kernels build the publisher's per-step record (layout in
:mod:`spectrio.core.record`) from arrays of any shape a step hands over:
``speculate_save`` (header, accept_num, CSR token ids) and ``pack_topk`` (the
logprob block, exactly ``width`` columns). Each has a byte-identical NumPy
reference in :mod:`.reference`, which is the CPU path. Their entry points in
:mod:`.loader` take any ``__dlpack__`` array and an explicit ``stream=``.

The persistent path, :class:`RecordWriter` (:mod:`.record_writer`), is what a GPU
sampler uses every step: one ``step_record`` kernel writes the whole record into
pinned memory from buffers whose pointers were taken once, replayed as a captured
graph per batch size. Its pure rules (sizes, capture plan, buffer reuse, reference)
are :mod:`.record_layout`.

CuPy is imported only when a GPU entry point runs; device arrays without an
importable CuPy raise :class:`KernelUnavailable`. :func:`to_host` reads any array
(host or device) back as NumPy.
"""

from .loader import (
    KERNEL_SOURCES,
    SPECULATE_SAVE_MAX_BSZ,
    KernelUnavailable,
    is_host_array,
    kernel_source,
    pack_topk,
    pack_topk_any,
    speculate_save,
    speculate_save_any,
    to_host,
)
from .record_layout import (
    RecordRing,
    RingExhausted,
    capacity_words,
    capture_size_for,
    record_capture_sizes,
    record_words,
    step_record_ref,
)
from .record_writer import PendingRecord, RecordBuffer, RecordInputs, RecordWriter
from .reference import (
    HEADER_WORDS,
    KIND_DRAFT,
    KIND_TARGET,
    MAX_WIDTH,
    PREEMPTED,
    RECORD_VERSION,
    expand_per_token,
    pack_header,
    pack_topk_ref,
    record_width,
    speculate_save_ref,
    unpack_header,
)

__all__ = [
    "HEADER_WORDS",
    "KERNEL_SOURCES",
    "KIND_DRAFT",
    "KIND_TARGET",
    "MAX_WIDTH",
    "PREEMPTED",
    "PendingRecord",
    "RecordBuffer",
    "RecordInputs",
    "RecordRing",
    "RecordWriter",
    "RingExhausted",
    "RECORD_VERSION",
    "SPECULATE_SAVE_MAX_BSZ",
    "KernelUnavailable",
    "capacity_words",
    "capture_size_for",
    "expand_per_token",
    "is_host_array",
    "kernel_source",
    "pack_header",
    "pack_topk",
    "pack_topk_any",
    "pack_topk_ref",
    "record_capture_sizes",
    "record_width",
    "record_words",
    "speculate_save",
    "speculate_save_any",
    "speculate_save_ref",
    "step_record_ref",
    "to_host",
    "unpack_header",
]
