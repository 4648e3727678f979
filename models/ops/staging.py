"""Persistent host-to-device staging for a forward pass's small inputs.

In Paddle 3.3.1 every ``paddle.to_tensor`` call leaks about 112 bytes for good (and
``paddle.Tensor(array)`` about 64), so a serving loop that makes a few dozen per step
grows without bound. Copying into a tensor allocated once leaks nothing and is faster.
The copy goes through the tensor's own ``DenseTensor`` (``set``), the cheapest of the
ways to fill a tensor (``Tensor.set_value`` adds Python checks; ``to_tensor`` and
assigning into a slice of a larger buffer cost more still); ``benchmarks/soak.py``
measures the whole runtime's memory.

A :class:`Staging` keeps tensors by (dtype, shape): a serving loop's shapes repeat (the
same batch, the same number of context blocks), so after the first steps every input is
a ``set_value`` into a tensor that already exists. The owner calls :meth:`reset` at the
start of each forward pass; tensors handed out before are then reused, so a staged
tensor must not outlive the pass that staged it (outputs never are staged: they are
computed tensors). Shapes not used for a while are dropped past ``max_bytes``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from spectrio.models.ops.paddle_setup import paddle

__all__ = ["Staging"]

_Key = tuple[np.dtype[Any], tuple[int, ...]]


class Staging:
    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        # Each entry: the tensor handed out and its DenseTensor, which copies in directly.
        self._pools: OrderedDict[_Key, list[tuple[paddle.Tensor, Any]]] = OrderedDict()
        self._in_use: dict[_Key, int] = {}
        self._bytes = 0
        self._place = paddle.CPUPlace()

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def reset(self) -> None:
        """Start a new pass: every tensor may be handed out again."""
        self._in_use.clear()

    def put(self, array: np.ndarray) -> paddle.Tensor:
        """A tensor with ``array``'s shape, dtype and values, valid until :meth:`reset`."""
        array = np.ascontiguousarray(array)
        key = (array.dtype, array.shape)
        index = self._in_use.get(key, 0)
        self._in_use[key] = index + 1
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = []
        elif index == 0:
            self._pools.move_to_end(key)
        if index == len(pool):
            tensor = paddle.zeros(list(array.shape), dtype=array.dtype.name)  # type: ignore[arg-type]  # a numpy dtype name
            pool.append((tensor, tensor.get_tensor()))
            self._bytes += array.nbytes
            self._evict()
        tensor, dense = pool[index]
        if array.size:
            dense.set(array, self._place)
        return tensor

    def _evict(self) -> None:
        """Drop the least recently used shapes not handed out in this pass."""
        for key in list(self._pools):
            if self._bytes <= self.max_bytes:
                return
            if key in self._in_use:
                continue
            count = len(self._pools.pop(key))
            self._bytes -= count * int(np.prod(key[1], dtype=np.int64)) * key[0].itemsize
