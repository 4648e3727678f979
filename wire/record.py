"""The per-step record a step message carries raw in frame 1, under the wire's name.

The layout lives in :mod:`spectrio.core.record`, below the stages that pack it, and
the NumPy packer in :mod:`spectrio.cuda_kernels.reference`; this module is their public
path for consumers (``from spectrio.wire.record import unpack``)."""

from spectrio.core.record import (
    HEADER_WORDS,
    KIND_DRAFT,
    KIND_TARGET,
    PREEMPTED,
    RECORD_VERSION,
    RecordError,
    StepRecord,
    record_nbytes,
    unpack,
)
from spectrio.cuda_kernels.reference import pack_step_record

__all__ = [
    "HEADER_WORDS",
    "KIND_DRAFT",
    "KIND_TARGET",
    "PREEMPTED",
    "RECORD_VERSION",
    "RecordError",
    "StepRecord",
    "pack_step_record",
    "record_nbytes",
    "unpack",
]
