"""CUDA step-record kernels: nvcc compile check, CPU dispatch, and kernel vs reference.

The compile check needs only ``nvcc`` (``-ptx`` works without a GPU). The
kernel tests need CuPy and a visible GPU and are skipped otherwise.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import spectrio.cuda_kernels as ck
from spectrio.cuda_kernels import loader
from spectrio.cuda_kernels.reference import (
    KIND_DRAFT,
    KIND_TARGET,
    expand_per_token,
    pack_topk_ref,
    record_width,
    speculate_save_ref,
)

KERNEL_DIR = Path(ck.__file__).parent
CU_FILES = sorted(KERNEL_DIR.glob("*.cu"))


# ------------------------------------------------------------- compile check


def test_every_kernel_has_a_source_file() -> None:
    assert {p.name for p in CU_FILES} >= set(loader.KERNEL_SOURCES.values())


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("source", CU_FILES, ids=[p.name for p in CU_FILES])
def test_nvcc_compiles_to_ptx(source: Path, tmp_path: Path) -> None:
    nvcc = shutil.which("nvcc")
    assert nvcc is not None
    ptx = tmp_path / (source.stem + ".ptx")
    proc = subprocess.run(
        [nvcc, "-ptx", "-o", str(ptx), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    text = ptx.read_text()
    # extern "C": the entry point keeps its plain name for RawModule.get_function.
    names = [k for k, v in loader.KERNEL_SOURCES.items() if v == source.name]
    for name in names:
        assert re.search(rf"\.entry\s+{name}\s*\(", text), f"no unmangled entry {name}"


def test_max_bsz_matches_source() -> None:
    src = loader.kernel_source("speculate_save")
    match = re.search(r"#define\s+SPECULATE_SAVE_MAX_BSZ\s+(\d+)", src)
    assert match is not None
    assert int(match.group(1)) == loader.SPECULATE_SAVE_MAX_BSZ == 1024


def test_importing_kernels_does_not_import_cupy() -> None:
    code = (
        "import sys, spectrio.cuda_kernels, spectrio.core.record; assert 'cupy' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---------------------------------------------------------------- inputs


def random_step(
    rng: np.random.Generator, bsz: int, cols: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    tokens = rng.integers(0, 1 << 20, size=(bsz, cols)).astype(np.int32)
    counts = rng.integers(0, cols + 1, size=bsz).astype(np.int32)
    pre = rng.random(bsz) < 0.1
    plen = rng.integers(1, 500, size=bsz).astype(np.int32)
    dec = np.where(rng.random(bsz) < 0.2, plen - rng.integers(1, 50, size=bsz), plen + 3)
    return tokens, counts, pre, dec.astype(np.int32), plen


def random_topk(
    rng: np.random.Generator, num_tokens: int, w_max: int, max_topn: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    ids = rng.integers(0, 1 << 20, size=(num_tokens, w_max)).astype(np.int32)
    vals = (-rng.exponential(3.0, size=(num_tokens, w_max))).astype(np.float32)
    ranks = rng.integers(1, 1000, size=num_tokens).astype(np.int32)
    topn = rng.integers(-1, max_topn + 1, size=num_tokens).astype(np.int32)
    return ids, vals, ranks, topn


# ------------------------------------------------------------ CPU dispatch


def test_host_inputs_dispatch_to_reference() -> None:
    rng = np.random.default_rng(0)
    step = random_step(rng, 9, 3)
    out = ck.speculate_save_any(*step, kind=KIND_DRAFT, width=4)
    assert out.tobytes() == speculate_save_ref(*step, KIND_DRAFT, 4).tobytes()
    assert ck.is_host_array(step[0]) and ck.is_host_array([1, 2])

    ids, vals, ranks, topn = random_topk(rng, 11, 21, 7)
    got = ck.pack_topk_any(ids, vals, ranks, topn, 8)
    ref = pack_topk_ref(ids, vals, ranks, topn, 8)
    for g, r in zip(got, ref, strict=True):
        assert g.tobytes() == r.tobytes()


# -------------------------------------------------------- GPU: kernel vs ref


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


@gpu
@pytest.mark.parametrize("bsz", [0, 1, 7, 32, 33, 255, 512, 1000, 1024])
@pytest.mark.parametrize("cols", [1, 3, 6])
def test_speculate_save_kernel_matches_reference(
    cp_stream: tuple[Any, Any], bsz: int, cols: int
) -> None:
    cp, stream = cp_stream
    rng = np.random.default_rng(bsz * 10 + cols)
    step = random_step(rng, bsz, cols)
    for kind, width in ((KIND_TARGET, 0), (KIND_DRAFT, 21), (255, 1)):
        ref = speculate_save_ref(*step, kind, width)
        with stream:
            dev = [cp.asarray(x) for x in step]
        out = ck.speculate_save(*dev, kind=kind, width=width, stream=stream)
        stream.synchronize()
        host = cp.asnumpy(out)
        assert host.size == 4 + bsz + bsz * cols
        assert host[: ref.size].tobytes() == ref.tobytes()


@gpu
def test_speculate_save_kernel_accepts_other_dtypes_and_rejects_big_batches(
    cp_stream: tuple[Any, Any],
) -> None:
    cp, stream = cp_stream
    rng = np.random.default_rng(3)
    tokens, counts, pre, dec, plen = random_step(rng, 64, 4)
    ref = speculate_save_ref(tokens, counts, pre, dec, plen, KIND_TARGET)
    host = ck.speculate_save_any(
        cp.asarray(tokens.astype(np.int64)),
        cp.asarray(counts.astype(np.int64)),
        cp.asarray(pre),
        cp.asarray(dec),
        cp.asarray(plen.astype(np.int64)),
        kind=KIND_TARGET,
        stream=stream,
    )
    assert host.tobytes() == ref.tobytes()
    big = random_step(rng, 1025, 2)
    with pytest.raises(ValueError, match="1024"):
        ck.speculate_save(*(cp.asarray(x) for x in big), kind=KIND_TARGET, stream=stream)
    with pytest.raises(ValueError, match="8 bits"):
        ck.speculate_save(*(cp.asarray(x) for x in big), kind=256, stream=stream)


@gpu
@pytest.mark.parametrize(
    ("num_tokens", "w_max", "max_topn"),
    [
        (0, 21, 20),
        (1, 21, 0),
        (37, 21, 20),
        (513, 21, 5),
        (3072, 21, 20),
        (100, 4, 3),
    ],
)
def test_pack_topk_kernel_matches_reference(
    cp_stream: tuple[Any, Any], num_tokens: int, w_max: int, max_topn: int
) -> None:
    cp, stream = cp_stream
    rng = np.random.default_rng(num_tokens + w_max)
    ids, vals, ranks, topn = random_topk(rng, num_tokens, w_max, max_topn)
    for width in sorted({max_topn + 1, w_max}):
        ref = pack_topk_ref(ids, vals, ranks, topn, width)
        with stream:
            dev = [cp.asarray(x) for x in (ids, vals, ranks, topn)]
        got = ck.pack_topk(*dev, width, stream=stream)
        stream.synchronize()
        for g, r in zip(got, ref, strict=True):
            assert cp.asnumpy(g).tobytes() == r.tobytes()


@gpu
def test_full_record_from_kernels_matches_pack_step_record(cp_stream: tuple[Any, Any]) -> None:
    from spectrio.core.record import unpack
    from spectrio.cuda_kernels.reference import pack_step_record

    cp, stream = cp_stream
    rng = np.random.default_rng(11)
    step = random_step(rng, 200, 3)
    logprobs = rng.integers(-1, 21, size=200)
    width = record_width(logprobs)
    head = ck.speculate_save_any(
        *(cp.asarray(x) for x in step), kind=KIND_TARGET, width=width, stream=stream
    )
    bsz = int(head[2])
    n = int(head[3])
    ids, vals, ranks, _ = random_topk(rng, n, 21, 20)
    topn = expand_per_token(logprobs, head[4 : 4 + bsz])
    block = ck.pack_topk_any(
        *(cp.asarray(x) for x in (ids, vals, ranks, topn)), width, stream=stream
    )
    buf = b"".join([head.tobytes()] + [b.tobytes() for b in block])
    expected = pack_step_record(
        *step, kind=KIND_TARGET, logprobs=logprobs, topk_ids=ids, topk_vals=vals, ranks=ranks
    )
    assert buf == expected
    assert unpack(buf).num_tokens == n


@gpu
def test_kernels_take_torch_tensors_through_dlpack(cp_stream: tuple[Any, Any]) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    cp, stream = cp_stream
    rng = np.random.default_rng(5)
    step = random_step(rng, 50, 3)
    ref = speculate_save_ref(*step, KIND_TARGET, 0)
    tensors = [torch.from_numpy(np.ascontiguousarray(x)).cuda() for x in step]
    torch.cuda.synchronize()
    host = ck.speculate_save_any(*tensors, kind=KIND_TARGET, stream=stream)
    assert host.tobytes() == ref.tobytes()
