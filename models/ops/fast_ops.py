"""Paddle's C++ eager ops, bound once, for the serving forward.

The public Python APIs wrap each op in argument-alias decorators and mode checks whose
cost is of the order of the op's own for the small tensors of a decode step, and a
forward is hundreds of such ops. These bindings call ``paddle._C_ops`` with positional
arguments, and fall back to the public API where a build lacks the op;
``tests/test_fast_ops.py`` checks each against the public API. Only the serving forward
(no autograd) uses them.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from spectrio.cache_dir import cache_dir
from spectrio.models.ops.paddle_setup import paddle

# isort: split
import paddle.nn.functional as F

__all__ = [
    "add",
    "cpu_signature",
    "cpuinfo_line",
    "fused_norm_runs_here",
    "fused_rms_norm",
    "gather",
    "lookup_rows",
    "matmul",
    "reshape",
    "scatter_",
    "softmax",
    "split",
    "swiglu",
    "transpose",
]

Tensor = paddle.Tensor
_C: Any = getattr(paddle, "_C_ops", None)


def _op(name: str) -> Callable[..., Any] | None:
    return getattr(_C, name, None) if _C is not None else None


_matmul = _op("matmul")
_reshape = _op("reshape")
_split = _op("split")
_transpose = _op("transpose")
_gather = _op("gather")
_embedding = _op("embedding")
_scatter = _op("scatter_")
_softmax = _op("softmax")
_swiglu = _op("swiglu")
_add = _op("add")


def matmul(x: Tensor, y: Tensor, transpose_y: bool = False) -> Tensor:
    if _matmul is not None:
        return _matmul(x, y, False, transpose_y)
    return paddle.matmul(x, y, transpose_y=transpose_y)


def reshape(x: Tensor, shape: Sequence[int]) -> Tensor:
    if _reshape is not None:
        return _reshape(x, list(shape))
    return paddle.reshape(x, list(shape))


def split(x: Tensor, sections: Sequence[int], axis: int) -> list[Tensor]:
    if _split is not None:
        return list(_split(x, list(sections), axis))
    return list(paddle.split(x, list(sections), axis=axis))


def transpose(x: Tensor, perm: Sequence[int]) -> Tensor:
    if _transpose is not None:
        return _transpose(x, list(perm))
    return paddle.transpose(x, list(perm))


def gather(x: Tensor, index: Tensor) -> Tensor:
    """Rows ``index`` of ``x`` (axis 0)."""
    if _gather is not None:
        return _gather(x, index, 0)
    return paddle.gather(x, index, axis=0)


def lookup_rows(table: Tensor, index: Tensor) -> Tensor:
    """Rows ``index`` of a 2-D ``table``, as :func:`gather` gives them, through the
    embedding lookup, which is faster than ``gather`` for the paged cache's blocks
    (hundreds of long rows); for a few short rows ``gather`` is faster."""
    if _embedding is not None:
        return _embedding(index, table, -1, False)
    return paddle.gather(table, index, axis=0)


def scatter_(x: Tensor, index: Tensor, updates: Tensor) -> Tensor:
    """Overwrite rows ``index`` of ``x`` with ``updates``, in place."""
    if _scatter is not None:
        return _scatter(x, index, updates, True)
    return paddle.scatter_(x, index, updates, overwrite=True)


def softmax(x: Tensor) -> Tensor:
    """Softmax over the last axis."""
    if _softmax is not None:
        return _softmax(x, -1)
    return F.softmax(x, axis=-1)


def swiglu(x: Tensor) -> Tensor:
    """``silu(a) * b`` for ``x = [a | b]`` split on the last axis."""
    if _swiglu is not None:
        return _swiglu(x, None)
    return F.swiglu(x)


def add(x: Tensor, y: Tensor) -> Tensor:
    if _add is not None:
        return _add(x, y)
    return paddle.add(x, y)


def _fused_norm_op() -> Callable[..., Any] | None:
    op = _op("fused_rms_norm_quant")
    if op is not None:
        return lambda x, w, eps, axis, residual: op(
            x, None, residual, w, None, eps, axis, -1.0, 0, 0.0, 0.0
        )
    incubate = importlib.import_module("paddle.incubate.nn.functional")
    public = getattr(incubate, "fused_rms_norm", None)
    if public is None:
        return None
    return lambda x, w, eps, axis, residual: public(x, w, None, eps, axis, residual=residual)


#: Run in a child process: the fused kernel as serving calls it (with and without the
#: residual), checked against the plain formula.
_PROBE = """
import numpy as np, paddle
from paddle.incubate.nn.functional import fused_rms_norm
rng = np.random.default_rng(0)
x, r = (rng.standard_normal((4, 192)).astype("float32") for _ in range(2))
def plain(v):
    return v / np.sqrt((v * v).mean(-1, keepdims=True) + 1e-6)
w = paddle.ones([192])
out = fused_rms_norm(paddle.to_tensor(x), w, None, 1e-6, 1)[0].numpy()
normed, summed = fused_rms_norm(paddle.to_tensor(x), w, None, 1e-6, 1,
                                residual=paddle.to_tensor(r))
good = (np.allclose(out, plain(x), rtol=1e-4, atol=1e-5)
        and np.allclose(summed.numpy(), x + r)
        and np.allclose(normed.numpy(), plain(x + r), rtol=1e-4, atol=1e-5))
print("ok" if good else "wrong")
"""


def cpuinfo_line(prefix: str) -> str:
    """The first line of ``/proc/cpuinfo`` that starts with ``prefix`` ("" where none)."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line for line in fh if line.startswith(prefix)), "")
    except OSError:
        return ""


def cpu_signature() -> str:
    """The machine architecture, Paddle's version and the CPU's instruction-set flags."""
    return f"{platform.machine()} {paddle.__version__} {cpuinfo_line('flags')}"


def _probe() -> bool | None:
    """The child's verdict: True (it ran and agreed), False (it died by a signal, such
    as SIGILL, or disagreed), None (no verdict: it could not start or timed out)."""
    try:
        child = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=90
        )
    except (OSError, subprocess.SubprocessError):
        return None
    verdict = child.stdout.strip().rsplit("\n", 1)[-1] if child.stdout.strip() else ""
    if child.returncode == 0 and verdict in ("ok", "wrong"):
        return verdict == "ok"
    if child.returncode < 0:  # killed by a signal: the kernel cannot run here
        return False
    return None  # an ordinary failure (no Paddle in the child, ...) says nothing


def fused_norm_runs_here() -> bool:
    """Whether Paddle's fused RMSNorm kernel runs on this CPU.

    It is built for particular x86 extensions, and on a CPU without them it dies with an
    illegal instruction (seen on an earlier development host), which no Python handler
    can catch. So it is tried once in a child process, and a definite answer (it ran and
    agreed with the plain formula; or it died by a signal or disagreed) is kept per (CPU
    flags, Paddle version) in spectrio's cache folder (:func:`spectrio.cache_dir.cache_dir`),
    written atomically. No verdict (the child could not start or timed out) means off for
    this process only. ``SPECTRIO_FUSED_RMS_NORM=0`` or ``1`` decides without trying.
    """
    forced = os.environ.get("SPECTRIO_FUSED_RMS_NORM")
    if forced in ("0", "1"):
        return forced == "1"
    key = hashlib.sha256(cpu_signature().encode()).hexdigest()[:16]
    record = cache_dir() / f"fused_rms_norm-{key}"
    try:
        kept = record.read_text().strip()
    except OSError:
        kept = ""
    if kept in ("0", "1"):
        return kept == "1"
    runs = _probe()
    if runs is None:
        return False
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=record.parent, prefix=record.name + ".")
        with os.fdopen(fd, "w") as fh:
            fh.write("1" if runs else "0")
        os.replace(tmp, record)
    except OSError:
        pass  # a read-only home: try again next process
    return runs


_fused_norm: Callable[..., Any] | None = None
_fused_norm_checked = False


def fused_rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> tuple[Tensor, Tensor] | None:
    """``(rmsnorm(x + residual) * weight, x + residual)`` over the last axis in one op,
    or None where Paddle has no kernel for it: it has one for float32 only, no CPU
    backward (so never under autograd), and not on every CPU
    (:func:`fused_norm_runs_here`). Callers fall back to plain ops on None."""
    global _fused_norm, _fused_norm_checked
    if x.dtype != paddle.float32 or paddle.is_grad_enabled():
        return None
    if not _fused_norm_checked:
        _fused_norm = _fused_norm_op() if fused_norm_runs_here() else None
        _fused_norm_checked = True
    if _fused_norm is None:
        return None
    out, summed = _fused_norm(x, weight, eps, x.ndim - 1, residual)
    return out, (x if residual is None else summed)
