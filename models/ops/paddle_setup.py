"""The one place spectrio imports Paddle, and the process-wide Paddle settings the
serving forward relies on.

* Import. Every spectrio module takes Paddle from here (``from
  spectrio.models.ops.paddle_setup import paddle``), so whichever is imported first, Paddle is
  imported under :func:`spectrio.models.ops.host_state.host_state_kept`: the host's signal
  handlers (Paddle installs C-level ones for SIGTERM and the fatal signals) and its root
  logger (Paddle configures it) are as they were before.

* ``FLAGS_use_stride_kernel`` off. With it on (Paddle 3's default) ``transpose`` returns
  a strided view, and the next ``matmul`` copies it through a generic strided kernel,
  tens of times slower than the matmul itself. With it off, transpose is a real
  (fast) copy. ``reshape`` of a contiguous tensor still shares its storage, and the
  paged KV cache relies on that for its blocked view of each pool (the paged-vs-dense
  equality tests would catch a copy).
* Threads. Paddle sets ``OMP_NUM_THREADS=1`` when imported, so a process gets one core
  unless told otherwise; ``set_num_threads`` changes that after import. Its OpenMP half
  (``omp_set_num_threads``) sets the *calling thread's* count only: a thread started
  later runs Paddle's own parallel loops on one thread while MKL's matmuls use all. The
  device worker runs the model on its own thread, so it calls
  :func:`use_configured_threads` first; without it a multi-row forward runs slower there
  than on the thread that configured Paddle.
* MKL on AMD. Before the import, :func:`~spectrio.models.ops.mkl_dispatch.apply_mkl_dispatch`
  points the MKL that Paddle bundles at its AVX2 path on AMD CPUs that have it (it
  otherwise takes a generic path there: matmuls 2.5-3.6 times slower than they need be).
"""

from __future__ import annotations

import warnings

from spectrio.models.ops.host_state import host_state_kept
from spectrio.models.ops.mkl_dispatch import apply_mkl_dispatch

#: ``MKL_DEBUG_CPU_TYPE`` as MKL will read it (None: unset), for the start-up log.
MKL_CPU_TYPE = apply_mkl_dispatch()

# The host's signal handlers and root logger survive the import. Paddle warns at import,
# in every process, when ccache is not installed: it only speeds up C++ builds, and
# spectrio builds its kernels once per machine, in a child process whose output is kept.
with host_state_kept(), warnings.catch_warnings():
    warnings.filterwarnings("ignore", "No ccache found", UserWarning)
    import paddle

__all__ = [
    "MKL_CPU_TYPE",
    "configure_paddle",
    "configured_threads",
    "paddle",
    "use_configured_threads",
]

_threads: int | None = None


def configure_paddle(num_threads: int | None = None) -> int | None:
    """Apply the settings above; ``num_threads`` sets the CPU math threads when given.
    Returns the thread count last set through this function (None if never)."""
    global _threads
    paddle.set_flags({"FLAGS_use_stride_kernel": False})
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        paddle.base.core.set_num_threads(num_threads)
        _threads = num_threads
    return _threads


def configured_threads() -> int | None:
    """The thread count :func:`configure_paddle` last set (None if never); cheap enough
    for every kernel call, where :func:`configure_paddle` itself sets Paddle's flags."""
    return _threads


def use_configured_threads() -> None:
    """Give the calling thread the thread count :func:`configure_paddle` set (OpenMP keeps
    it per thread); a no-op when none was set. Call it on any thread that runs the model."""
    if _threads is not None:
        paddle.base.core.set_num_threads(_threads)
