"""The output head as the serving forward multiplies by it: one weight kept in whichever
layout its matmuls run fastest in (:class:`HeadLayouts`)."""

from __future__ import annotations

import math

from spectrio.models.ops.paddle_setup import paddle  # first: imports Paddle

# isort: split
from spectrio.models.ops import fast_ops as fo
from spectrio.models.ops.serving_matrix import ServingMatrix, packs


class HeadLayouts:
    """An output head for serving, kept in the layout its matmuls run fastest in.

    Where spectrio's native kernels run (float32), the head is one
    :class:`~spectrio.models.ops.serving_matrix.ServingMatrix` packed into panels, read once
    for any number of rows: MKL's SGEMM runs a vocabulary-sized head well below the
    memory bound from two rows on. Elsewhere it stays Paddle's: ``[d, V]`` suits MKL for
    one row (a GEMV down contiguous columns) and a head small enough to stay in cache;
    a head far larger than the cache multiplies several rows about twice as fast against
    ``[V, d]`` with ``transpose_y``. The parameter is one of those layouts; any other is
    a copy built only once a step needs it. All give the same logits up to float
    rounding.
    """

    #: heads of at least this many elements take several rows in the ``[V, d]`` layout
    LARGE_HEAD = 8 << 20

    def __init__(self, half: bool = False) -> None:
        self._rows: paddle.Tensor | None = None  # [V, d]
        self._cols: paddle.Tensor | None = None  # [d, V]
        self._packed: ServingMatrix | None = None
        self._large = False
        self._half = half  # float16 panels (a draft head's; ServingMatrix says when)

    @property
    def empty(self) -> bool:
        return self._rows is None and self._cols is None and self._packed is None

    def set_rows(self, weight: paddle.Tensor) -> None:
        """The head as ``[V, d]`` (a tied embedding)."""
        self._rows, self._cols, self._packed = weight, None, None
        self._large = math.prod(weight.shape) >= self.LARGE_HEAD

    def set_columns(self, weight: paddle.Tensor) -> None:
        """The head as ``[d, V]`` (a Paddle Linear's weight)."""
        self._rows, self._cols, self._packed = None, weight, None
        self._large = math.prod(weight.shape) >= self.LARGE_HEAD

    def set_matrix(self, matrix: ServingMatrix) -> None:
        """The head as a ready serving matrix (GGUF blocks) alone: only 2-D hidden
        states, as the serving forward passes, can be multiplied by it."""
        self._rows = self._cols = None
        self._packed, self._large = matrix, True

    def _panels(self) -> ServingMatrix | None:
        if self._packed is None:
            source = self._cols if self._cols is not None else self._rows
            if source is None or not packs(source.dtype):
                return None
            self._packed = ServingMatrix(source, rows=self._cols is None, half=self._half)
        return self._packed

    def logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """``hidden @ head`` for ``hidden`` ``[N, d]`` (or more leading axes)."""
        packed = self._panels() if hidden.ndim == 2 else None
        if packed is not None:
            return packed.matmul(hidden)
        if (hidden.ndim == 2 and hidden.shape[0] == 1) or not self._large:
            if self._cols is None:
                assert self._rows is not None, "the head is set before use"
                self._cols = self._rows.t().contiguous()
            return fo.matmul(hidden, self._cols)
        if self._rows is None:
            assert self._cols is not None, "the head is set before use"
            self._rows = self._cols.t().contiguous()
        return fo.matmul(hidden, self._rows, transpose_y=True)
