"""CuPy loading and launching of the step-record kernels, plus CPU/GPU dispatch.

CuPy is imported lazily, on the first GPU call: a CPU install never imports
it. GPU entry points take any ``__dlpack__`` array (CuPy, torch, Paddle) and
an explicit ``stream=`` (CuPy's current stream is thread-local, and the
runtime launches from worker threads). They return CuPy arrays and never
synchronise.

The ``*_any`` helpers run the NumPy reference when every input lives on the
host and the kernel otherwise (uploading any host inputs), and always return
host NumPy arrays (what the publisher sends), synchronising on ``stream`` in
the GPU case. Device inputs without CuPy raise :class:`KernelUnavailable`.
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from typing import TYPE_CHECKING, Any

import numpy as np

from spectrio.errors import SpectrioError

from .reference import (
    HEADER_WORDS,
    MAX_WIDTH,
    RECORD_VERSION,
    check_slot_shapes,
    pack_topk_ref,
    speculate_save_ref,
)

if TYPE_CHECKING:  # pragma: no cover
    import cupy

__all__ = [
    "KERNEL_SOURCES",
    "SPECULATE_SAVE_MAX_BSZ",
    "KernelUnavailable",
    "is_host_array",
    "kernel_source",
    "pack_topk",
    "pack_topk_any",
    "speculate_save",
    "speculate_save_any",
    "to_host",
]

KERNEL_SOURCES: dict[str, str] = {
    "speculate_save": "speculate_save.cu",
    "pack_topk": "pack_topk.cu",
    "step_record": "step_record.cu",
}
"""Kernel name -> source file in this package."""

SPECULATE_SAVE_MAX_BSZ = 1024
"""Largest batch ``speculate_save`` handles: it scans in one thread block.
Must equal ``SPECULATE_SAVE_MAX_BSZ`` in ``speculate_save.cu``."""

_PACK_TOPK_THREADS = 256
_PACK_TOPK_MAX_BLOCKS = 4096
_DLPACK_CPU = 1  # kDLCPU in DLPack's DLDeviceType


class KernelUnavailable(SpectrioError, RuntimeError):
    """Device arrays reached a kernel but CuPy cannot be imported. Raised instead of
    falling back to the host, which would hide a deployment error behind a slow path."""


def kernel_source(name: str) -> str:
    """CUDA C source of kernel ``name``."""
    return resources.files(__package__).joinpath(KERNEL_SOURCES[name]).read_text()


def _source_max_bsz() -> int:
    match = re.search(r"#define\s+SPECULATE_SAVE_MAX_BSZ\s+(\d+)", kernel_source("speculate_save"))
    if match is None:
        raise RuntimeError("speculate_save.cu does not define SPECULATE_SAVE_MAX_BSZ")
    return int(match.group(1))


@functools.cache
def _cupy() -> Any:
    try:
        import cupy  # lazy by design: CPU installs never import it
    except ImportError as exc:
        raise KernelUnavailable(
            f"arrays on a GPU need CuPy for the step-record kernels, but it cannot be "
            f"imported ({exc}); install spectrio[gpu] or pass host (NumPy) arrays"
        ) from exc
    return cupy


@functools.cache
def _kernel(name: str, device_id: int) -> Any:
    """The compiled kernel for one device (RawModule compiles per device lazily)."""
    del device_id  # part of the cache key only
    if name == "speculate_save" and _source_max_bsz() != SPECULATE_SAVE_MAX_BSZ:
        raise RuntimeError("SPECULATE_SAVE_MAX_BSZ differs between loader.py and the .cu source")
    module = _cupy().RawModule(code=kernel_source(name))
    return module.get_function(name)


def is_host_array(x: Any) -> bool:
    """True for NumPy arrays and any ``__dlpack__`` array that lives in host memory."""
    if isinstance(x, np.ndarray):
        return True
    device = getattr(x, "__dlpack_device__", None)
    if device is None:
        return True  # lists, scalars: host data
    return int(device()[0]) == _DLPACK_CPU


def to_host(x: Any, *, stream: Any = None) -> np.ndarray:
    """``x`` as a host NumPy array: host data as it is (a DLPack view where it has one),
    device data copied on ``stream`` (the stream its producer ordered on) and
    synchronised."""
    if is_host_array(x):
        if isinstance(x, np.ndarray) or not hasattr(x, "__dlpack__"):
            return np.asarray(x)
        return np.from_dlpack(x)
    cp = _cupy()
    if stream is None:
        raise ValueError("device inputs need an explicit stream=")
    with stream:
        host = cp.asnumpy(x if isinstance(x, cp.ndarray) else cp.from_dlpack(x), stream=stream)
    stream.synchronize()
    return np.asarray(host)


def _device(x: Any, dtype: Any) -> cupy.ndarray:
    """A contiguous CuPy array of ``dtype`` viewing (or converted from) ``x``; host
    inputs are uploaded, so a step may mix host and device arrays.
    Must be called inside ``with stream:`` so DLPack exchange orders on it."""
    cp = _cupy()
    if isinstance(x, cp.ndarray):
        arr = x
    elif is_host_array(x):
        arr = cp.asarray(to_host(x))
    else:
        arr = cp.from_dlpack(x)
    return cp.ascontiguousarray(arr.astype(dtype, copy=False))


def speculate_save(
    accepted_tokens: Any,
    accept_counts: Any,
    preempted: Any,
    seq_lens_decoder: Any,
    prompt_lens: Any,
    *,
    kind: int,
    width: int = 0,
    stream: Any,
) -> cupy.ndarray:
    """Launch ``speculate_save`` on ``stream``.

    Inputs are device ``__dlpack__`` arrays with the shapes of
    :func:`~spectrio.cuda_kernels.reference.speculate_save_ref`; integer
    inputs are converted to int32 and ``preempted`` to uint8.

    Returns:
        int32 CuPy array of capacity ``4 + bsz + bsz * (k + 1)``. Its first
        ``4 + bsz + out[3]`` words are the record head (header, accept_num,
        token_ids), equal to the reference's output; the rest is unspecified.
    """
    cp = _cupy()
    if not 0 <= kind <= 0xFF:
        raise ValueError(f"record kind must fit in 8 bits (0..255), got {kind}")
    if not 0 <= width <= MAX_WIDTH:
        raise ValueError(f"record width must be in [0, {MAX_WIDTH}], got {width}")
    with stream:
        tokens = _device(accepted_tokens, cp.int32)
        if tokens.ndim != 2:
            raise ValueError(f"accepted_tokens must be [bsz, k+1], got shape {tokens.shape}")
        bsz, cols = (int(s) for s in tokens.shape)
        if bsz > SPECULATE_SAVE_MAX_BSZ:
            raise ValueError(
                f"speculate_save handles bsz <= {SPECULATE_SAVE_MAX_BSZ} (one thread block), "
                f"got {bsz}"
            )
        counts = _device(accept_counts, cp.int32)
        pre = _device(preempted, cp.uint8)
        dec = _device(seq_lens_decoder, cp.int32)
        plen = _device(prompt_lens, cp.int32)
        check_slot_shapes(
            bsz, accept_counts=counts, preempted=pre, seq_lens_decoder=dec, prompt_lens=plen
        )
        out = cp.empty(HEADER_WORDS + bsz + bsz * cols, dtype=cp.int32)
        threads = max(32, 1 << max(bsz - 1, 0).bit_length())
        kernel = _kernel("speculate_save", cp.cuda.Device().id)
        kernel(
            (1,),
            (threads,),
            (
                tokens,
                counts,
                pre,
                dec,
                plen,
                np.int32(bsz),
                np.int32(cols),
                np.int32(RECORD_VERSION),
                np.int32((kind & 0xFF) | (width << 8)),
                out,
            ),
        )
    return out


def pack_topk(
    topk_ids: Any,
    topk_vals: Any,
    ranks: Any,
    topn: Any,
    width: int,
    *,
    stream: Any,
) -> tuple[cupy.ndarray, cupy.ndarray, cupy.ndarray]:
    """Launch ``pack_topk`` on ``stream``.

    Inputs are device ``__dlpack__`` arrays with the shapes of
    :func:`~spectrio.cuda_kernels.reference.pack_topk_ref` (ids, ranks and
    topn converted to int32, values to float32).

    Returns:
        ``(lp_ids int32 [num_tokens, width], lp_vals float32 [num_tokens, width],
        ranks int32 [num_tokens])`` as CuPy arrays.
    """
    cp = _cupy()
    with stream:
        ids = _device(topk_ids, cp.int32)
        vals = _device(topk_vals, cp.float32)
        rk = _device(ranks, cp.int32)
        n = _device(topn, cp.int32)
        if ids.ndim != 2 or vals.shape != ids.shape:
            raise ValueError(
                f"topk_ids/topk_vals must be matching 2-D, got {ids.shape}, {vals.shape}"
            )
        num_tokens, w_max = (int(s) for s in ids.shape)
        if rk.shape != (num_tokens,) or n.shape != (num_tokens,):
            raise ValueError(f"ranks and topn must have shape [{num_tokens}]")
        if not 1 <= width <= w_max:
            raise ValueError(f"width must be in [1, {w_max}], got {width}")
        lp_ids = cp.empty((num_tokens, width), dtype=cp.int32)
        lp_vals = cp.empty((num_tokens, width), dtype=cp.float32)
        out_ranks = cp.empty(num_tokens, dtype=cp.int32)
        total = num_tokens * width
        if total:
            blocks = min(_PACK_TOPK_MAX_BLOCKS, -(-total // _PACK_TOPK_THREADS))
            kernel = _kernel("pack_topk", cp.cuda.Device().id)
            kernel(
                (blocks,),
                (_PACK_TOPK_THREADS,),
                (
                    ids,
                    vals,
                    rk,
                    n,
                    np.int32(num_tokens),
                    np.int32(w_max),
                    np.int32(width),
                    lp_ids,
                    lp_vals,
                    out_ranks,
                ),
            )
    return lp_ids, lp_vals, out_ranks


def speculate_save_any(
    accepted_tokens: Any,
    accept_counts: Any,
    preempted: Any,
    seq_lens_decoder: Any,
    prompt_lens: Any,
    *,
    kind: int,
    width: int = 0,
    stream: Any = None,
) -> np.ndarray:
    """Record head as a host int32 array: the reference for host inputs, the
    kernel (on ``stream``, then synchronised) for device inputs."""
    inputs = (accepted_tokens, accept_counts, preempted, seq_lens_decoder, prompt_lens)
    if all(is_host_array(x) for x in inputs):
        tokens, counts, pre, dec, plen = (to_host(x) for x in inputs)
        return speculate_save_ref(tokens, counts, pre, dec, plen, kind, width)
    cp = _cupy()
    if stream is None:
        raise ValueError("device inputs need an explicit stream=")
    out = speculate_save(*inputs, kind=kind, width=width, stream=stream)
    host = cp.asnumpy(out, stream=stream)
    stream.synchronize()
    bsz = int(host[2])
    return host[: HEADER_WORDS + bsz + int(host[3])].astype("<i4", copy=False)


def pack_topk_any(
    topk_ids: Any,
    topk_vals: Any,
    ranks: Any,
    topn: Any,
    width: int,
    *,
    stream: Any = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Logprob block as host arrays: the reference for host inputs, the kernel
    (on ``stream``, then synchronised) for device inputs."""
    inputs = (topk_ids, topk_vals, ranks, topn)
    if all(is_host_array(x) for x in inputs):
        ids, vals, rk, n = (to_host(x) for x in inputs)
        return pack_topk_ref(ids, vals, rk, n, width)
    cp = _cupy()
    if stream is None:
        raise ValueError("device inputs need an explicit stream=")
    lp_ids, lp_vals, out_ranks = pack_topk(*inputs, width, stream=stream)
    result = (
        cp.asnumpy(lp_ids, stream=stream),
        cp.asnumpy(lp_vals, stream=stream),
        cp.asnumpy(out_ranks, stream=stream),
    )
    stream.synchronize()
    return result
