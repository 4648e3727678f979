"""The serving forward's direct op bindings give what Paddle's public APIs give."""

from __future__ import annotations

import numpy as np
import pytest

from spectrio.models.ops import fast_ops as fo
from spectrio.models.ops.paddle_setup import paddle

# isort: split
import paddle.nn.functional as F


def _t(*shape: int, dtype: str = "float32", seed: int = 0) -> paddle.Tensor:
    return paddle.to_tensor(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


def _same(a: paddle.Tensor, b: paddle.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_bindings_equal_public_apis(dtype: str) -> None:
    x, w, batched = _t(3, 8, dtype=dtype), _t(8, 10, dtype=dtype, seed=1), _t(2, 3, 4, 5)
    with paddle.no_grad():
        _same(fo.matmul(x, w), paddle.matmul(x, w))
        _same(fo.matmul(x, x, transpose_y=True), paddle.matmul(x, x, transpose_y=True))
        _same(fo.reshape(x, [4, 6]), x.reshape([4, 6]))
        for ours, theirs in zip(
            fo.split(w, [3, 7], 1), paddle.split(w, [3, 7], axis=1), strict=True
        ):
            _same(ours, theirs)
        _same(fo.transpose(batched, [1, 0, 2, 3]), batched.transpose([1, 0, 2, 3]))
        index = paddle.to_tensor(np.array([2, 0, 2], dtype=np.int64))
        _same(fo.gather(w, index), paddle.gather(w, index, axis=0))
        _same(fo.lookup_rows(w, index), paddle.gather(w, index, axis=0))
        _same(fo.softmax(batched), F.softmax(batched, axis=-1))
        _same(fo.swiglu(w), F.swiglu(w))
        _same(fo.add(x, x), x + x)
        ours_pool, theirs_pool = (
            paddle.zeros([6, 8], dtype=dtype),
            paddle.zeros([6, 8], dtype=dtype),
        )
        rows = paddle.to_tensor(np.array([4, 1, 5], dtype=np.int64))
        fo.scatter_(ours_pool, rows, x)
        paddle.scatter_(theirs_pool, rows, x, overwrite=True)
        _same(ours_pool, theirs_pool)


def test_fused_rms_norm_matches_the_plain_formula_and_declines_where_it_cannot_run() -> None:
    x, delta, weight = _t(5, 16), _t(5, 16, seed=1), _t(16, seed=2)
    eps = 1e-6

    def plain(v: np.ndarray) -> np.ndarray:
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * weight.numpy()

    if not fo.fused_norm_runs_here():
        pytest.skip("Paddle's fused RMSNorm kernel does not run on this CPU")
    with paddle.no_grad():
        fused = fo.fused_rms_norm(x, weight, eps)
        assert fused is not None
        np.testing.assert_allclose(fused[0].numpy(), plain(x.numpy()), rtol=1e-5, atol=1e-5)
        assert fused[1] is x
        fused = fo.fused_rms_norm(delta, weight, eps, residual=x)
        assert fused is not None
        summed = x.numpy() + delta.numpy()
        np.testing.assert_array_equal(fused[1].numpy(), summed)
        np.testing.assert_allclose(fused[0].numpy(), plain(summed), rtol=1e-5, atol=1e-5)
        # No float64 kernel: the caller must fall back to plain ops.
        assert fo.fused_rms_norm(x.astype("float64"), weight.astype("float64"), eps) is None
    # No CPU backward: never under autograd.
    assert fo.fused_rms_norm(x, weight, eps) is None


def test_the_fused_kernel_is_tried_in_a_child_and_the_answer_kept(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel that may die of an illegal instruction is never first run in-process: a
    child process tries it, the answer is kept per CPU, and it can be forced off."""
    monkeypatch.setenv("SPECTRIO_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SPECTRIO_FUSED_RMS_NORM", raising=False)
    runs = fo.fused_norm_runs_here()
    records = list(tmp_path.glob("fused_rms_norm-*"))  # type: ignore[attr-defined]
    assert len(records) == 1 and records[0].read_text() == ("1" if runs else "0")
    records[0].write_text("0")  # the kept answer is what counts from now on
    assert fo.fused_norm_runs_here() is False
    monkeypatch.setenv("SPECTRIO_FUSED_RMS_NORM", "1")
    assert fo.fused_norm_runs_here() is True
    monkeypatch.setenv("SPECTRIO_FUSED_RMS_NORM", "0")
    monkeypatch.setattr(fo, "_fused_norm", fo._fused_norm)  # both restored after the test
    monkeypatch.setattr(fo, "_fused_norm_checked", False)
    with paddle.no_grad():
        assert fo.fused_rms_norm(_t(2, 8), _t(8), 1e-6) is None  # forced off: plain ops


def test_only_a_definite_verdict_is_kept(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A timeout or a child that cannot start leaves no record (off for this process
    only); a death by signal (SIGILL) is kept as off; a torn record is probed again."""
    import subprocess

    monkeypatch.setenv("SPECTRIO_CACHE_DIR", str(tmp_path / "spectrio"))  # type: ignore[operator]
    monkeypatch.delenv("SPECTRIO_FUSED_RMS_NORM", raising=False)
    folder = tmp_path / "spectrio"  # type: ignore[operator]

    def timeout(*args: object, **kwargs: object) -> None:
        raise subprocess.TimeoutExpired("python", 90)

    monkeypatch.setattr(subprocess, "run", timeout)
    assert fo.fused_norm_runs_here() is False
    assert not folder.exists() or not list(folder.glob("fused_rms_norm-*"))

    def sigill(*args: object, **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(args, -4, "", "")

    monkeypatch.setattr(subprocess, "run", sigill)
    assert fo.fused_norm_runs_here() is False
    (record,) = folder.glob("fused_rms_norm-*")
    assert record.read_text() == "0"

    record.write_text("")  # torn by a process killed mid-write

    def ran(*args: object, **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(args, 0, "ok\n", "")

    monkeypatch.setattr(subprocess, "run", ran)
    assert fo.fused_norm_runs_here() is True
    assert record.read_text() == "1"
