"""The step record's host/device dispatch (stages/output/records.py): NumPy columns take the
reference, device columns take the CuPy kernels, and both give the same bytes.

The device tests need CuPy and a visible GPU and are skipped otherwise.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from spectrio.core.messages import Ended, SeqResult, StepResult, TokenLogprob
from spectrio.core.record import PREEMPTED, unpack
from spectrio.cuda_kernels import KernelUnavailable, loader, record_width, speculate_save_ref
from spectrio.cuda_kernels.reference import pack_step_record
from spectrio.errors import SpectrioError
from spectrio.stages.output.records import (
    StepArrays,
    on_device,
    pack_record,
    publish_step,
    step_arrays,
)

DLPACK_CPU, DLPACK_CUDA = 1, 2


def seq(
    slot: int,
    tokens: list[int],
    *,
    computed: int = 64,
    context: int = 64,
    logprobs: int | None = None,
    reason: str | None = None,
) -> SeqResult:
    lps = None
    if logprobs is not None and tokens:
        lps = [
            TokenLogprob(
                token_id=t,
                logprob=-0.25 * (j + 1),
                rank=j + 1,
                top=[(1000 * slot + c, -0.1 * (c + 1)) for c in range(logprobs)],
            )
            for j, t in enumerate(tokens)
        ]
    return SeqResult(
        slot=slot,
        seq_id=slot + 1,
        request_id=f"r{slot}",
        num_drafts=3,
        num_accepted=max(len(tokens) - 1, 0),
        token_ids=tokens,
        finish_reason=reason,
        logprobs=lps,
        num_logprobs=logprobs,
        num_computed=computed,
        context_len=context,
    )


def rich_step(*, logprobs: bool = True) -> StepResult:
    """Every kind of slot: drafts accepted, prefill in progress (0), its last chunk
    emitting, a stop, top-N of widths 0, 3, 5 and 20 beside a slot asking for none,
    and preempted and aborted requests (-9)."""

    def lp(n: int) -> int | None:
        return n if logprobs else None

    return StepResult(
        step=41,
        results=[
            seq(0, [11, 12, 13, 14], logprobs=lp(20)),  # all three drafts accepted
            seq(1, [21, 22]),  # one draft accepted, no logprobs
            seq(2, [], computed=32, context=96),  # chunked prefill in progress
            seq(3, [31], logprobs=lp(0)),  # the sampled token only
            seq(4, [41, 42, 43], logprobs=lp(5), reason="stop"),
            seq(5, [51], computed=96, context=96, logprobs=lp(3)),  # last prefill chunk
        ],
        ended=[Ended(0, "p0", "preempted"), Ended(0, "p1", "preempted"), Ended(0, "a0", "aborted")],
    )


def random_arrays(rng: np.random.Generator, bsz: int, cols: int, max_topn: int) -> StepArrays:
    """Random columns, including prefill and preempted slots with nonzero counts (which
    the record must stamp 0 and -9) and slots asking for no logprobs."""
    tokens = rng.integers(0, 1 << 20, size=(bsz, cols)).astype(np.int32)
    counts = rng.integers(0, cols + 1, size=bsz).astype(np.int32)
    pre = rng.random(bsz) < 0.15
    plen = rng.integers(1, 500, size=bsz).astype(np.int32)
    dec = np.where(rng.random(bsz) < 0.2, plen - 1, plen + 3).astype(np.int32)
    topn = rng.integers(-1, max_topn + 1, size=bsz).astype(np.int32)
    num_tokens = int(speculate_save_ref(tokens, counts, pre, dec, plen, 3)[3])
    w_max = max(record_width(topn), 1) + 2
    ids = rng.integers(0, 1 << 20, size=(num_tokens, w_max)).astype(np.int32)
    vals = (-rng.exponential(3.0, size=(num_tokens, w_max))).astype(np.float32)
    ranks = rng.integers(1, 1000, size=num_tokens).astype(np.int32)
    return StepArrays(tokens, counts, pre, dec, plen, topn, ids, vals, ranks)


def columns(a: StepArrays) -> list[Any]:
    return [getattr(a, f.name) for f in dataclasses.fields(a) if f.name != "kind"]


def reference_bytes(a: StepArrays) -> bytes:
    tokens, counts, pre, dec, plen, topn, ids, vals, ranks = columns(a)
    return pack_step_record(
        tokens, counts, pre, dec, plen, logprobs=topn, topk_ids=ids, topk_vals=vals, ranks=ranks
    )


class HostDLPack:
    """A framework array in host memory, seen only through the DLPack protocol."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return DLPACK_CPU, 0


class FakeCudaArray:
    """Claims to live on CUDA device 0; any attempt to read it on the host fails."""

    shape = (3, 2)

    def __dlpack__(self, **kwargs: Any) -> Any:
        raise BufferError("a CUDA array cannot be exported to the host")

    def __dlpack_device__(self) -> tuple[int, int]:
        return DLPACK_CUDA, 0


# ------------------------------------------------------------------- host path


def test_host_columns_take_the_reference() -> None:
    step = rich_step()
    host = step_arrays(step)
    assert not on_device(host)
    record = pack_record(host)
    assert record == publish_step(step).record == reference_bytes(host)
    rec = unpack(record)
    assert rec.accept_num.tolist() == [4, 2, 0, 1, 3, 1, PREEMPTED, PREEMPTED, PREEMPTED]
    assert rec.width == 21


def test_host_dlpack_arrays_take_the_reference() -> None:
    # Without CuPy installed here, a wrong turn to the kernels would raise.
    arrays = random_arrays(np.random.default_rng(1), 40, 4, 20)
    wrapped = StepArrays(*(HostDLPack(np.asarray(x)) for x in columns(arrays)))
    assert not on_device(wrapped)
    assert pack_record(wrapped) == reference_bytes(arrays)


def test_a_cuda_column_routes_to_the_kernels() -> None:
    host = step_arrays(rich_step())
    for name in ("accepted_tokens", "preempted", "logprobs", "ranks"):
        assert on_device(dataclasses.replace(host, **{name: FakeCudaArray()}))


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed")
def test_cuda_columns_without_cupy_raise_kernel_unavailable() -> None:
    host = step_arrays(rich_step())
    for name in ("accepted_tokens", "logprobs"):
        device = dataclasses.replace(host, **{name: FakeCudaArray()})
        with pytest.raises(KernelUnavailable, match="CuPy") as err:
            pack_record(device)
        assert isinstance(err.value, SpectrioError)
        assert isinstance(err.value.__cause__, ImportError)


def test_records_import_neither_cupy_nor_paddle() -> None:
    code = (
        "import sys, spectrio.stages.output.records\n"
        "assert 'cupy' not in sys.modules and 'paddle' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ------------------------------------------------------------ device path


def _cupy_or_none() -> Any:
    try:
        import cupy
    except Exception:  # noqa: BLE001 - any import failure means "no GPU path"
        return None
    try:
        return cupy if cupy.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        return None


gpu = pytest.mark.skipif(_cupy_or_none() is None, reason="needs cupy and a CUDA device")


@pytest.fixture
def cp_stream() -> Iterator[tuple[Any, Any]]:
    cp = _cupy_or_none()
    assert cp is not None
    stream = cp.cuda.Stream(non_blocking=True)
    yield cp, stream
    stream.synchronize()


def kernel_calls() -> int:
    """Kernel look-ups so far: each launch fetches its compiled kernel from this cache."""
    info = loader._kernel.cache_info()
    return info.hits + info.misses


def to_device(cp: Any, stream: Any, a: StepArrays) -> StepArrays:
    with stream:
        moved = [None if x is None else cp.asarray(x) for x in columns(a)]
    return StepArrays(*moved, kind=a.kind)


STEPS = {
    "rich": rich_step(),
    "no-logprobs": rich_step(logprobs=False),
    "preempted-only": StepResult(
        step=2, results=[], ended=[Ended(0, "x", "preempted"), Ended(0, "y", "aborted")]
    ),
}


@gpu
@pytest.mark.parametrize("name", list(STEPS))
def test_whole_step_record_same_bytes_on_both_paths(cp_stream: tuple[Any, Any], name: str) -> None:
    cp, stream = cp_stream
    step = STEPS[name]
    host = step_arrays(step)
    expected = publish_step(step).record
    device = to_device(cp, stream, host)
    assert on_device(device)
    launched = kernel_calls()
    assert pack_record(device, stream=stream) == expected
    assert kernel_calls() > launched  # the kernels ran, not a host copy
    # A step may mix columns: tokens on the device, the rest still on the host.
    mixed = dataclasses.replace(host, accepted_tokens=device.accepted_tokens)
    assert pack_record(mixed, stream=stream) == expected


@gpu
@pytest.mark.parametrize(("bsz", "cols", "max_topn"), [(1, 1, -1), (33, 4, 0), (257, 4, 20)])
def test_random_steps_same_bytes_on_both_paths(
    cp_stream: tuple[Any, Any], bsz: int, cols: int, max_topn: int
) -> None:
    cp, stream = cp_stream
    rng = np.random.default_rng(bsz + cols)
    for _ in range(3):
        host = random_arrays(rng, bsz, cols, max_topn)
        device = to_device(cp, stream, host)
        wide = dataclasses.replace(
            device,
            accepted_tokens=device.accepted_tokens.astype(cp.int64),
            topk_vals=device.topk_vals.astype(cp.float64),
        )
        assert pack_record(device, stream=stream) == reference_bytes(host)
        assert pack_record(wide, stream=stream) == reference_bytes(host)


@gpu
def test_device_columns_need_a_stream_and_whole_logprob_columns(
    cp_stream: tuple[Any, Any],
) -> None:
    cp, stream = cp_stream
    device = to_device(cp, stream, step_arrays(rich_step()))
    with pytest.raises(ValueError, match="stream"):
        pack_record(device)
    with pytest.raises(ValueError, match="required"):
        pack_record(dataclasses.replace(device, ranks=None), stream=stream)
    with pytest.raises(ValueError, match="rows"):
        pack_record(dataclasses.replace(device, topk_ids=device.topk_ids[1:]), stream=stream)
