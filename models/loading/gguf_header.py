"""A GGUF file's header read in one pass: its metadata and where each tensor lies.

The ``gguf`` package's reader builds a NumPy array for every metadata element, which for
a 49,152-token vocabulary with its merges and scores is about 150,000 arrays: seconds on
a small CPU before any weight is touched. This reader walks the same header with
:mod:`struct` and keeps each field's decoded value (a string, a number, or a list of
them), so a file opens in a small fraction of that. Tensor data is not read here: each
:class:`TensorInfo` holds a view of the memory-mapped file, so a weight costs resident
memory only for the pages a kernel reads.

Only little-endian files of GGUF versions 2 and 3 are read (version 1 used 32-bit
counts and is obsolete); anything else, and any header that runs past the end of the
file, raises :class:`GGUFHeaderError` naming what is wrong.
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GGUFHeader", "GGUFHeaderError", "TensorInfo"]

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types: (struct code, size) for the fixed-size ones.
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("B", 1),  # uint8
    1: ("b", 1),  # int8
    2: ("H", 2),  # uint16
    3: ("h", 2),  # int16
    4: ("I", 4),  # uint32
    5: ("i", 4),  # int32
    6: ("f", 4),  # float32
    7: ("?", 1),  # bool
    10: ("Q", 8),  # uint64
    11: ("q", 8),  # int64
    12: ("d", 8),  # float64
}
_NUMPY = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
    10: "<u8", 11: "<i8", 12: "<f8",
}  # fmt: skip
_STRING, _ARRAY = 8, 9

# ggml tensor types whose data is a plain NumPy dtype (the rest are blocks of bytes).
_PLAIN_TENSORS = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32,
                  27: np.int64, 28: np.float64}  # fmt: skip


class GGUFHeaderError(ValueError):
    """The file is not a GGUF file this reader can read, or its header is corrupt."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    #: ggml order: the fastest-varying dimension first (a matrix is ``[in, out]``)
    dims: tuple[int, ...]
    #: ggml type id (``gguf.GGMLQuantizationType``'s value)
    ggml_type: int
    #: the tensor's bytes in the mapped file: a typed array of ``reversed(dims)`` for
    #: plain types, else uint8 ``[..., row bytes]``
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: memoryview, where: str) -> None:
        self.buf, self.pos, self.where = buf, 0, where

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.buf):
            raise GGUFHeaderError(f"{self.where}: header runs past the end of the file")
        out = self.buf[self.pos : end]
        self.pos = end
        return out

    def scalar(self, code: str, size: int) -> Any:
        return struct.unpack_from("<" + code, self.take(size))[0]

    def u32(self) -> int:
        return int(self.scalar("I", 4))

    def u64(self) -> int:
        return int(self.scalar("Q", 8))

    def string(self) -> str:
        raw = self.take(self.u64())
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFHeaderError(f"{self.where}: a header string is not UTF-8 ({exc})") from exc

    def strings(self, count: int) -> list[str]:
        # The hot loop of a vocabulary: lengths read straight from the buffer.
        buf, pos, out = self.buf, self.pos, []
        end = len(buf)
        for _ in range(count):
            if pos + 8 > end:
                raise GGUFHeaderError(f"{self.where}: header runs past the end of the file")
            n = int.from_bytes(buf[pos : pos + 8], "little")
            pos += 8
            if pos + n > end:
                raise GGUFHeaderError(f"{self.where}: header runs past the end of the file")
            try:
                out.append(str(buf[pos : pos + n], "utf-8"))
            except UnicodeDecodeError as exc:
                raise GGUFHeaderError(f"{self.where}: a header string is not UTF-8") from exc
            pos += n
        self.pos = pos
        return out

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(*_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.u32(), self.u64()
            if item == _STRING:
                return self.strings(count)
            if item in _NUMPY:
                size = _SCALARS[item][1]
                return np.frombuffer(self.take(count * size), dtype=_NUMPY[item]).tolist()
            if item == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            raise GGUFHeaderError(f"{self.where}: unknown metadata array type {item}")
        raise GGUFHeaderError(f"{self.where}: unknown metadata value type {kind}")


class GGUFHeader:
    """The metadata (:attr:`fields`) and tensors (:attr:`tensors`) of the GGUF file
    ``path``, which stays memory-mapped read-only while any tensor view lives."""

    def __init__(self, path: Path) -> None:
        where = str(path)
        try:
            self._map = np.memmap(path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:
            raise GGUFHeaderError(f"{where}: cannot map the file ({exc})") from exc
        cur = _Cursor(memoryview(self._map), where)  # type: ignore[arg-type]
        if bytes(cur.take(4)) != MAGIC:
            raise GGUFHeaderError(f"{where}: not a GGUF file (bad magic)")
        self.version = cur.u32()
        if self.version not in (2, 3):
            swapped = int.from_bytes(self.version.to_bytes(4, "little"), "big")
            why = "a big-endian file" if swapped in (2, 3) else f"version {self.version}"
            raise GGUFHeaderError(f"{where}: {why} is not supported (GGUF 2 or 3, little-endian)")
        n_tensors, n_fields = cur.u64(), cur.u64()
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = cur.string()
            self.fields[key] = cur.value(cur.u32())
        infos: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.u32()
            if n_dims > 8:
                raise GGUFHeaderError(f"{where}: tensor {name!r} has {n_dims} dimensions")
            dims = tuple(cur.u64() for _ in range(n_dims))
            infos.append((name, dims, cur.u32(), cur.u64()))
        align = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        if align <= 0 or align & (align - 1):
            raise GGUFHeaderError(f"{where}: general.alignment {align} is not a power of two")
        start = -(-cur.pos // align) * align
        self.tensors = [self._tensor(where, start, *info) for info in infos]

    def offset_of(self, tensor: TensorInfo) -> int:
        """Where ``tensor``'s bytes start in the file."""
        return int(tensor.data.__array_interface__["data"][0]) - int(
            self._map.__array_interface__["data"][0]
        )

    def drop_pages(self) -> None:
        """``MADV_DONTNEED`` over the whole mapping: resident pages leave this process's
        memory (the file's page cache keeps them) until a view is read again."""
        import mmap

        mapping = getattr(self._map, "_mmap", None)
        if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            mapping.madvise(mmap.MADV_DONTNEED)

    def _tensor(
        self, where: str, start: int, name: str, dims: tuple[int, ...], kind: int, offset: int
    ) -> TensorInfo:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise GGUFHeaderError(
                f"{where}: tensor {name!r} has unknown ggml type {kind}"
            ) from None
        elements, size = GGML_QUANT_SIZES[qtype]
        shape = tuple(reversed(dims))
        n = int(np.prod(dims, dtype=np.int64)) if dims else 1
        if dims and dims[0] % elements:
            raise GGUFHeaderError(
                f"{where}: tensor {name!r}: {dims[0]} elements a row do not fill whole "
                f"{qtype.name} blocks of {elements}"
            )
        nbytes = n // elements * size
        lo = start + offset
        if lo + nbytes > self._map.size:
            raise GGUFHeaderError(f"{where}: tensor {name!r} runs past the end of the file")
        raw = self._map[lo : lo + nbytes]
        if kind in _PLAIN_TENSORS:
            data = raw.view(_PLAIN_TENSORS[kind]).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], dims[0] // elements * size) if dims else raw
        return TensorInfo(name, dims, kind, data)
