"""llama.cpp's weight types in NumPy, and the type each tensor of a model gets.

* **Quantizers.** :func:`quantize` writes a ``[rows, cols]`` float array as the bytes of a
  GGML type, in the layouts ``gguf.quants.dequantize`` (and llama.cpp) read. F32, F16,
  BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 come from ``gguf.quants``; the K-quants Q4_K, Q5_K
  and Q6_K, which it cannot write, are here. They do not run llama.cpp's weighted
  iterative search; each sub-block's scale (and min) is the least-squares fit of a few
  candidate roundings, the one of smallest squared error kept, so a round trip's error
  is never far above llama.cpp's (``tests/test_quantize.py`` bounds it per type).
* **The type rule** (:func:`tensor_type`): one type for every 2-D tensor (as llama.cpp's
  ``llama-quantize --pure`` does), or one of llama.cpp's mixes, Q4_K_M and Q5_K_M. 1-D
  tensors (norms, biases, ``rope_freqs``) stay F32. A row length the chosen type's block
  does not divide falls back to a type whose block does (:data:`FALLBACK`), as llama.cpp
  does; the choice records both, so callers can say which tensors fell back.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType
from gguf import quants as gguf_quants

__all__ = [
    "FALLBACK",
    "QUANT_TYPES",
    "Choice",
    "file_type",
    "quantize",
    "quantize_q4_k",
    "quantize_q5_k",
    "quantize_q6_k",
    "tensor_type",
]

Q = GGMLQuantizationType

# The name a user gives (``--type``), the type of a model's bulk weights, and llama.cpp's
# ``general.file_type`` for the result. A pure K-quant is closest to llama.cpp's ``_S``
# variant (which bumps only a few tensors).
_TYPES: dict[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    "F32": (Q.F32, LlamaFileType.ALL_F32),
    "F16": (Q.F16, LlamaFileType.MOSTLY_F16),
    "BF16": (Q.BF16, LlamaFileType.MOSTLY_BF16),
    "Q8_0": (Q.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "Q4_0": (Q.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "Q4_1": (Q.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    "Q5_0": (Q.Q5_0, LlamaFileType.MOSTLY_Q5_0),
    "Q5_1": (Q.Q5_1, LlamaFileType.MOSTLY_Q5_1),
    "Q4_K": (Q.Q4_K, LlamaFileType.MOSTLY_Q4_K_S),
    "Q5_K": (Q.Q5_K, LlamaFileType.MOSTLY_Q5_K_S),
    "Q6_K": (Q.Q6_K, LlamaFileType.MOSTLY_Q6_K),
    "Q4_K_M": (Q.Q4_K, LlamaFileType.MOSTLY_Q4_K_M),
    "Q5_K_M": (Q.Q5_K, LlamaFileType.MOSTLY_Q5_K_M),
}
QUANT_TYPES = tuple(_TYPES)
"""The target types ``spectrio quantize --type`` takes."""
_MIXES = frozenset({"Q4_K_M", "Q5_K_M"})

FALLBACK: dict[GGMLQuantizationType, GGMLQuantizationType] = {
    Q.Q4_K: Q.Q5_0,
    Q.Q5_K: Q.Q5_1,
    Q.Q6_K: Q.Q8_0,
}
"""llama.cpp's replacement for a K-quant (256-element blocks) whose block does not divide
a row: a 32-element type of at least as many bits. Where 32 does not divide it either,
the tensor is stored as F16."""

QK_K = 256  # elements in a K-quant super-block


def file_type(target: str) -> int:
    """llama.cpp's ``general.file_type`` value for a ``--type`` name."""
    return int(_TYPES[target][1])


@dataclasses.dataclass(frozen=True)
class Choice:
    """The type a tensor is stored in."""

    qtype: GGMLQuantizationType
    #: the type the rule picked, when its block did not divide the rows (so ``qtype``
    #: is its fallback); None when it fitted
    wanted: GGMLQuantizationType | None = None


_LAYER = re.compile(r"blk\.(\d+)\.")


def _more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits in its ``_M`` mixes: the first and
    last eighth, and every third layer in between."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def _fits(qtype: GGMLQuantizationType, row: int) -> bool:
    return row % GGML_QUANT_SIZES[qtype][0] == 0


def tensor_type(
    name: str, shape: tuple[int, ...], target: str, num_layers: int, tied: bool
) -> Choice:
    """The type GGUF tensor ``name`` (llama.cpp's name, ``shape`` in NumPy order: rows
    last) is stored in for ``--type target``, in a model of ``num_layers`` blocks whose
    output head is the token embedding when ``tied``.

    * 1-D tensors stay F32.
    * A single type (F32 ... Q6_K) applies to every 2-D tensor.
    * Q4_K_M and Q5_K_M follow llama.cpp's rule for a dense model: the bulk in Q4_K
      (Q5_K); the output head (``output.weight``, or ``token_embd.weight`` when tied) in
      Q6_K, or Q8_0 where 256 does not divide its rows; ``attn_v.weight`` and
      ``ffn_down.weight`` in Q6_K in the first and last eighth of the layers and every
      third layer in between.
    * Then the fallback: a type whose block does not divide the row length becomes its
      :data:`FALLBACK` (Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0), or F16 where 32 does
      not divide it either.
    """
    if target not in _TYPES:
        raise ValueError(f"unknown type {target!r} (one of {', '.join(QUANT_TYPES)})")
    if len(shape) < 2:
        return Choice(Q.F32)
    row = shape[-1]
    qtype = _TYPES[target][0]
    if target in _MIXES:
        head = name == "output.weight" or (tied and name == "token_embd.weight")
        match = _LAYER.match(name)
        if head:
            qtype = Q.Q6_K if row % QK_K == 0 else Q.Q8_0
        elif match and name.endswith(("attn_v.weight", "ffn_down.weight")):
            if _more_bits(int(match.group(1)), num_layers):
                qtype = Q.Q6_K
    if _fits(qtype, row):
        return Choice(qtype)
    fallback = FALLBACK.get(qtype, qtype)
    return Choice(fallback if _fits(fallback, row) else Q.F16, wanted=qtype)


def quantize(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """``values`` (float, rows last) stored as ``qtype``: float32 or float16 arrays for F32
    and F16, else ``uint8`` arrays of the blocks' bytes, one row of bytes per row. The
    caller has checked that the type's block divides the row length."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    own = _K_QUANTS.get(qtype)
    if own is None:
        return np.asarray(gguf_quants.quantize(values, qtype))
    rows = values.reshape(-1, values.shape[-1])
    blocks = own(rows.reshape(-1, QK_K))
    return blocks.reshape(*values.shape[:-1], -1)


# ---- the K-quants ------------------------------------------------------------------------

# Candidate roundings tried per sub-block: the inverse scale that maps its range onto
# the levels, stretched by each of these many levels (0 is the plain min/max mapping).
_STRETCH = np.linspace(-1.0, 1.0, 9, dtype=np.float32)
_CHUNK = 1024  # super-blocks per pass: the temporaries stay in cache


def _chunked(
    quantizer: Callable[[np.ndarray], np.ndarray], blocks: np.ndarray, size: int
) -> np.ndarray:
    out = np.empty((blocks.shape[0], size), dtype=np.uint8)
    for lo in range(0, blocks.shape[0], _CHUNK):
        out[lo : lo + _CHUNK] = quantizer(blocks[lo : lo + _CHUNK])
    return out


def _fit_affine(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """(scale >= 0, offset <= 0) per row of ``x`` such that ``scale * q + offset`` with
    integer ``q`` in ``0..nmax`` approximates the row: of the min/max mapping and the
    least-squares refits of a few other roundings, the one of least squared error. The
    offset is at most 0 because the K-quants store it as a non-negative min that is
    subtracted."""
    n = x.shape[-1]
    lo = np.minimum(x.min(axis=-1), 0.0)
    rng = x.max(axis=-1) - lo
    inv = np.divide(1.0, rng, out=np.zeros_like(rng), where=rng > 0)
    shifted = x - lo[:, None]
    sx = x.sum(axis=-1)
    sxx = np.einsum("ij,ij->i", x, x)
    best_scale = rng / nmax
    best_off = lo
    best_err = np.full_like(rng, np.inf)
    for stretch in _STRETCH:
        q = np.rint(shifted * ((nmax + stretch) * inv)[:, None])
        np.clip(q, 0, nmax, out=q)
        sq = q.sum(axis=-1)
        sqq = np.einsum("ij,ij->i", q, q)
        sqx = np.einsum("ij,ij->i", q, x)
        det = n * sqq - sq * sq
        ok = det > 0
        safe = np.where(ok, det, 1.0)
        scale = (n * sqx - sq * sx) / safe
        off = (sx - scale * sq) / n
        # A positive offset is not storable: refit the scale alone with offset 0.
        pos = off > 0
        scale = np.where(pos, sqx / np.where(sqq > 0, sqq, 1.0), scale)
        off = np.where(pos, 0.0, off)
        scale = np.maximum(scale, 0.0)
        err = sxx + scale * scale * sqq + n * off * off + 2 * scale * off * sq
        err -= 2 * scale * sqx + 2 * off * sx
        if stretch == 0:  # the min/max mapping itself is a candidate too
            plain = rng / nmax
            e0 = sxx + plain * plain * sqq + n * lo * lo + 2 * plain * lo * sq
            e0 -= 2 * plain * sqx + 2 * lo * sx
            take = e0 < best_err
            best_scale = np.where(take, plain, best_scale)
            best_off = np.where(take, lo, best_off)
            best_err = np.where(take, e0, best_err)
        take = ok & (err < best_err)
        best_scale = np.where(take, scale, best_scale)
        best_off = np.where(take, off, best_off)
        best_err = np.where(take, err, best_err)
    return best_scale.astype(np.float32), best_off.astype(np.float32)


def _six_bits(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative ``values`` ``[blocks, 8]`` as a float16 super-scale per block and
    6-bit multiples of it: ``values ~= d * codes``."""
    top = values.max(axis=-1)
    d = (top / 63).astype(np.float16)
    d32 = d.astype(np.float32)
    codes = np.rint(values / np.where(d32 > 0, d32, 1.0)[:, None])
    codes = np.where(d32[:, None] > 0, np.clip(codes, 0, 63), 0).astype(np.uint8)
    return d, codes


def _affine_super_block(
    blocks: np.ndarray, nmax: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's shared part: eight 32-element sub-blocks per 256, each with a
    6-bit scale and a 6-bit min under the block's float16 ``d`` and ``dmin``. Returns
    (d, dmin, scale codes, min codes, levels ``[blocks, 8, 32]`` in ``0..nmax``)."""
    nb = blocks.shape[0]
    x = blocks.reshape(nb * 8, 32)
    scale, off = _fit_affine(x, nmax)
    d, sc = _six_bits(scale.reshape(nb, 8))
    dmin, mn = _six_bits(-off.reshape(nb, 8))
    # Levels against the scales as stored: rounding those moved the best level.
    step = (d.astype(np.float32)[:, None] * sc).reshape(-1, 1)
    low = (dmin.astype(np.float32)[:, None] * mn).reshape(-1, 1)
    q = np.rint((x + low) / np.where(step > 0, step, 1.0))
    q = np.where(step > 0, np.clip(q, 0, nmax), 0).astype(np.uint8)
    return d, dmin, sc, mn, q.reshape(nb, 8, 32)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins in llama.cpp's 12 bytes: bytes 0-3 hold scales 0-3 and
    the top two bits of scales 4-7, bytes 4-7 the mins likewise, bytes 8-11 the low
    nibbles of scales 4-7 (low half) and mins 4-7 (high half)."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return out


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Levels ``[blocks, 8, 32]`` (4 bits used) as 128 bytes: sub-blocks 2j and 2j+1 share
    bytes 32j..32j+31, the even one in the low nibbles."""
    low = q[:, 0::2] & 0x0F
    high = q[:, 1::2] & 0x0F
    return (low | (high << 4)).reshape(q.shape[0], 128)


def _q4_k_chunk(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _affine_super_block(blocks, 15)
    head = np.concatenate([d.reshape(-1, 1), dmin.reshape(-1, 1)], axis=1).view(np.uint8)
    return np.concatenate([head, _pack_scales(sc, mn), _nibbles(q)], axis=1)


def _q5_k_chunk(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _affine_super_block(blocks, 31)
    head = np.concatenate([d.reshape(-1, 1), dmin.reshape(-1, 1)], axis=1).view(np.uint8)
    # Bit j of byte i: the fifth bit of element i of sub-block j.
    fifth = (q >> 4) << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    qh = np.bitwise_or.reduce(fifth, axis=1)
    return np.concatenate([head, _pack_scales(sc, mn), qh, _nibbles(q)], axis=1)


def _q6_k_chunk(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: sixteen 16-element sub-blocks per 256, symmetric levels -32..31 under an
    8-bit signed scale each and the block's float16 ``d``."""
    nb = blocks.shape[0]
    x = blocks.reshape(nb * 16, 16)
    # The element of largest magnitude maps to -32, the level with no positive twin;
    # then least-squares refits of a few stretched roundings, the best kept.
    peak = np.take_along_axis(x, np.abs(x).argmax(axis=-1)[:, None], axis=-1)[:, 0]
    sxx = np.einsum("ij,ij->i", x, x)
    best_scale = -peak / 32
    best_err = np.full_like(peak, np.inf)
    inv = np.divide(-1.0, peak, out=np.zeros_like(peak), where=peak != 0)
    for stretch in _STRETCH:
        q = np.rint(x * ((32 + stretch) * inv)[:, None])
        np.clip(q, -32, 31, out=q)
        sqq = np.einsum("ij,ij->i", q, q)
        sqx = np.einsum("ij,ij->i", q, x)
        ok = sqq > 0
        scale = sqx / np.where(ok, sqq, 1.0)
        err = sxx - scale * sqx
        take = ok & (err < best_err)
        best_scale = np.where(take, scale, best_scale)
        best_err = np.where(take, err, best_err)
    scales = best_scale.reshape(nb, 16)
    # The scale of largest magnitude becomes -128 (int8's end without a positive twin).
    big = np.take_along_axis(scales, np.abs(scales).argmax(axis=-1)[:, None], axis=-1)[:, 0]
    d = (-big / 128).astype(np.float16)
    d32 = d.astype(np.float32)
    codes = np.rint(scales / np.where(d32 != 0, d32, 1.0)[:, None])
    codes = np.where(d32[:, None] != 0, np.clip(codes, -128, 127), 0).astype(np.int8)
    step = (d32[:, None] * codes).reshape(-1, 1)
    q = np.rint(x / np.where(step != 0, step, 1.0))
    q = (np.where(step != 0, np.clip(q, -32, 31), 0) + 32).astype(np.uint8)
    # Layout: elements in eight groups of 32 (group g, element i); the low nibbles fill
    # two halves of 64 bytes, groups 4h, 4h+1 in the low and 4h+2, 4h+3 in the high
    # nibbles of half h; the top two bits of groups 4h..4h+3 share byte 32h + i.
    groups = q.reshape(nb, 2, 4, 32)
    low = groups & 0x0F
    ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(nb, 128)
    top = groups >> 4
    qh = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)
    return np.concatenate(
        [ql, qh.reshape(nb, 64), codes.view(np.uint8), d.reshape(-1, 1).view(np.uint8)], axis=1
    )


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Float32 super-blocks ``[n, 256]`` as Q4_K's 144-byte blocks ``[n, 144]``."""
    return _chunked(_q4_k_chunk, blocks, GGML_QUANT_SIZES[Q.Q4_K][1])


def quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """Float32 super-blocks ``[n, 256]`` as Q5_K's 176-byte blocks ``[n, 176]``."""
    return _chunked(_q5_k_chunk, blocks, GGML_QUANT_SIZES[Q.Q5_K][1])


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Float32 super-blocks ``[n, 256]`` as Q6_K's 210-byte blocks ``[n, 210]``."""
    return _chunked(_q6_k_chunk, blocks, GGML_QUANT_SIZES[Q.Q6_K][1])


_K_QUANTS = {Q.Q4_K: quantize_q4_k, Q.Q5_K: quantize_q5_k, Q.Q6_K: quantize_q6_k}
