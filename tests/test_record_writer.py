"""The persistent GPU record path: its pure rules on the CPU, the writer on a GPU.

CPU: sizes, the capture plan, the pinned-buffer reuse rule, and the per-(slot, position)
reference against :func:`spectrio.cuda_kernels.reference.pack_step_record`. GPU (skipped without
CuPy and a device): a fuzz of random steps through :class:`RecordWriter` in both modes,
with and without graphs, from CuPy and torch buffers, byte for byte against the
reference; two records in flight; the ring's refusals; construction errors.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import spectrio.cuda_kernels as ck
from spectrio.core.config import BASE_CAPTURE_SIZES
from spectrio.core.record import record_nbytes, unpack
from spectrio.cuda_kernels import record_layout, record_writer
from spectrio.cuda_kernels.record_layout import (
    RecordRing,
    RingExhausted,
    capacity_words,
    capture_size_for,
    compact_rows,
    record_capture_sizes,
    record_words,
    step_record_ref,
)
from spectrio.cuda_kernels.reference import KIND_DRAFT, KIND_TARGET, pack_step_record

# ------------------------------------------------------------------ CPU: rules


def test_record_words_matches_the_wire_size() -> None:
    for bsz, n, w in [(0, 0, 0), (1, 4, 0), (5, 4, 6), (1024, 4096, 21)]:
        assert 4 * record_words(bsz, n, w) == record_nbytes(bsz, n, w)
    # The worst record: batch 1024, k = 3, top-20, every draft accepted.
    assert 4 * capacity_words(1024, 4, 21) == 4 * (4 + 1024 + 4096 + 2 * 4096 * 21 + 4096)
    with pytest.raises(ValueError):
        capacity_words(4, 0, 1)


def test_capture_plan_follows_the_runtime_base_list() -> None:
    sizes = record_capture_sizes(BASE_CAPTURE_SIZES, 100)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-2:] == [96, 100]
    assert record_capture_sizes(BASE_CAPTURE_SIZES, 1024)[-1] == 1024
    assert capture_size_for(sizes, 0) == 1  # an empty record still runs on the smallest
    assert capture_size_for(sizes, 3) == 4
    assert capture_size_for(sizes, 97) == 100
    with pytest.raises(ValueError, match="largest captured"):
        capture_size_for(sizes, 101)
    with pytest.raises(ValueError):
        record_capture_sizes(BASE_CAPTURE_SIZES, 1025)


def test_ring_never_hands_out_a_held_buffer() -> None:
    ring = RecordRing(3)
    a, b, c = ring.acquire(), ring.acquire(), ring.acquire()
    assert sorted((a, b, c)) == [0, 1, 2]
    with pytest.raises(RingExhausted):
        ring.acquire()
    sent = {"done": False}
    ring.release_when(b, lambda: sent["done"])
    with pytest.raises(RingExhausted):  # the frame over b is not sent yet
        ring.acquire()
    sent["done"] = True
    assert ring.acquire() == b
    ring.release(a)
    assert ring.acquire() == a
    ring.release(c)
    with pytest.raises(ValueError, match="not held"):
        ring.release(c)
    with pytest.raises(ValueError, match="not held"):
        ring.release_when(c, lambda: True)


def test_ring_round_robin_delays_reuse() -> None:
    ring = RecordRing(3)
    first = ring.acquire()
    ring.release(first)
    # The next buffer is not the one just released: a frame that pyzmq still reads
    # from is left alone one turn longer.
    assert ring.acquire() != first


def random_step(
    rng: np.random.Generator, bsz: int, cols: int, w_max: int, max_topn: int
) -> dict[str, np.ndarray]:
    plen = rng.integers(1, 500, size=bsz).astype(np.int32)
    topn = rng.integers(-1, max_topn + 1, size=bsz).astype(np.int32)
    return {
        "accepted_tokens": rng.integers(0, 1 << 20, size=(bsz, cols)).astype(np.int32),
        "accept_counts": rng.integers(0, cols + 1, size=bsz).astype(np.int32),
        "preempted": rng.random(bsz) < 0.1,
        "seq_lens_decoder": np.where(
            rng.random(bsz) < 0.2, plen - rng.integers(1, 50, size=bsz), plen + 3
        ).astype(np.int32),
        "prompt_lens": plen,
        "topn": topn,
        "topk_ids": rng.integers(0, 1 << 20, size=(bsz, cols, w_max)).astype(np.int32),
        "topk_vals": (-rng.exponential(3.0, size=(bsz, cols, w_max))).astype(np.float32),
        "ranks": rng.integers(1, 1000, size=(bsz, cols)).astype(np.int32),
    }


def test_per_slot_reference_equals_the_record_order_packer() -> None:
    rng = np.random.default_rng(0)
    for bsz, cols, w_max, max_topn in [(0, 3, 4, 3), (1, 1, 1, 0), (37, 4, 21, 20), (200, 9, 6, 5)]:
        s = random_step(rng, bsz, cols, w_max, max_topn)
        head = (
            s["accepted_tokens"],
            s["accept_counts"],
            s["preempted"],
            s["seq_lens_decoder"],
            s["prompt_lens"],
        )
        width = ck.record_width(s["topn"])
        got = step_record_ref(
            *head,
            kind=KIND_DRAFT,
            width=width,
            topn=s["topn"],
            topk_ids=s["topk_ids"],
            topk_vals=s["topk_vals"],
            ranks=s["ranks"],
        )
        accept_num = unpack(got.tobytes()).accept_num
        expected = pack_step_record(
            *head,
            kind=KIND_DRAFT,
            logprobs=s["topn"],
            topk_ids=compact_rows(s["topk_ids"], accept_num),
            topk_vals=compact_rows(s["topk_vals"], accept_num),
            ranks=compact_rows(s["ranks"], accept_num),
        )
        assert got.tobytes() == expected


def test_kernel_constants_match_the_source() -> None:
    src = (Path(ck.__file__).parent / "step_record.cu").read_text()

    def define(name: str) -> int:
        match = re.search(rf"#define\s+{name}\s+(\d+)", src)
        assert match is not None, name
        return int(match.group(1))

    assert define("STEP_RECORD_MAX_BSZ") == record_layout.STEP_RECORD_MAX_BSZ
    assert define("STEP_RECORD_THREADS") == record_writer.STEP_RECORD_THREADS


def test_writer_without_cupy_or_gpu_says_why() -> None:
    if _cupy_or_none() is not None:
        pytest.skip("a GPU is present")
    with pytest.raises((ck.KernelUnavailable, ValueError, RuntimeError)):
        ck.RecordWriter(ck.RecordInputs(*(np.zeros((2, 2), np.int32),) * 5), stream=None)


# ------------------------------------------------------------------ GPU


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


class Buffers:
    """Persistent device inputs for a writer, from CuPy or torch, refilled in place."""

    def __init__(self, lib: str, max_bsz: int, max_cols: int, w_max: int, compact: bool) -> None:
        self.lib = lib
        self.compact = compact
        lp_shape: tuple[int, ...] = (max_bsz, max_cols, w_max)
        rk_shape: tuple[int, ...] = (max_bsz, max_cols)
        if compact:
            lp_shape, rk_shape = (max_bsz * max_cols, w_max), (max_bsz * max_cols,)
        shapes = {
            "accepted_tokens": ((max_bsz, max_cols), "int32"),
            "accept_counts": ((max_bsz,), "int32"),
            "preempted": ((max_bsz,), "bool"),
            "seq_lens_decoder": ((max_bsz,), "int32"),
            "prompt_lens": ((max_bsz,), "int32"),
            "topn": ((max_bsz,), "int32"),
            "topk_ids": (lp_shape, "int32"),
            "topk_vals": (lp_shape, "float32"),
            "ranks": (rk_shape, "int32"),
        }
        self.arrays: dict[str, Any] = {}
        for name, (shape, dtype) in shapes.items():
            if lib == "torch":
                import torch

                t = torch.full(shape, 7, dtype=getattr(torch, dtype), device="cuda")
            else:
                import cupy

                t = cupy.full(shape, 7, dtype=dtype)
            self.arrays[name] = t

    def inputs(self) -> ck.RecordInputs:
        return ck.RecordInputs(**self.arrays)

    def fill(self, step: dict[str, np.ndarray], accept_num: np.ndarray | None) -> None:
        """Copy a step's host arrays into the first rows of the persistent buffers."""
        for name, host in step.items():
            if self.compact and name in ("topk_ids", "topk_vals", "ranks"):
                assert accept_num is not None
                host = compact_rows(host, accept_num)
            dst = self.arrays[name]
            idx = tuple(slice(0, n) for n in host.shape)
            if self.lib == "torch":
                import torch

                dst[idx].copy_(torch.from_numpy(np.ascontiguousarray(host)).to(dst.device))
            else:
                import cupy

                dst[idx] = cupy.asarray(host)
        # The writer's stream does not wait on the default stream these copies ran on.
        if self.lib == "torch":
            import torch

            torch.cuda.synchronize()
        else:
            import cupy

            cupy.cuda.runtime.deviceSynchronize()


def _expected(step: dict[str, np.ndarray], kind: int, width: int) -> bytes:
    head = [
        step[n]
        for n in (
            "accepted_tokens",
            "accept_counts",
            "preempted",
            "seq_lens_decoder",
            "prompt_lens",
        )
    ]
    return step_record_ref(
        *head,
        kind=kind,
        width=width,
        topn=step["topn"],
        topk_ids=step["topk_ids"],
        topk_vals=step["topk_vals"],
        ranks=step["ranks"],
    ).tobytes()


@gpu
@pytest.mark.parametrize("mode", ["mapped", "copy"])
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("lib", ["cupy", "torch"])
@pytest.mark.parametrize("compact", [False, True])
def test_writer_fuzz_matches_reference(
    cp_stream: tuple[Any, Any], mode: str, graphs: bool, lib: str, compact: bool
) -> None:
    if lib == "torch":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch without CUDA")
    cp, stream = cp_stream
    rng = np.random.default_rng(hash((mode, graphs, lib, compact)) % (1 << 32))
    for max_bsz, max_cols, w_max in [(1, 1, 1), (16, 4, 21), (300, 9, 21), (1024, 4, 6)]:
        bufs = Buffers(lib, max_bsz, max_cols, w_max, compact)
        sizes = record_capture_sizes(ck_base(), max_bsz)
        with ck.RecordWriter(
            bufs.inputs(), stream=stream, capture_sizes=sizes, mode=mode, graphs=graphs
        ) as writer:
            for _ in range(25):
                bsz = int(rng.integers(0, max_bsz + 1))
                cols = int(rng.integers(1, max_cols + 1))
                step = random_step(rng, bsz, cols, w_max, int(rng.integers(0, w_max)))
                width = ck.record_width(step["topn"]) if rng.random() < 0.7 else 0
                if width == 0:
                    step["topn"][:] = -1
                kind = int(rng.choice([KIND_TARGET, KIND_DRAFT, 255]))
                expected = _expected(step, kind, width)
                accept_num = unpack(expected).accept_num
                bufs.fill(step, accept_num)
                record = writer.write(bsz, cols=cols, kind=kind, width=width)
                assert record.data.tobytes() == expected
                record.release()


def ck_base() -> tuple[int, ...]:
    return BASE_CAPTURE_SIZES


@gpu
def test_counts_out_of_range_are_clamped(cp_stream: tuple[Any, Any]) -> None:
    cp, stream = cp_stream
    rng = np.random.default_rng(1)
    bufs = Buffers("cupy", 64, 4, 3, False)
    step = random_step(rng, 64, 4, 3, 2)
    bad = step["accept_counts"].copy()
    bad[::3] = 9
    bad[1::7] = -4
    step["accept_counts"] = np.clip(bad, 0, 4).astype(np.int32)
    expected = _expected(step, KIND_TARGET, 3)
    bufs.fill({**step, "accept_counts": bad}, unpack(expected).accept_num)
    with ck.RecordWriter(bufs.inputs(), stream=stream) as writer:
        record = writer.write(64, cols=4, kind=KIND_TARGET, width=3)
        assert record.data.tobytes() == expected


@gpu
def test_two_records_in_flight_and_the_ring(cp_stream: tuple[Any, Any]) -> None:
    cp, stream = cp_stream
    rng = np.random.default_rng(2)
    bufs = Buffers("cupy", 32, 3, 4, False)
    with ck.RecordWriter(bufs.inputs(), stream=stream, ring_size=2) as writer:
        first = random_step(rng, 32, 3, 4, 3)
        bufs.fill(first, None)
        pending_a = writer.launch(32, cols=3, kind=KIND_TARGET, width=4)
        # The second step's inputs are produced on the same stream after the first
        # record's launch, as a sampler's next step would write them.
        second = random_step(rng, 20, 3, 4, 3)
        with stream:
            for name, host in second.items():
                idx = tuple(slice(0, s) for s in host.shape)
                bufs.arrays[name][idx] = cp.asarray(host)
        pending_b = writer.launch(20, cols=3, kind=KIND_DRAFT, width=4)
        a, b = pending_a.wait(), pending_b.wait()
        assert a.data.tobytes() == _expected(first, KIND_TARGET, 4)
        assert b.data.tobytes() == _expected(second, KIND_DRAFT, 4)
        with pytest.raises(RingExhausted):
            writer.launch(1, cols=1, kind=KIND_TARGET)
        sent = {"done": False}
        a.release_when(lambda: sent["done"])
        with pytest.raises(RingExhausted):
            writer.launch(1, cols=1, kind=KIND_TARGET)
        sent["done"] = True
        writer.write(1, cols=1, kind=KIND_TARGET).release()
        b.release()


@gpu
def test_writer_refuses_what_it_cannot_trust(cp_stream: tuple[Any, Any]) -> None:
    cp, stream = cp_stream
    bufs = Buffers("cupy", 8, 2, 3, False)
    good = bufs.arrays
    with pytest.raises(ValueError, match="int32"):
        ck.RecordWriter(
            ck.RecordInputs(**{**good, "accept_counts": good["accept_counts"].astype("int64")}),
            stream=stream,
        )
    with pytest.raises(ValueError, match="CUDA array"):
        ck.RecordWriter(
            ck.RecordInputs(**{**good, "prompt_lens": np.zeros(8, np.int32)}), stream=stream
        )
    with pytest.raises(ValueError, match="non-default"):
        ck.RecordWriter(bufs.inputs(), stream=cp.cuda.Stream.null)
    with pytest.raises(ValueError, match="per-slot candidates"):
        ck.RecordWriter(
            ck.RecordInputs(**{**good, "ranks": cp.zeros((8, 3), cp.int32)}), stream=stream
        )
    with ck.RecordWriter(bufs.inputs(), stream=stream, capture_sizes=[2, 8]) as writer:
        for kwargs, match in [
            ({"bsz": 9, "cols": 1, "kind": 3}, "bsz"),
            ({"bsz": 1, "cols": 3, "kind": 3}, "cols"),
            ({"bsz": 1, "cols": 1, "kind": 256}, "8 bits"),
            ({"bsz": 1, "cols": 1, "kind": 3, "width": 4}, "width"),
        ]:
            with pytest.raises(ValueError, match=match):
                writer.launch(**kwargs)
