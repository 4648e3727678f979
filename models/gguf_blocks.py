"""GGUF's quantized block types, as spectrio's kernels compute with them (pure NumPy).

A quantized weight of ``N`` rows of ``K`` elements is ``N`` runs of blocks, each block
``elements`` wide and ``bytes`` long (:data:`BLOCK_TYPES`). The native product
(``models/csrc/block_kernels.h``, :func:`spectrio.models.native_ops.block_matmul`) reads
them where they lie. This module holds what the kernels assume, in NumPy:

* :func:`decode_groups`: each 32-element group as unsigned bytes ``u``, a scale ``d``
  and an offset ``m`` per half-group, so that ``w = d * u + m`` (Q8_0: signed bytes, no
  offset). It is checked against ``gguf.quants.dequantize``, an independent reading of
  the same layouts.
* :func:`quantize_activations`: a row of activations quantized per 32, to int8 with a
  scale, in the same float32 steps as the kernel.
* :func:`reference_matmul`: the product the kernel computes, from those two, in float64:
  the kernel's result differs from it by float32 rounding only.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from spectrio.errors import CheckpointError

__all__ = [
    "BLOCK_TYPES",
    "BlockType",
    "GROUP",
    "block_type",
    "check_tensor_bytes",
    "decode_groups",
    "quantize_activations",
    "reference_matmul",
    "scaled_blocks",
]

GROUP = 32
"""Elements of an activation group and of a decoded weight group."""


@dataclasses.dataclass(frozen=True)
class BlockType:
    """One of ggml's tensor types: its id, and its block's elements and bytes."""

    name: str
    ggml_id: int
    elements: int
    bytes: int
    native: bool  # the block kernels compute with it

    def row_bytes(self, k: int) -> int:
        """Bytes of a row of ``k`` elements (a whole number of blocks)."""
        return k // self.elements * self.bytes


def _block_type(name: str, native: bool) -> BlockType:
    """``name``'s id and block size as the ``gguf`` package records them."""
    qtype = GGMLQuantizationType[name]
    elements, nbytes = GGML_QUANT_SIZES[qtype]
    return BlockType(name, int(qtype), elements, nbytes, native)


BLOCK_TYPES: dict[str, BlockType] = {
    t.name: t
    for t in (
        _block_type("F32", False),
        _block_type("F16", False),
        _block_type("Q4_0", True),
        _block_type("Q4_1", True),
        _block_type("Q5_0", True),
        _block_type("Q5_1", True),
        _block_type("Q8_0", True),
        _block_type("Q4_K", False),
        _block_type("Q5_K", False),
        _block_type("Q6_K", False),
        _block_type("BF16", False),
    )
}
_BY_ID = {t.ggml_id: t for t in BLOCK_TYPES.values()}


def block_type(ggml_id: int) -> BlockType | None:
    """The block type of a ggml type id, or None for one spectrio does not know."""
    return _BY_ID.get(int(ggml_id))


def check_tensor_bytes(name: str, ggml_id: int, shape: tuple[int, ...], nbytes: int) -> None:
    """Raise :class:`CheckpointError` unless a tensor of ``shape`` (GGUF's order: the row
    length first) in type ``ggml_id`` is exactly ``nbytes`` long, naming the tensor."""
    t = block_type(ggml_id)
    if t is None:
        raise CheckpointError(f"tensor {name!r}: unknown ggml type {ggml_id}")
    k = int(shape[0]) if shape else 1
    if k % t.elements:
        raise CheckpointError(
            f"tensor {name!r}: rows of {k} elements are not whole {t.name} blocks of {t.elements}"
        )
    rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    want = rows * t.row_bytes(k)
    if want != nbytes:
        raise CheckpointError(
            f"tensor {name!r}: {nbytes} bytes, but {t.name} {list(shape)} needs {want}"
        )


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of each block (``raw`` ``[..., bytes]``), as float32."""
    return np.ascontiguousarray(raw[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes a block → 32 elements: the low nibbles first, then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(raw4: np.ndarray) -> np.ndarray:
    """A little-endian uint32 a block → 32 bits, bit j as element j, valued 0 or 16."""
    bits = np.unpackbits(raw4, axis=-1, bitorder="little")
    return (bits * 16).astype(np.uint8)


def decode_groups(raw: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks of type ``name`` (``raw``: uint8 ``[..., blocks, bytes]``) → ``u``
    ``[..., blocks, 32]`` (uint8; int8 for Q8_0), ``d`` and ``m`` ``[..., blocks, 2]``
    (float32, per half-group), with ``w = d * u + m`` elementwise per half."""
    d = _f16(raw, 0)
    if name == "Q8_0":
        u = raw[..., 2:34].view(np.int8)
        m = np.zeros_like(d)
    elif name in ("Q4_0", "Q4_1"):
        off = name == "Q4_1"
        u = _nibbles(raw[..., 4:20] if off else raw[..., 2:18])
        m = _f16(raw, 2) if off else np.float32(-8.0) * d
    elif name in ("Q5_0", "Q5_1"):
        off = name == "Q5_1"
        qh = raw[..., 4:8] if off else raw[..., 2:6]
        u = _nibbles(raw[..., 8:24] if off else raw[..., 6:22]) | _high_bits(qh)
        m = _f16(raw, 2) if off else np.float32(-16.0) * d
    else:
        raise ValueError(f"no group decoder for {name}")
    halves = np.stack([d, d], axis=-1), np.stack([m, m], axis=-1)
    return u, halves[0], halves[1]


def dequantize(raw: np.ndarray, name: str) -> np.ndarray:
    """Blocks → float32 weights ``[..., blocks * 32]``, from :func:`decode_groups`."""
    u, d, m = decode_groups(raw, name)
    half = lambda a: np.repeat(a, 16, axis=-1)  # noqa: E731 — per half-group → per element
    w = half(d) * u.astype(np.float32) + half(m)
    return w.reshape(*w.shape[:-2], -1)


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float32 rows ``[M, K]`` → ``q`` int8 ``[M, K]``, ``dx`` ``[M, K / 32]`` and the
    sums of each 16 q's ``[M, K / 32, 2]``: the kernel's steps, in float32."""
    x = np.asarray(x, dtype=np.float32)
    rows, k = x.shape
    g = x.reshape(rows, k // GROUP, GROUP)
    amax = np.abs(g).max(axis=-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(g * inv[..., None]).astype(np.int8)
    sums = q.reshape(rows, k // GROUP, 2, 16).astype(np.int64).sum(axis=-1)
    return q.reshape(rows, k), (amax / np.float32(127.0)).astype(np.float32), sums


def reference_matmul(x: np.ndarray, raw: np.ndarray, name: str) -> np.ndarray:
    """``x @ W.T`` as the block kernel computes it, in float64: ``x`` float32 ``[M, K]``,
    ``raw`` uint8 ``[N, K / 32, bytes]`` blocks of ``name``."""
    q, dx, sums = quantize_activations(x)
    u, d, m = decode_groups(raw, name)
    rows, k = q.shape
    qg = q.reshape(rows, k // GROUP, 2, 16).astype(np.int64)
    ug = u.reshape(u.shape[0], k // GROUP, 2, 16).astype(np.int64)
    dots = np.einsum("mghi,nghi->mngh", qg, ug).astype(np.float64)  # [M, N, G, 2]
    scaled = dots * d[None].astype(np.float64) + sums[:, None] * m[None].astype(np.float64)
    return (scaled.sum(axis=-1) * dx[:, None].astype(np.float64)).sum(axis=-1)


def scaled_blocks(raw: np.ndarray, name: str, factor: float) -> np.ndarray:
    """A copy of blocks ``raw`` (uint8 ``[..., blocks * bytes]`` rows) whose weights are
    ``factor`` times the originals: each block's float16 scale (and offset, for the types
    with one) multiplied and rounded to float16, exactly where ``factor`` is a power of two
    that keeps them normal."""
    t = BLOCK_TYPES[name]
    rows = np.array(raw, dtype=np.uint8, copy=True)
    blocks = rows.reshape(-1, t.bytes)
    fields = (0, 2) if name in ("Q4_1", "Q5_1") else (0,)
    for at in fields:
        half = np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16)
        scaled = (half.astype(np.float32) * np.float32(factor)).astype(np.float16)
        blocks[:, at : at + 2] = scaled.view(np.uint8)
    return rows
