"""spectrio's own C++ kernels for Paddle (``models/ops/csrc/spectrio_ops.cc``), compiled
once per machine, with plain Paddle ops as the fallback everywhere.

A decode step's forward is hundreds of Paddle ops, each costing microseconds of dispatch
for a few microseconds of work; two of its patterns are worth a kernel of their own
(the file's header says which and why). Each wrapper here returns None where its kernel
does not run, and the caller then takes the Python path; ``tests/test_native_ops.py``
checks each kernel against that path.

Invariants:

* **Built once, in a child process, atomically.** The compiler runs through
  ``paddle.utils.cpp_extension`` in a child (its output and any crash stay there), into a
  temporary folder that is renamed into ``<cache>/native/<key>/`` when complete. The key
  covers the sources, the flags (those of the instruction-set path
  :mod:`spectrio.models.ops.cpu_paths` chooses from CPUID, or ``SPECTRIO_CPU_PATH`` forces)
  and :func:`spectrio.models.ops.fast_ops.cpu_signature`, so a changed source, another path
  or another CPU builds again and a stale library is never loaded. A path the CPU lacks
  is refused with ``ConfigError`` before anything is built or loaded.
* **Never in the way.** ``SPECTRIO_NATIVE_OPS=0`` turns the kernels off;
  ``SPECTRIO_NATIVE_OPS=DIR`` keeps the libraries in ``DIR``. A build that fails (no
  compiler, no headers) is logged once and the process runs the Python path; the failure
  is not kept, so a machine that gains a compiler builds on its next start.
* Float32 only, and never under autograd (the kernels have no backward).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, NamedTuple

import structlog

from spectrio.cache_dir import cache_subfolder, publish_folder
from spectrio.models.ops.cpu_paths import choose_path, compiler_flags
from spectrio.models.ops.fast_ops import cpu_signature, cpuinfo_line
from spectrio.models.ops.paddle_setup import configured_threads, paddle

log = structlog.get_logger("spectrio.models.ops.native_ops")

__all__ = [
    "NATIVE_ENV",
    "add_rms_norm",
    "attention_block",
    "block_matmul",
    "bind_layers",
    "BoundLayers",
    "LayerInputs",
    "cpu_path",
    "decoder_layers",
    "embed_rows",
    "kernels_identity",
    "mlp_block",
    "native_layers_enabled",
    "native_ops_available",
    "pack_panels",
    "panel_matmul",
    "read_sum",
    "repack_tiles",
]

NATIVE_ENV = "SPECTRIO_NATIVE_OPS"
#: ``0`` keeps the decoder layers on the op-by-op Paddle path while the other kernels run
#: (a comparison of the two; the default runs the layer ops wherever they can)
LAYERS_ENV = "SPECTRIO_NATIVE_LAYERS"
_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (_CSRC / "spectrio_ops.cc", _CSRC / "spectrio_layer.cc")
HEADERS = (_CSRC / "checks.h", _CSRC / "panel_kernels.h", _CSRC / "block_kernels.h")
_NAME = "spectrio_ops"
_CFLAGS = ["-O3", "-fopenmp"]  # and the chosen path's (cpu_paths.py)
# Linked against the OpenMP runtime Paddle ships and loads (Intel's, which serves the GNU
# entry points the compiler emits), not the compiler's own: kernels and MKL's GEMMs
# then share one pool of threads. With two runtimes each kernel waited for the other
# pool's threads, spinning after MKL's last call, to give up the cores.
_PADDLE_LIBS = Path(paddle.__file__).resolve().parent / "libs"
_LDFLAGS = [f"-L{_PADDLE_LIBS}", "-liomp5", f"-Wl,-rpath,{_PADDLE_LIBS}"]

_BUILD = """
import sys
from paddle.utils.cpp_extension import load
load(name=sys.argv[1], sources=sys.argv[2].split(","), extra_cxx_cflags=sys.argv[3].split(),
     extra_ldflags=sys.argv[4].split(), build_directory=sys.argv[5], verbose=False)
"""

_lock = threading.Lock()
_state: bool | None = None  # None: not tried yet in this process


_path: str | None = None


def cpu_path() -> str:
    """The instruction-set path the kernels are built for in this process
    (:mod:`spectrio.models.ops.cpu_paths`): ``SPECTRIO_CPU_PATH``, else the best this CPU
    runs. ``ConfigError`` where the variable names a path this CPU cannot run."""
    global _path
    if _path is None:
        flags = frozenset(cpuinfo_line("flags").partition(":")[2].split())
        _path = choose_path(flags, os.environ)
    return _path


def _cflags() -> list[str]:
    return _CFLAGS + compiler_flags(cpu_path())


def _key() -> str:
    texts = [f.read_text() for f in (*SOURCES, *HEADERS)]
    ident = "\0".join([*texts, " ".join(_cflags() + _LDFLAGS), cpu_signature()])
    return hashlib.sha256(ident.encode()).hexdigest()[:20]


def _build(tmp: Path) -> None:
    """Compile the library into ``tmp`` (:func:`publish_folder` renames it into place)."""
    log.info("compiling spectrio's native kernels once for this machine", out=str(tmp))
    child = subprocess.run(
        [sys.executable, "-c", _BUILD, _NAME, ",".join(map(str, SOURCES)), " ".join(_cflags()),
         " ".join(_LDFLAGS), str(tmp)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    built = tmp / _NAME / f"{_NAME}.so"
    if child.returncode != 0 or not built.is_file():
        raise OSError(f"the build failed: {(child.stderr or child.stdout).strip()[-400:]}")
    shutil.move(str(built), str(tmp / f"{_NAME}.so"))
    shutil.rmtree(tmp / _NAME, ignore_errors=True)


def kernels_identity() -> str:
    """What names the kernels this process runs (the library's key), or ``"off"``: the
    adaptive policy's kept step times hold only for the same kernels."""
    return _key() if native_ops_available() else "off"


def native_layers_enabled() -> bool:
    """Whether models run their decoder layers as native ops where they can (not turned
    off by ``SPECTRIO_NATIVE_LAYERS=0``; :attr:`SpectrioForCausalLM.native_layers`)."""
    return os.environ.get(LAYERS_ENV, "1").strip() not in ("0", "false", "no", "off")


def native_ops_available() -> bool:
    """Whether the kernels run in this process (building them on first call)."""
    global _state
    if _state is not None:
        return _state
    with _lock:
        if _state is None:
            _state = _load()
    return _state


def _load() -> bool:
    cpu_path()  # a path this CPU cannot run is refused here, before any build
    root = cache_subfolder(NATIVE_ENV, "native")
    if root is None:
        return False
    folder = root / _key()
    library = folder / f"{_NAME}.so"
    try:
        if not library.is_file():
            publish_folder(folder, library.name, _build)
        from paddle.utils.cpp_extension.extension_utils import (
            load_op_meta_info_and_register_op,
        )

        load_op_meta_info_and_register_op(str(library))
        log.debug("native kernels loaded", path=cpu_path(), library=str(library))
    except (OSError, subprocess.SubprocessError, RuntimeError, ValueError) as exc:
        log.warning("native kernels unavailable; the Python path runs", error=str(exc))
        return False
    return True


_C_OPS: Any = paddle._C_ops  # the custom-op entry point is not in Paddle's stubs


def _run(name: str, *args: Any) -> list[paddle.Tensor]:
    return list(_C_OPS._run_custom_op(name, *args))


def _usable(x: paddle.Tensor) -> bool:
    return x.dtype == paddle.float32 and not paddle.is_grad_enabled() and native_ops_available()


def add_rms_norm(
    x: paddle.Tensor, delta: paddle.Tensor | None, weight: paddle.Tensor, eps: float
) -> tuple[paddle.Tensor, paddle.Tensor] | None:
    """``(rmsnorm(x + delta) * weight, x + delta)`` over the last axis (``delta`` None:
    ``(rmsnorm(x) * weight, x)``), or None where the kernel does not run."""
    if not _usable(x):
        return None
    normed, summed = _run("spectrio_add_rms_norm", x, _given(delta), weight, float(eps))
    return normed, summed


def panel_matmul(x: paddle.Tensor, panels: paddle.Tensor, n: int) -> paddle.Tensor | None:
    """``x @ w`` for float32 ``x`` ``[M, K]`` and a ``[K, n]`` weight packed as ``panels``
    (:func:`spectrio.models.ops.serving_matrix.pack_panels`, which only exist where the
    kernels run), or None under autograd. Checked in C++ only: this runs four times a
    layer, where Python-side checks cost as much as a small product."""
    if paddle.is_grad_enabled():
        return None
    threads = configured_threads() or 1
    return _C_OPS._run_custom_op("spectrio_panel_matmul", x, panels, n, threads)[0]


def block_matmul(x: paddle.Tensor, w: paddle.Tensor, ggml_type: int, n: int) -> paddle.Tensor:
    """``x @ W.T`` for float32 ``x`` ``[M, K]`` and ``W``, ``n`` rows of GGUF blocks of
    ``ggml_type`` held as a uint8 tensor (``models/ops/csrc/block_kernels.h``: the
    activations are quantized per 32 to int8 first; K a multiple of the type's block,
    256 for the K-quants): the blocks as stored (1- or 2-D), or regrouped by
    :func:`repack_tiles` (3-D), which is read faster. Only where the kernels run."""
    threads = configured_threads() or 1
    return _C_OPS._run_custom_op("spectrio_block_matmul", x, w, int(ggml_type), int(n), threads)[0]


def repack_tiles(w: paddle.Tensor, ggml_type: int, n: int, k: int) -> paddle.Tensor:
    """``n`` rows of ``k`` elements of GGUF blocks of ``ggml_type`` (uint8, one of
    :data:`spectrio.models.ops.gguf_blocks.TILED`) regrouped into the tiled layout
    ``[ceil(n / 8), k / 32, 8 * block bytes]`` that :func:`block_matmul` and the layer
    ops read fastest (:func:`spectrio.models.ops.gguf_blocks.tile_blocks` defines it). Only
    where the kernels run."""
    threads = configured_threads() or 1
    args = (w, int(ggml_type), int(n), int(k), threads)
    return _C_OPS._run_custom_op("spectrio_repack_tiles", *args)[0]


def embed_rows(
    w: paddle.Tensor, ids: paddle.Tensor, ggml_type: int, n: int, k: int
) -> paddle.Tensor:
    """Rows ``ids`` (int64) of ``w``, ``n`` rows of ``k`` elements of GGUF blocks of
    ``ggml_type`` (uint8, as stored ``[n, row bytes]`` or tiled by :func:`repack_tiles`),
    in float32 ``[len(ids), k]``, equal bit for bit to gguf-py's NumPy dequantization.
    Only where the kernels run."""
    return _C_OPS._run_custom_op("spectrio_embed_rows", w, ids, int(ggml_type), int(n), int(k))[0]


def pack_panels(w: paddle.Tensor, rows: bool = False) -> paddle.Tensor:
    """``w`` ``[K, N]`` (``rows``: its transpose ``[N, K]``) packed for
    :func:`panel_matmul`, the layout of
    :func:`spectrio.models.ops.serving_matrix.pack_panels`. Only where the kernels run."""
    threads = configured_threads() or 1
    return _C_OPS._run_custom_op("spectrio_pack_panels", w, rows, threads)[0]


def read_sum(x: paddle.Tensor, threads: int) -> paddle.Tensor | None:
    """The sum of float32 ``x`` read once by ``threads`` threads (the read-bandwidth
    probe's kernel, :mod:`spectrio.models.ops.memory_floor`), or None where the kernels do
    not run."""
    if not _usable(x):
        return None
    return _C_OPS._run_custom_op("spectrio_read_sum", x, max(1, int(threads)))[0]


@functools.cache
def _absent() -> paddle.Tensor:
    """The empty tensor the layer ops read as "no such input" (a bias, a norm)."""
    return paddle.empty([0], dtype="float32")


def _given(t: paddle.Tensor | None) -> paddle.Tensor:
    """``t``, or the layer ops' "absent" tensor for None."""
    return _absent() if t is None else t


def attention_block(
    x: paddle.Tensor,
    delta: paddle.Tensor | None,
    delta_bias: paddle.Tensor | None,
    qkv: paddle.Tensor,
    qkv_bias: paddle.Tensor | None,
    qk_norm: paddle.Tensor | None,
    rope: tuple[paddle.Tensor, paddle.Tensor],
    pools: tuple[paddle.Tensor, paddle.Tensor],
    o: paddle.Tensor,
    rows: tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor],
    shape: tuple[int, int, int, int],
    eps: float,
    norm_weight: paddle.Tensor | None = None,
    types: tuple[int, int] = (0, 0),
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """A layer's attention half in one op (``csrc/spectrio_layer.cc`` says what it
    computes and its invariants): ``(partial o projection, x + delta + delta_bias)``.
    ``qkv``/``o``: panels, or uint8 blocks of a GGUF type (then ``norm_weight``, the
    RMSNorm's weight, which panels have folded in, must be given); ``rope``: cos/sin
    tables ``[P, D/2]``; ``pools``: the layer's K and V pools, written in place;
    ``rows``: positions, sequence of each row and the padded block tables; ``shape``:
    heads, KV heads, head dim, block size; ``types``: the ggml types of ``qkv`` and ``o``
    (:attr:`~spectrio.models.ops.serving_matrix.ServingMatrix.ggml_type`), which block
    weights need (their sizes cannot tell every type apart) and panels ignore (their
    dtype says). Only where the kernels run, without autograd (the caller checks)."""
    out, summed = _C_OPS._run_custom_op(
        "spectrio_attention_block",
        x, _given(delta), _given(delta_bias), _given(norm_weight), qkv, _given(qkv_bias),
        _given(qk_norm),
        rope[0], rope[1], pools[0], pools[1], o, rows[0], rows[1], rows[2],
        *shape, float(eps), configured_threads() or 1, int(types[0]), int(types[1]),
    )  # fmt: skip
    return out, summed


def mlp_block(
    x: paddle.Tensor,
    delta: paddle.Tensor | None,
    delta_bias: paddle.Tensor | None,
    gate_up: paddle.Tensor,
    gate_up_bias: paddle.Tensor | None,
    down: paddle.Tensor,
    intermediate: int,
    eps: float,
    norm_weight: paddle.Tensor | None = None,
    types: tuple[int, int] = (0, 0),
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """A layer's MLP half in one op: ``(partial down projection, x + delta +
    delta_bias)``, as :func:`attention_block` (``types``: those of ``gate_up`` and
    ``down``)."""
    out, summed = _C_OPS._run_custom_op(
        "spectrio_mlp_block",
        x, _given(delta), _given(delta_bias), _given(norm_weight), gate_up,
        _given(gate_up_bias), down, int(intermediate), float(eps), configured_threads() or 1,
        int(types[0]), int(types[1]),
    )  # fmt: skip
    return out, summed


class LayerInputs(NamedTuple):
    """A decoder layer's inputs to the layer ops (:meth:`DecoderLayer.native_inputs
    <spectrio.models.architecture.layers.DecoderLayer.native_inputs>`): its packed weights (panels,
    or uint8 GGUF blocks), biases and norms (None: absent), the ggml types of qkv, o,
    gate|up and down, (heads, KV heads, head dim), the intermediate size of this rank and
    the RMSNorm epsilon. ``input_norm`` / ``post_norm``: the norm weights where the
    weights after them are blocks (panels have them folded in)."""

    input_norm: paddle.Tensor | None
    qkv: paddle.Tensor
    qkv_bias: paddle.Tensor | None
    qk_norm: paddle.Tensor | None
    o: paddle.Tensor
    o_bias: paddle.Tensor | None
    post_norm: paddle.Tensor | None
    gate_up: paddle.Tensor
    gate_up_bias: paddle.Tensor | None
    down: paddle.Tensor
    down_bias: paddle.Tensor | None
    types: tuple[int, int, int, int]
    heads: tuple[int, int, int]
    intermediate: int
    eps: float


class BoundLayers(NamedTuple):
    """A run of layers bound to their KV pools as ``spectrio_decoder_layers`` takes them
    (:func:`bind_layers`): the same for every pass over the same weights and cache, so a
    caller keeps it rather than rebuilding a dozen lists of a few dozen tensors a pass."""

    layers: tuple[LayerInputs, ...]
    k_pools: tuple[paddle.Tensor, ...]
    columns: tuple[list[paddle.Tensor], ...]  # the 11 tensor inputs, each over the layers
    k_list: list[paddle.Tensor]
    v_list: list[paddle.Tensor]
    types: list[int]

    def binds(self, layers: list[LayerInputs], k_pools: list[paddle.Tensor]) -> bool:
        """Whether these are ``layers`` over these pools (the same objects)."""
        return (
            len(layers) == len(self.layers)
            and all(a is b for a, b in zip(layers, self.layers, strict=True))
            and all(a is b for a, b in zip(k_pools, self.k_pools, strict=True))
        )


def bind_layers(
    layers: list[LayerInputs], pools: list[tuple[paddle.Tensor, paddle.Tensor]]
) -> BoundLayers:
    """``layers`` (layer l writing ``pools[l]``) as :func:`decoder_layers` passes them."""
    columns = tuple(
        [_given(t) for t in column]
        for column in zip(*(layer[:11] for layer in layers), strict=True)
    )
    return BoundLayers(
        layers=tuple(layers),
        k_pools=tuple(p[0] for p in pools),
        columns=columns,
        k_list=[p[0] for p in pools],
        v_list=[p[1] for p in pools],
        types=[int(t) for layer in layers for t in layer.types],
    )


def decoder_layers(
    x: paddle.Tensor,
    layers: list[LayerInputs] | BoundLayers,
    pools: list[tuple[paddle.Tensor, paddle.Tensor]] | None,
    rope: tuple[paddle.Tensor, paddle.Tensor],
    rows: tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor],
    block_size: int,
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """A run of whole layers of one rank (no tensor parallelism) from input ``x``, in one
    op (``spectrio_decoder_layers``): bit for bit :func:`attention_block` and
    :func:`mlp_block` chained, without a dispatch per half. Layer l writes ``pools[l]``
    (``layers`` may come bound to their pools already, :func:`bind_layers`; ``pools`` is
    then None). Returns ``(summed, delta)`` whose sum plus the last layer's down bias is
    the last layer's output. Every layer has the first one's heads, intermediate size and
    epsilon (one model's layers); only where the kernels run, without autograd."""
    if not isinstance(layers, BoundLayers):
        assert pools is not None, "pools for unbound layers"
        layers = bind_layers(layers, pools)
    first, lists = layers.layers[0], layers.columns
    summed, out = _C_OPS._run_custom_op(
        "spectrio_decoder_layers",
        x, _absent(), _absent(), lists[0], lists[1], lists[2], lists[3],
        layers.k_list, layers.v_list, *lists[4:],
        rope[0], rope[1], *rows, *first.heads, int(block_size), int(first.intermediate),
        float(first.eps), configured_threads() or 1, layers.types,
    )  # fmt: skip
    return summed, out
