"""GGUF's quantized block types, as spectrio's kernels compute with them (pure NumPy).

A quantized weight of ``N`` rows of ``K`` elements is ``N`` runs of blocks, each block
``elements`` wide and ``bytes`` long (:data:`BLOCK_TYPES`). The native product
(``models/ops/csrc/block_kernels.h``, :func:`spectrio.models.ops.native_ops.block_matmul`) reads
them where they lie. This module holds what the kernels assume, in NumPy:

* :func:`decode_groups`: each 32-element group as unsigned bytes ``u``, a scale ``d``
  and an offset ``m`` per half-group, so that ``w = d * u + m`` (Q8_0: signed bytes, no
  offset). It is checked against ``gguf.quants.dequantize``, an independent reading of
  the same layouts.
* :func:`quantize_activations`: a row of activations quantized per 32, to int8 with a
  scale, in the same float32 steps as the kernel.
* :func:`reference_matmul`: the product the kernel computes, from those two, in float64:
  the kernel's result differs from it by float32 rounding only (its docstring gives the
  kernel's float32 order of operations).
* :func:`tile_blocks`: the tiled layout the serving matrices regroup the tiled types
  (:data:`TILED`) into at load (8 output columns side by side), which the kernels read
  fastest.
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
    "K_TILE_BYTES",
    "TILED",
    "block_type",
    "check_tensor_bytes",
    "decode_groups",
    "quantize_activations",
    "reference_matmul",
    "scaled_blocks",
    "synthetic_blocks",
    "tile_blocks",
]

GROUP = 32
"""Elements of an activation group and of a decoded weight group."""

TILE = 8
"""Output columns of a tile of the tiled layout (:func:`tile_blocks`)."""

TILED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K")
"""The types the kernels read in the tiled layout (Q5_K keeps its blocks as stored)."""

K_TILE_BYTES = {"Q4_K": 1184, "Q6_K": 1680}
"""Bytes of a K-quant tile's super-block (8 columns): Q4_K's 6-bit scales and minimums
take a byte each (128 bytes for the 96 packed ones), Q6_K's 8 blocks' bytes as stored."""


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
        _block_type("Q4_K", True),
        _block_type("Q5_K", True),
        _block_type("Q6_K", True),
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


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-blocks → each group's 6-bit scale and minimum ``[..., blocks, 8]``:
    groups 0-3 in the low 6 bits of bytes 4-7 and 8-11, groups 4-7 in the nibbles of bytes
    12-15 with their top 2 bits in the high bits of bytes 4-7 (scales) and 8-11 (minima)."""
    s = raw[..., 4:16].astype(np.int32)
    lo, mid, top = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (top & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([mid & 63, (top >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, mn


def _decode_k(raw: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """K-quant super-blocks ``[..., blocks, bytes]`` → :func:`decode_groups`'s values per
    group ``[..., blocks, 8, ...]`` (eight groups of 32 each)."""
    lead = raw.shape[:-1]
    if name == "Q6_K":
        # low nibbles: bytes 64h + 32(t & 1) + i shifted by 4(t >> 1), for group 4h + t;
        # two high bits: byte 32h + i shifted by 2t; the value is that 6-bit q - 32
        ql = raw[..., 0:128].reshape(*lead, 2, 2, 32)
        low = np.concatenate([ql & 0x0F, ql >> 4], axis=-2)
        qh = raw[..., 128:192].reshape(*lead, 2, 1, 32)
        high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
        u = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(*lead, 8, 32)
        sc = raw[..., 192:208].view(np.int8).astype(np.float32).reshape(*lead, 8, 2)
        d = _f16(raw, 208)[..., None, None] * sc
        return u, d, np.zeros_like(d)
    sc, mn = _k_scales(raw)
    d = _f16(raw, 0)[..., None] * sc.astype(np.float32)
    m = -(_f16(raw, 2)[..., None] * mn.astype(np.float32))
    # nibbles: groups 2c and 2c + 1 are the low and high nibbles of bytes 32c .. 32c + 31
    qs = raw[..., 48:176] if name == "Q5_K" else raw[..., 16:144]
    qs = qs.reshape(*lead, 4, 1, 32)
    u = np.concatenate([qs & 0x0F, qs >> 4], axis=-2).reshape(*lead, 8, 32)
    if name == "Q5_K":  # the fifth bit of element i of group j: bit j of byte 16 + i
        qh = raw[..., None, 16:48]
        u = u | (((qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1) << 4)
    return u, np.stack([d, d], axis=-1), np.stack([m, m], axis=-1)


def decode_groups(raw: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks of type ``name`` (``raw``: uint8 ``[..., blocks, bytes]``) → ``u``
    ``[..., groups, 32]`` (uint8; int8 for Q8_0 and Q6_K), ``d`` and ``m`` ``[..., groups,
    2]`` (float32, per half-group), with ``w = d * u + m`` elementwise per half. A block
    is one group, a K-quant super-block eight (Q4_K/Q5_K: a scale and offset per group,
    ``d * sc`` and ``-dmin * min``; Q6_K: a scale per half, ``d * sc``, no offset)."""
    if name in ("Q4_K", "Q5_K", "Q6_K"):
        u, d, m = _decode_k(raw, name)
        flat = lambda a: a.reshape(*a.shape[:-3], -1, a.shape[-1])  # noqa: E731
        return flat(u), flat(d), flat(m)
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
    """Blocks → float32 weights ``[..., blocks * block elements]``, from
    :func:`decode_groups` (each weight ``d * u + m`` rounded once to float32, as ``gguf``
    computes it: the product is exact)."""
    u, d, m = decode_groups(raw, name)
    half = lambda a: np.repeat(a, 16, axis=-1)  # noqa: E731 — per half-group → per element
    w = half(d) * u.astype(np.float32) + half(m)
    return w.reshape(*w.shape[:-2], -1)


def tile_blocks(raw: np.ndarray, name: str) -> np.ndarray:
    """Blocks of ``name`` (one of :data:`TILED`; uint8 ``[N, row bytes]`` or ``[N, blocks,
    bytes]``) → the tiled layout ``[ceil(N / 8), K / 32, 8 * bytes]``: for each 8 rows
    (output columns) and group, the 8 columns' fields side by side, the last tile padded
    with zero columns. The layout's definition (``models/ops/csrc/block_kernels.h`` reads it;
    the runtime regroups with :func:`spectrio.models.ops.native_ops.repack_tiles`, which the
    tests check against this). Per group:

    * the 8 float16 scales ``d``; Q4_1/Q5_1: then the 8 float16 offsets ``m``;
    * Q5_0/Q5_1: 32 bytes of fifth bits, bit ``s`` of byte ``4c + e`` that of element
      ``4s + e`` of column ``c``;
    * Q8_0: 8 chunks of 32 bytes, byte ``4c + e`` of chunk ``s`` element ``4s + e`` of
      column ``c``; 4-bit types: 4 words of 32 bytes, byte ``4c + e`` of word ``r`` the
      stored byte ``4r + e`` of column ``c`` (low nibble: element ``4r + e``, high nibble:
      element ``16 + 4r + e``).
    """
    t = BLOCK_TYPES[name]
    if name not in TILED:
        raise ValueError(f"no tiled layout for {name}")
    rows = np.ascontiguousarray(raw, dtype=np.uint8).reshape(raw.shape[0], -1)
    n, groups = rows.shape[0], rows.shape[1] // t.bytes
    tiles = -(-n // TILE)
    padded = np.zeros((tiles * TILE, groups, t.bytes), np.uint8)
    padded[:n] = rows.reshape(n, groups, t.bytes)
    b = padded.reshape(tiles, TILE, groups, t.bytes).transpose(0, 2, 1, 3)  # [T, G, 8, bytes]
    if name in K_TILE_BYTES:
        return _k_tiles(b, name)
    fields = [b[..., 0:2]]
    at = 2
    if name in ("Q4_1", "Q5_1"):
        fields.append(b[..., 2:4])
        at = 4
    if name in ("Q5_0", "Q5_1"):
        bits = np.unpackbits(b[..., at : at + 4], axis=-1, bitorder="little")  # element i
        bits = bits.reshape(*bits.shape[:-1], 8, 4).astype(np.uint8)  # [.., s, e]
        shifts = np.arange(8, dtype=np.uint8).reshape(8, 1)
        fields.append((bits << shifts).sum(axis=-2, dtype=np.uint8))  # [T, G, 8, 4]
        at += 4
    words = 8 if name == "Q8_0" else 4
    qs = b[..., at:].reshape(tiles, groups, TILE, words, 4).transpose(0, 1, 3, 2, 4)
    flat = [f.reshape(tiles, groups, -1) for f in (*fields, qs)]
    return np.ascontiguousarray(np.concatenate(flat, axis=-1))


def _k_tiles(b: np.ndarray, name: str) -> np.ndarray:
    """K-quant super-blocks ``[T, S, 8 columns, bytes]`` → the tiled layout ``[T, S,
    K_TILE_BYTES]``, per super-block (``models/ops/csrc/block_kernels.h``, ``repack_super_block``):

    * Q4_K: ``d[8]``, ``dmin[8]`` (float16); ``sc[8 groups][8 columns]`` and ``mn[8][8]``,
      the 6-bit scale and minimum a byte each; 4 runs of 8 words of 32 bytes, byte ``4c +
      e`` of word ``r`` of run ``p`` the stored byte ``32p + 4r + e`` of column ``c`` (low
      nibble: element ``4r + e`` of group ``2p``; high: of group ``2p + 1``);
    * Q6_K: ``d[8]`` (float16); ``sc[16 half-groups][8 columns]`` (int8); the 128 bytes of
      low nibbles as Q4_K's runs; per group ``j``, 2 words of 32 bytes of high bits: bits
      ``2s, 2s + 1`` of byte ``4c + e`` of word ``w`` the two high bits of element ``4(4w
      + s) + e`` of column ``c``.
    """
    tiles, supers = b.shape[:2]

    def side_by_side(field: np.ndarray) -> np.ndarray:  # [T, S, 8 c, F] → [T, S, F * 8]
        return field.swapaxes(-1, -2).reshape(tiles, supers, -1)

    def runs(qs: np.ndarray) -> np.ndarray:  # [T, S, 8 c, 128] → 4 runs x 8 words x (c, e)
        return qs.reshape(tiles, supers, TILE, 4, 8, 4).transpose(0, 1, 3, 4, 2, 5)

    if name == "Q4_K":
        sc, mn = _k_scales(b)
        fields = [b[..., 0:2], b[..., 2:4]]
        flat = [f.reshape(tiles, supers, -1) for f in fields]
        flat += [side_by_side(sc.astype(np.uint8)), side_by_side(mn.astype(np.uint8))]
        flat.append(runs(b[..., 16:144]).reshape(tiles, supers, -1))
        return np.ascontiguousarray(np.concatenate(flat, axis=-1))
    qh = b[..., 128:192].reshape(tiles, supers, TILE, 2, 2, 4, 4)  # [.., c, h, w, s, e]
    shifts = np.array([0, 2, 4, 6], np.uint8)
    two = (qh[..., :, None, :, :, :] >> shifts.reshape(4, 1, 1, 1)) & 3  # [.., c, h, t, w, s, e]
    packed = (two << shifts.reshape(4, 1)).sum(axis=-2, dtype=np.uint8)  # [.., c, h, t, w, e]
    high = packed.transpose(0, 1, 3, 4, 5, 2, 6)  # [T, S, h, t, w, c, e]: group 4h + t
    flat = [
        b[..., 208:210].reshape(tiles, supers, -1),
        side_by_side(b[..., 192:208]),
        runs(b[..., 0:128]).reshape(tiles, supers, -1),
        high.reshape(tiles, supers, -1),
    ]
    return np.ascontiguousarray(np.concatenate(flat, axis=-1))


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
    ``raw`` uint8 ``[N, K / block elements, bytes]`` blocks of ``name``.

    The kernel's float32 steps, which this sums exactly instead: per output, for each
    group ``g`` in order, with ``dot`` the exact integer sum of the group's products
    ``u * q`` (per half-group where the halves' scales differ: Q6_K) and ``sdx = dx *
    sum(q)`` rounded to float32,

    * the tiled types (:data:`TILED`, the layout the serving matrices hold):
      ``acc = fma(float(dot), d * dx, acc)``, ``off = fma(m, sdx, off)``, then
      ``out = acc + off`` (Q8_0: ``acc``; Q6_K, whose halves have their own scales:
      ``acc = fma(float(dot_half), d_half * dx, acc)`` for each half in turn, then
      ``out = acc``);
    * stored blocks (every type; Q5_K's only form): the dots of each 4 elements
      summed into 8 lanes by ``fma(float(dot4), d * dx, lane)``, the lanes added in a
      fixed tree, plus ``off`` as above.

    Either way a row's result depends on that row alone."""
    q, dx, sums = quantize_activations(x)
    u, d, m = decode_groups(raw, name)
    rows, k = q.shape
    qg = q.reshape(rows, k // GROUP, 2, 16).astype(np.int64)
    ug = u.reshape(u.shape[0], k // GROUP, 2, 16).astype(np.int64)
    dots = np.einsum("mghi,nghi->mngh", qg, ug).astype(np.float64)  # [M, N, G, 2]
    scaled = dots * d[None].astype(np.float64) + sums[:, None] * m[None].astype(np.float64)
    return (scaled.sum(axis=-1) * dx[:, None].astype(np.float64)).sum(axis=-1)


#: byte offsets of each type's float16 block scales (and offsets): the fields that scale
#: every weight of the block when multiplied together
_F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def synthetic_blocks(name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` rows of ``k`` elements of random blocks of ``name`` (uint8 ``[n, row bytes]``):
    random quants and sub-block scales, float16 scales of weights near unit size (for
    tests and benchmarks of types ``gguf`` cannot quantize)."""
    t = BLOCK_TYPES[name]
    rows = rng.integers(0, 256, (n, t.row_bytes(k)), dtype=np.uint8)
    blocks = rows.reshape(-1, t.bytes)
    per_element = {"Q8_0": 1 / 64, "Q4_0": 1 / 4, "Q4_1": 1 / 8, "Q5_0": 1 / 8, "Q5_1": 1 / 16,
                   "Q4_K": 1 / 256, "Q5_K": 1 / 512, "Q6_K": 1 / 1024}[name]  # fmt: skip
    for i, at in enumerate(_F16_FIELDS[name]):
        scale = rng.uniform(0.5, 1.5, blocks.shape[0]) * per_element
        value = scale if i == 0 or name.endswith("_K") else -8 * scale
        blocks[:, at : at + 2] = value.astype(np.float16).reshape(-1, 1).view(np.uint8)
    return rows


def scaled_blocks(raw: np.ndarray, name: str, factor: float) -> np.ndarray:
    """A copy of blocks ``raw`` (uint8 ``[..., blocks * bytes]`` rows) whose weights are
    ``factor`` times the originals: each block's float16 scale (and offset, for the types
    with one) multiplied and rounded to float16, exactly where ``factor`` is a power of two
    that keeps them normal."""
    t = BLOCK_TYPES[name]
    rows = np.array(raw, dtype=np.uint8, copy=True)
    blocks = rows.reshape(-1, t.bytes)
    for at in _F16_FIELDS[name]:
        half = np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16)
        scaled = (half.astype(np.float32) * np.float32(factor)).astype(np.float16)
        blocks[:, at : at + 2] = scaled.view(np.uint8)
    return rows
