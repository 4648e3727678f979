"""A weight matrix as the serving forward multiplies by it.

The layers' projections (fused q/k/v, o, fused gate/up, down) multiply a few rows at a
decode step and thousands in a prefill chunk. Where spectrio's native kernels run
(float32, :mod:`spectrio.models.ops.native_ops`), a ``[K, N]`` weight is kept packed into
16-column panels (:func:`pack_panels`) and multiplied by ``spectrio_panel_matmul``,
which reads each panel once for up to six rows at a time; elsewhere it stays the plain
Paddle tensor and ``matmul`` runs. A matrix holds one of the two layouts, never both,
so serving memory does not grow.

Invariant: both layouts give ``x @ w`` up to float rounding; the panel kernel sums each
output over K in order on one thread, so its result does not depend on the thread count.

A matrix made by :meth:`ServingMatrix.from_blocks` keeps a GGUF file's quantized blocks:
the tiled types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K) regrouped once, at load, into
tiles of 8 output columns (``[ceil(N / 8), K / block elements, 8 blocks' bytes]`` uint8:
:func:`~spectrio.models.ops.gguf_blocks.tile_blocks`), whose product holds 8 columns in the
lanes of one vector; Q5_K as stored (``[N, K / 256 * block bytes]``,
``models/ops/gguf_blocks.py``), without a copy. ``spectrio_block_matmul`` multiplies by either
with int8 activations; the layer ops read them too, given their ggml type
(:attr:`ServingMatrix.ggml_type`: block sizes cannot tell every type apart; the layout is
told by the tensor's shape) and the preceding RMSNorm's weight, since it cannot be folded
in.

A matrix made with ``half=True`` keeps float16 panels: the product reads half the bytes
and sums in float32, but each weight is rounded to float16 first. Only products whose
result picks drafts use it (the MTP layer and the draft head,
:meth:`~spectrio.models.architecture.model.SpectrioForCausalLM.set_draft_precision`): verification
decides what is emitted, so the output stays lossless.
"""

from __future__ import annotations

import numpy as np

from spectrio.models.ops import fast_ops as fo
from spectrio.models.ops import native_ops
from spectrio.models.ops.paddle_setup import paddle

__all__ = ["PANEL", "ServingMatrix", "pack_panels", "packs"]

PANEL = 16
"""Columns per panel (two AVX2 vectors)."""


def pack_panels(w: np.ndarray) -> np.ndarray:
    """``[K, N]`` → ``[ceil(N / 16), K, 16]``: panel ``p`` holds columns ``16p .. 16p + 15``
    row by row, the last one zero-padded. The layout's definition; the runtime packs
    float32 panels with :func:`spectrio.models.ops.native_ops.pack_panels`, which the tests
    check against it, and float16 ones (``half``, the few draft-side matrices) with this."""
    k, n = w.shape
    count = -(-n // PANEL)
    padded = np.zeros((k, count * PANEL), dtype=w.dtype)
    padded[:, :n] = w
    return np.ascontiguousarray(padded.reshape(k, count, PANEL).transpose(1, 0, 2))


def packs(dtype: object) -> bool:
    """Whether a weight of ``dtype`` (NumPy's or Paddle's) is kept packed: float32, where
    the native kernels run."""
    return dtype in (np.float32, paddle.float32) and native_ops.native_ops_available()


def _row_major_strides(array: np.ndarray) -> tuple[int, ...]:
    strides, step = [], array.itemsize
    for size in reversed(array.shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


class ServingMatrix:
    """A ``[K, N]`` weight in the layout the serving forward multiplies fastest."""

    def __init__(
        self, weight: paddle.Tensor | np.ndarray, rows: bool = False, half: bool = False
    ) -> None:
        """``weight`` is ``[K, N]``, or with ``rows`` its transpose ``[N, K]`` (a tied
        embedding as the LM head). A NumPy array is taken without a copy where it is
        packed. ``half``: float16 panels where the kernels run (the module's docstring
        says when that is allowed)."""
        n, k = weight.shape if rows else weight.shape[::-1]
        self.shape = (int(k), int(n))
        self._n = int(n)
        self._panels: paddle.Tensor | None = None
        self._plain: paddle.Tensor | None = None
        self._blocks: tuple[paddle.Tensor, int] | None = None  # (uint8 rows, ggml type)
        if half and packs(weight.dtype):
            array = weight if isinstance(weight, np.ndarray) else weight.numpy()
            packed = pack_panels(array.T if rows else array).astype(np.float16)
            self._panels = paddle.to_tensor(packed)
            return
        if packs(weight.dtype):
            if isinstance(weight, np.ndarray):  # shares the array's memory while packing
                array = np.ascontiguousarray(weight)
                if array.strides != _row_major_strides(array):
                    # NumPy calls a [1, N] view of a column contiguous, keeping its
                    # strides; Paddle (stride kernels off) refuses those over DLPack
                    array = array.copy()
                weight = paddle.utils.dlpack.from_dlpack(array)
            with paddle.no_grad():
                self._panels = native_ops.pack_panels(weight, rows)
            return
        tensor = paddle.to_tensor(weight) if isinstance(weight, np.ndarray) else weight
        self._plain = tensor.t().contiguous() if rows else tensor

    @classmethod
    def quantized(cls, rows: np.ndarray, type_name: str) -> ServingMatrix:
        """A ``[K, N]`` weight given as float rows ``[N, K]``, quantized to GGUF blocks of
        ``type_name`` (:func:`spectrio.models.loading.gguf_quantize.quantize`) and kept as
        :meth:`from_blocks` keeps a file's."""
        from gguf import GGMLQuantizationType

        from spectrio.models.loading.gguf_quantize import quantize

        raw = quantize(np.asarray(rows, dtype=np.float32), GGMLQuantizationType[type_name])
        return cls.from_blocks(raw, type_name, int(rows.shape[1]))

    @classmethod
    def from_blocks(cls, raw: np.ndarray, type_name: str, k: int) -> ServingMatrix:
        """A ``[k, N]`` weight from ``N`` rows of GGUF blocks of ``type_name`` (uint8
        ``[N, row bytes]``): regrouped into tiles where the type has that layout (a copy
        of the same size; the rows are not kept), else taken without a copy (a
        memory-mapped file's stays mapped)."""
        from spectrio.models.ops.gguf_blocks import BLOCK_TYPES, TILED, tile_blocks

        t = BLOCK_TYPES[type_name]
        if not t.native:
            raise ValueError(f"no block kernel for {type_name}")
        if k % t.elements:
            raise ValueError(
                f"{type_name} needs rows of a multiple of {t.elements} elements, not {k}"
            )
        rows = np.ascontiguousarray(raw, dtype=np.uint8).reshape(raw.shape[0], -1)
        if rows.shape[1] != t.row_bytes(k):
            raise ValueError(f"{type_name} rows of {rows.shape[1]} bytes do not hold {k} elements")
        self = cls.__new__(cls)
        self.shape, self._n = (int(k), int(rows.shape[0])), int(rows.shape[0])
        self._panels = self._plain = None
        tensor = paddle.utils.dlpack.from_dlpack(rows)
        if type_name in TILED:
            if native_ops.native_ops_available():
                tensor = native_ops.repack_tiles(tensor, t.ggml_id, self._n, k)
            else:
                tensor = paddle.to_tensor(tile_blocks(rows, type_name))
        self._blocks = (tensor, t.ggml_id)
        return self

    @property
    def packed(self) -> bool:
        """Whether the layer ops can read it (panels or blocks)."""
        return self._panels is not None or self._blocks is not None

    @property
    def blocks(self) -> bool:
        return self._blocks is not None

    @property
    def panels(self) -> paddle.Tensor | None:
        """The tensor the layer ops read: the packed panels or the blocks (None where the
        weight stays a plain tensor)."""
        return self._blocks[0] if self._blocks is not None else self._panels

    @property
    def ggml_type(self) -> int:
        """The ggml type id of what :attr:`panels` holds, as the layer ops take it: the
        blocks' type, or F32 (0) / F16 (1) for panels (and for a plain tensor)."""
        if self._blocks is not None:
            return self._blocks[1]
        return 1 if self.half else 0

    @property
    def half(self) -> bool:
        return self._panels is not None and self._panels.dtype == paddle.float16

    def matmul(self, x: paddle.Tensor) -> paddle.Tensor:
        """``x @ w`` for ``x`` ``[M, K]``."""
        if self._blocks is not None:
            return native_ops.block_matmul(x, self._blocks[0], self._blocks[1], self._n)
        if self._panels is not None:
            out = native_ops.panel_matmul(x, self._panels, self._n)
            if out is not None:
                return out
            raise RuntimeError(
                "a packed weight needs spectrio's native kernels: float32, without autograd"
            )
        assert self._plain is not None
        return fo.matmul(x, self._plain)
