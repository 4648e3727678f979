"""Products with GGUF's quantized blocks (``models/ops/csrc/block_kernels.h``): every type
the kernels run, as stored and (all but Q5_K) in the tiled layout the serving
matrices hold, against NumPy references of the layouts and of the int8 product, bit for
bit across row counts, threads and CPU paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from spectrio.errors import CheckpointError
from spectrio.models.ops import gguf_blocks as gb
from spectrio.models.ops import native_ops
from spectrio.models.ops.cpu_paths import CPU_PATH_ENV, available_paths
from spectrio.models.ops.fast_ops import cpuinfo_line
from spectrio.models.ops.paddle_setup import configure_paddle, configured_threads, paddle

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

NATIVE = [t.name for t in gb.BLOCK_TYPES.values() if t.native]
TILED = list(gb.TILED)
needs_kernels = pytest.mark.skipif(
    not native_ops.native_ops_available(), reason="spectrio's native kernels do not build here"
)


K_QUANTS = ["Q4_K", "Q5_K", "Q6_K"]


def _k(name: str, k: int = 576) -> int:
    """``k``, or for a K-quant the next multiple of its 256-element super-blocks."""
    step = gb.BLOCK_TYPES[name].elements
    return -(-k // step) * step


def _blocks(name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """``n`` rows of ``k`` Gaussian weights (a few outliers) quantized by ``gguf``:
    uint8 ``[n, k / block elements, bytes]`` (K-quants, which ``gguf`` cannot quantize:
    random blocks, :func:`gb.synthetic_blocks`)."""
    rng = np.random.default_rng(seed)
    t = gb.BLOCK_TYPES[name]
    if name in K_QUANTS:
        return gb.synthetic_blocks(name, n, k, rng).reshape(n, -1, t.bytes)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[rng.random((n, k)) < 0.01] *= 8.0
    raw = quantize(w, getattr(gguf.GGMLQuantizationType, name))
    return raw.reshape(n, k // 32, t.bytes)


def _matmul(x: np.ndarray, blocks: np.ndarray, name: str, tiled: bool = False) -> np.ndarray:
    """The op's product with ``blocks`` as stored, or (``tiled``) regrouped into tiles."""
    t = gb.BLOCK_TYPES[name]
    w = gb.tile_blocks(blocks, name) if tiled else blocks.reshape(-1)
    with paddle.no_grad():
        out = native_ops.block_matmul(
            paddle.to_tensor(x), paddle.to_tensor(w), t.ggml_id, blocks.shape[0]
        )
    return out.numpy()


_LAYOUTS = [(name, False) for name in NATIVE] + [(name, True) for name in TILED]
_IDS = [f"{name}-{'tiled' if tiled else 'stored'}" for name, tiled in _LAYOUTS]


@pytest.mark.parametrize("name", NATIVE)
def test_the_group_decoder_reads_each_layout_as_gguf_does(name: str) -> None:
    blocks = _blocks(name, 7, 512)
    want = dequantize(blocks.reshape(7, -1), getattr(gguf.GGMLQuantizationType, name))
    np.testing.assert_array_equal(gb.dequantize(blocks, name), want)


@pytest.mark.parametrize("name", K_QUANTS)
def test_k_quant_groups_carry_their_own_scales(name: str) -> None:
    """Eight groups of 32 a super-block, each with the scale (per half for Q6_K) and
    offset of its sub-block: the groups of one super-block differ."""
    blocks = _blocks(name, 3, 256, seed=4)
    u, d, m = gb.decode_groups(blocks, name)
    assert u.shape == (3, 8, 32) and d.shape == m.shape == (3, 8, 2)
    assert u.dtype == (np.int8 if name == "Q6_K" else np.uint8)
    assert len(np.unique(d[0, :, 0])) > 1
    if name == "Q6_K":
        assert not m.any() and u.min() >= -32 and u.max() <= 31
    else:
        assert (d[..., 0] == d[..., 1]).all() and (m <= 0).all() and u.max() <= 31


def test_activations_are_quantized_per_32_with_their_half_sums() -> None:
    x = np.linspace(-3.0, 5.0, 64, dtype=np.float32).reshape(1, 64)
    x[0, 32:] = 0.0  # an all-zero group: scale 0, every q 0
    q, dx, sums = gb.quantize_activations(x)
    assert dx[0, 0] == np.float32(np.abs(x[0, :32]).max()) / np.float32(127)
    assert np.abs(q[0, :32]).max() == 127 and not q[0, 32:].any() and dx[0, 1] == 0
    np.testing.assert_array_equal(sums[0, 0], [q[0, :16].sum(), q[0, 16:32].sum()])
    err = np.abs(q[0, :32] * dx[0, 0] - x[0, :32]).max()
    assert err <= dx[0, 0] / 2 + 1e-7


def test_the_tiled_layout_holds_each_blocks_fields_and_values() -> None:
    """Per tile of 8 columns and group: the scales (and offsets) side by side, then each
    4 consecutive elements of the 8 columns in one 32-byte run; 4-bit types keep each
    stored byte whole, the fifth bits are regrouped per element. The same bytes per block,
    the missing columns of the last tile zero."""
    for name in (n for n in TILED if n not in K_QUANTS):
        t = gb.BLOCK_TYPES[name]
        blocks = _blocks(name, 11, 64, seed=2)
        tiles = gb.tile_blocks(blocks, name)
        assert tiles.shape == (2, 2, 8 * t.bytes)
        assert not tiles[1, :, 2 * 3 : 16].any()  # columns 11-15 have zero scales
        u, d, m = gb.decode_groups(blocks, name)
        for c in (0, 5, 10):
            o = tiles[c // 8, 1]
            col = c % 8
            assert o[2 * col : 2 * col + 2].view(np.float16)[0] == d[c, 1, 0]
            if name in ("Q4_1", "Q5_1"):
                assert o[16 + 2 * col : 18 + 2 * col].view(np.float16)[0] == m[c, 1, 0]
            quants = o[16 + 16 * (name in ("Q4_1", "Q5_1")) + 32 * name.startswith("Q5") :]
            high = o[16 + 16 * (name == "Q5_1") : 48 + 16 * (name == "Q5_1")]
            for i in (0, 7, 16, 31):
                s_, e = divmod(i, 4)
                if name == "Q8_0":
                    value = int(quants[32 * s_ + 4 * col + e].view(np.int8))
                else:
                    byte = int(quants[32 * (s_ & 3) + 4 * col + e])
                    value = byte & 15 if s_ < 4 else byte >> 4
                    if name.startswith("Q5"):
                        value |= ((int(high[4 * col + e]) >> s_) & 1) << 4
                assert value == int(u[c, 1, i]), (name, c, i)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_a_k_quant_tile_holds_each_super_blocks_scales_and_values(name: str) -> None:
    """Per tile of 8 columns and super-block: the float16 scales side by side, then each
    group's scales (Q4_K: and minimums) a byte per column (Q6_K: per half-group, int8),
    then the quants, each stored byte of 4-bit nibbles kept whole (Q6_K's 2 high bits
    regrouped per element). Decoded back, every value and scale is the block's own; the
    missing columns of the last tile are zero."""
    t = gb.BLOCK_TYPES[name]
    blocks = _blocks(name, 11, 512, seed=4)
    tiles = gb.tile_blocks(blocks, name)
    assert tiles.shape == (2, 2, gb.K_TILE_BYTES[name])
    assert not tiles[1, :, 2 * 3 : 16].any()  # columns 11-15 have zero scales
    u, d, m = gb.decode_groups(blocks, name)  # [N, groups, ...]
    for c in (0, 5, 10):
        col = c % 8
        for sb in (0, 1):
            o = tiles[c // 8, sb]
            d16 = float(o[2 * col : 2 * col + 2].view(np.float16)[0])
            for j in (0, 3, 6, 7):
                g = 8 * sb + j
                if name == "Q4_K":
                    assert d16 * float(o[32 + 8 * j + col]) == d[c, g, 0]
                    dmin = float(o[16 + 2 * col : 18 + 2 * col].view(np.float16)[0])
                    assert -(dmin * float(o[96 + 8 * j + col])) == m[c, g, 0]
                else:
                    for half in (0, 1):
                        at = 16 + 8 * (2 * j + half) + col
                        assert d16 * float(o[at : at + 1].view(np.int8)[0]) == d[c, g, half]
                for i in (0, 5, 17, 31):
                    s_, e = divmod(i, 4)
                    if name == "Q4_K":
                        byte = int(o[160 + 256 * (j >> 1) + 32 * s_ + 4 * col + e])
                        value = (byte >> (4 * (j & 1))) & 15
                    else:
                        h, tt = divmod(j, 4)
                        byte = int(o[144 + 256 * (2 * h + (tt & 1)) + 32 * s_ + 4 * col + e])
                        high = int(o[1168 + 64 * j + 32 * (s_ >> 2) + 4 * col + e])
                        low = (byte >> (4 * (tt >> 1))) & 15
                        value = (low | ((high >> (2 * (s_ & 3))) & 3) << 4) - 32
                    want = int(np.int8(u[c, g, i])) if name == "Q6_K" else int(u[c, g, i])
                    assert value == want, (name, c, g, i)
    assert t.ggml_id in (12, 14)


@needs_kernels
@pytest.mark.parametrize("name", TILED)
def test_the_native_repack_is_the_layouts_definition(name: str) -> None:
    t = gb.BLOCK_TYPES[name]
    for n, k in ((37, 576), (8, 32), (3, 1536)):
        k = _k(name, k)
        raw = gb.synthetic_blocks(name, n, k, np.random.default_rng(n))
        got = native_ops.repack_tiles(paddle.to_tensor(raw), t.ggml_id, n, k).numpy()
        np.testing.assert_array_equal(got, gb.tile_blocks(raw, name))


@needs_kernels
@pytest.mark.parametrize(("name", "tiled"), _LAYOUTS, ids=_IDS)
@pytest.mark.parametrize("rows", [1, 3, 5, 16, 19])
def test_the_kernel_computes_the_int8_product_of_the_reference(
    name: str, tiled: bool, rows: int
) -> None:
    """K = 576 (18 groups, SmolLM2's width; 768 for the K-quants' super-blocks), 37
    outputs (no multiple of anything)."""
    k = _k(name)
    blocks = _blocks(name, 37, k, seed=rows)
    x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
    got = _matmul(x, blocks, name, tiled)
    want = gb.reference_matmul(x, blocks, name)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    # and close to the float product of the dequantized weights: the int8 activations
    # cost well under 1% of a product's scale
    exact = x.astype(np.float64) @ gb.dequantize(blocks, name).T.astype(np.float64)
    assert np.abs(got - exact).max() <= 0.01 * np.abs(exact).max()


@needs_kernels
@pytest.mark.parametrize(
    ("name", "tiled"),
    [
        ("Q4_1", False),
        ("Q8_0", False),
        *[(n, False) for n in K_QUANTS],
        *[(n, True) for n in TILED],
    ],
)
def test_a_rows_product_does_not_depend_on_its_batch_or_the_threads(name: str, tiled: bool) -> None:
    """Tiled: 1-4 rows keep their sums in registers, more rows in blocks of 16 in memory
    (row 16 of 17 is a block of its own); every row takes the same chain."""
    blocks = _blocks(name, 53, 1536)
    x = np.random.default_rng(5).standard_normal((17, 1536)).astype(np.float32)
    together = _matmul(x, blocks, name, tiled)
    for i in (0, 6, 16):
        np.testing.assert_array_equal(_matmul(x[i : i + 1], blocks, name, tiled)[0], together[i])
    for lo, hi in ((3, 8), (2, 4), (9, 13), (1, 17)):
        np.testing.assert_array_equal(_matmul(x[lo:hi], blocks, name, tiled), together[lo:hi])
    before = configured_threads()
    try:
        configure_paddle(1)
        np.testing.assert_array_equal(_matmul(x, blocks, name, tiled), together)
    finally:
        configure_paddle(before or 1)


@needs_kernels
def test_bad_shapes_are_refused_by_the_op() -> None:
    blocks = _blocks("Q8_0", 4, 64)
    x = paddle.to_tensor(np.ones((1, 64), np.float32))
    w = paddle.to_tensor(blocks.reshape(-1))
    with paddle.no_grad():
        with pytest.raises(OSError, match="not 5 rows"):  # what Paddle makes of a PD_CHECK
            native_ops.block_matmul(x, w, 8, 5)
        with pytest.raises(OSError, match="no kernel for ggml type 10"):
            native_ops.block_matmul(x, w, 10, 4)
        with pytest.raises(OSError, match="multiple of 32"):
            native_ops.block_matmul(paddle.to_tensor(np.ones((1, 40), np.float32)), w, 8, 4)
        with pytest.raises(OSError, match="multiple of 256 for ggml type 12"):
            native_ops.block_matmul(paddle.to_tensor(np.ones((1, 576), np.float32)), w, 12, 4)
        tiles = paddle.to_tensor(gb.tile_blocks(blocks, "Q8_0"))  # [1, 2, 272]
        with pytest.raises(OSError, match="nor their tiles"):
            native_ops.block_matmul(x, tiles, 8, 9)  # two tiles' worth of columns
        with pytest.raises(OSError, match="nor their tiles"):
            native_ops.block_matmul(x, tiles, 2, 4)  # Q4_0 tiles are [1, 2, 144]
        with pytest.raises(OSError, match="no tiled layout for ggml type 13"):
            native_ops.repack_tiles(w, 13, 4, 64)  # Q5_K is multiplied as stored


def test_a_tensor_whose_bytes_do_not_fit_its_type_and_shape_is_named() -> None:
    gb.check_tensor_bytes("blk.0.ffn_up.weight", 8, (576, 1536), 1536 * 18 * 34)
    with pytest.raises(CheckpointError, match=r"'blk.0.ffn_up.weight': 100 bytes, but Q8_0"):
        gb.check_tensor_bytes("blk.0.ffn_up.weight", 8, (576, 1536), 100)
    with pytest.raises(CheckpointError, match="not whole Q4_K blocks of 256"):
        gb.check_tensor_bytes("t", 12, (576, 2), 0)
    with pytest.raises(CheckpointError, match="unknown ggml type 99"):
        gb.check_tensor_bytes("t", 99, (32,), 0)


_ON_PATH = """
import json, sys
import numpy as np
from spectrio.models.ops import native_ops, gguf_blocks as gb
from spectrio.models.ops.paddle_setup import paddle
assert native_ops.native_ops_available()
data = np.load(sys.argv[1])
out = {}
with paddle.no_grad():
    for name in NAMES:
        t = gb.BLOCK_TYPES[name]
        w = paddle.to_tensor(np.ascontiguousarray(data[name]).reshape(-1))
        y = native_ops.block_matmul(paddle.to_tensor(data["x"]), w, t.ggml_id, data[name].shape[0])
        out[name] = y.numpy().view(np.uint32).tolist()
        if name in gb.TILED:
            w = paddle.to_tensor(gb.tile_blocks(data[name], name))
            n = data[name].shape[0]
            y = native_ops.block_matmul(paddle.to_tensor(data["x"]), w, t.ggml_id, n)
            out[name + "-tiled"] = y.numpy().view(np.uint32).tolist()
print(json.dumps({"path": native_ops.cpu_path(), "out": out}))
""".replace("NAMES", repr(NATIVE))


@needs_kernels
def test_the_generic_and_avx2_paths_give_the_same_bits(tmp_path) -> None:  # noqa: ANN001
    flags = frozenset(cpuinfo_line("flags").partition(":")[2].split())
    paths = [p for p in ("generic", "avx2") if p in available_paths(flags)]
    if len(paths) < 2:
        pytest.skip("this CPU runs only the generic path")
    x = np.random.default_rng(9).standard_normal((18, 512)).astype(np.float32)
    arrays = {name: _blocks(name, 11, 512) for name in NATIVE}  # a partial tile too
    np.savez(tmp_path / "in.npz", x=x, **arrays)
    seen = {}
    for path in paths:
        proc = subprocess.run(
            [sys.executable, "-c", _ON_PATH, str(tmp_path / "in.npz")],
            env={**os.environ, CPU_PATH_ENV: path},
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert got["path"] == path
        seen[path] = got["out"]
    assert seen["generic"] == seen["avx2"]
    assert len(seen["avx2"]) == len(NATIVE) + len(TILED)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


@needs_kernels
@pytest.mark.parametrize(
    ("name", "tiled"),
    [("Q8_0", False), ("Q4_1", False), ("Q4_0", False), ("Q4_K", False), ("Q6_K", False),
     ("Q8_0", True), ("Q4_1", True), ("Q5_0", True)],
)  # fmt: skip
def test_the_mlp_op_runs_block_weights_with_the_norm_weight_it_is_given(
    name: str, tiled: bool
) -> None:
    """The layer op's MLP half with GGUF blocks for gate|up and down (as stored, or
    tiled): the RMSNorm weight is applied in the op (it cannot be folded into quantized
    values), then the same int8 products as the reference. Against NumPy: the norm, the
    reference products, SwiGLU. Q4_0 and Q4_K rows are the same size: the op computes
    with the type it is given."""
    rng = np.random.default_rng(3)
    n, d, f = 5, _k(name, 96), _k(name, 160)
    t = gb.BLOCK_TYPES[name]
    x = rng.standard_normal((n, d)).astype(np.float32)
    delta = rng.standard_normal((n, d)).astype(np.float32)
    norm_w = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    gate_up, down = _blocks(name, 2 * f, d, seed=1), _blocks(name, d, f, seed=2)
    layout = (lambda b: gb.tile_blocks(b, name)) if tiled else (lambda b: b.reshape(len(b), -1))
    with paddle.no_grad():
        out, summed = native_ops.mlp_block(
            paddle.to_tensor(x), paddle.to_tensor(delta), None,
            paddle.to_tensor(layout(gate_up)), None,
            paddle.to_tensor(layout(down)), f, 1e-5, norm_weight=paddle.to_tensor(norm_w),
            types=(t.ggml_id, t.ggml_id),
        )  # fmt: skip
    s = x + delta
    np.testing.assert_array_equal(summed.numpy(), s)
    normed = s / np.sqrt((s.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-5) * norm_w
    gu = gb.reference_matmul(normed.astype(np.float32), gate_up, name)
    act = _silu(gu[:, :f]) * gu[:, f:]
    want = gb.reference_matmul(act.astype(np.float32), down, name)
    # the op rounds in float32 where NumPy used float64: a q may land one step off
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=5e-3 * np.abs(want).max())
    with paddle.no_grad(), pytest.raises(OSError, match="need the norm weight"):
        native_ops.mlp_block(
            paddle.to_tensor(x), None, None, paddle.to_tensor(gate_up.reshape(2 * f, -1)), None,
            paddle.to_tensor(down.reshape(d, -1)), f, 1e-5, types=(t.ggml_id, t.ggml_id),
        )  # fmt: skip
    with paddle.no_grad(), pytest.raises(OSError, match="the caller passes the blocks' type"):
        native_ops.mlp_block(
            paddle.to_tensor(x), None, None, paddle.to_tensor(gate_up.reshape(2 * f, -1)), None,
            paddle.to_tensor(down.reshape(d, -1)), f, 1e-5, norm_weight=paddle.to_tensor(norm_w),
        )  # fmt: skip


@needs_kernels
def test_a_serving_matrix_keeps_blocks_and_multiplies_by_them() -> None:
    """The tiled types regrouped into tiles once (the same bytes per block, Q4_K's
    unpacked scales aside); Q5_K kept as stored, without a copy."""
    from spectrio.models.ops.serving_matrix import ServingMatrix

    blocks = _blocks("Q5_0", 21, 64)
    raw = blocks.reshape(21, -1)
    m = ServingMatrix.from_blocks(raw, "Q5_0", 64)
    assert m.shape == (64, 21) and m.packed and m.blocks and m.panels.dtype == paddle.uint8
    np.testing.assert_array_equal(m.panels.numpy(), gb.tile_blocks(raw, "Q5_0"))
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    with paddle.no_grad():
        got = m.matmul(paddle.to_tensor(x)).numpy()
    np.testing.assert_array_equal(got, _matmul(x, blocks, "Q5_0", tiled=True))
    assert m.ggml_type == gb.BLOCK_TYPES["Q5_0"].ggml_id
    with pytest.raises(ValueError, match="no block kernel for BF16"):
        ServingMatrix.from_blocks(raw, "BF16", 64)
    with pytest.raises(ValueError, match="do not hold 96 elements"):
        ServingMatrix.from_blocks(raw, "Q5_0", 96)
    k_rows = _blocks("Q4_K", 3, 1536).reshape(3, -1)
    with pytest.raises(ValueError, match="Q4_K needs rows of a multiple of 256 elements, not 576"):
        ServingMatrix.from_blocks(k_rows[:, : 576 // 32 * 18], "Q4_K", 576)
    q4k = ServingMatrix.from_blocks(k_rows, "Q4_K", 1536)
    np.testing.assert_array_equal(q4k.panels.numpy(), gb.tile_blocks(k_rows, "Q4_K"))
    q5k_rows = _blocks("Q5_K", 3, 1536).reshape(3, -1)
    q5k = ServingMatrix.from_blocks(q5k_rows, "Q5_K", 1536)
    assert q5k.panels.data_ptr() == q5k_rows.ctypes.data  # the file's bytes, not a copy
    assert q4k.ggml_type == 12 and ServingMatrix(np.ones((4, 16), np.float32)).ggml_type == 0


@needs_kernels
@pytest.mark.parametrize("name", sorted(n for n, t in gb.BLOCK_TYPES.items() if t.native))
def test_embedded_rows_are_gguf_py_s_bit_for_bit(name: str) -> None:
    """``spectrio_embed_rows`` (a step's embedding rows of a quantized file) gives exactly
    gguf-py's float32 values for every block type, from the blocks as stored and from
    their tiles (a tied head's layout), so a served model embeds the rows of the same file
    widened to float32. An id outside the rows is refused."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    t = gb.BLOCK_TYPES[name]
    n, k = 13, _k(name, 512)
    rows = gb.synthetic_blocks(name, n, k, np.random.default_rng(11))
    want = np.asarray(dequantize(rows, GGMLQuantizationType(t.ggml_id)), np.float32)
    want = want.reshape(n, k)
    ids = np.array([12, 0, 7, 7, 3], np.int64)
    layouts = [paddle.to_tensor(rows.reshape(n, -1))]
    if name in gb.TILED:
        layouts.append(native_ops.repack_tiles(layouts[0], t.ggml_id, n, k))
    for w in layouts:
        got = native_ops.embed_rows(w, paddle.to_tensor(ids), t.ggml_id, n, k).numpy()
        np.testing.assert_array_equal(got.view(np.uint32), want[ids].view(np.uint32))
        with pytest.raises(OSError, match="id 13 is outside 0..12"):
            native_ops.embed_rows(w, paddle.to_tensor(np.array([13])), t.ggml_id, n, k)
