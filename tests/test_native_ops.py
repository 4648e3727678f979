"""spectrio's own kernels (models/ops/native_ops.py) against the plain Paddle path they
replace, and the switch that turns them off."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from spectrio.models.ops import native_ops
from spectrio.models.ops.paddle_setup import configure_paddle, paddle
from spectrio.models.ops.serving_matrix import PANEL, ServingMatrix, pack_panels

configure_paddle()  # Paddle as the runtime sets it up (stride kernels off), in any test order

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="no C++ compiler: the kernels cannot be built, the Python path runs",
)


def test_the_kernels_build_and_load_here() -> None:
    assert native_ops.native_ops_available()


@pytest.mark.parametrize("shape", [(1, 576), (16, 576), (3, 5, 64), (2, 7)])
def test_add_rms_norm_equals_the_plain_ops(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    x, delta = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    weight = rng.random(shape[-1]).astype(np.float32)
    with paddle.no_grad():
        got = native_ops.add_rms_norm(
            paddle.to_tensor(x), paddle.to_tensor(delta), paddle.to_tensor(weight), 1e-5
        )
    assert got is not None
    s = x + delta
    want = s / np.sqrt((s.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * weight
    np.testing.assert_array_equal(got[1].numpy(), s)  # the residual sum, exactly
    np.testing.assert_allclose(got[0].numpy(), want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 576), (9, 576), (2, 7)])
def test_rms_norm_without_a_delta(shape: tuple[int, ...]) -> None:
    """No delta (the MTP pass's input norms): the norm of ``x`` alone, "summed" is ``x``,
    and it is the with-delta kernel's result for a zero delta, bit for bit."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(np.float32)
    weight = rng.random(shape[-1]).astype(np.float32)
    with paddle.no_grad():
        got = native_ops.add_rms_norm(paddle.to_tensor(x), None, paddle.to_tensor(weight), 1e-5)
        zero = native_ops.add_rms_norm(
            paddle.to_tensor(x), paddle.zeros(list(shape)), paddle.to_tensor(weight), 1e-5
        )
    assert got is not None and zero is not None
    np.testing.assert_array_equal(got[1].numpy(), x)
    np.testing.assert_array_equal(got[0].numpy(), zero[0].numpy())
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * weight
    np.testing.assert_allclose(got[0].numpy(), want, rtol=2e-6, atol=1e-6)


def test_bound_layers_are_kept_per_cache_and_rebound_on_new_weights() -> None:
    """The layer op's arguments are bound once per cache and layer run, and bound anew
    when the layers' packed inputs change (weights packed again)."""
    from spectrio.models import PackedBatch, PagedKVCache, load

    model = load("bundled", serving=True).model
    cfg = model.config
    cache = PagedKVCache(
        cfg.num_hidden_layers, 4, 16, cfg.num_key_value_heads, cfg.head_dim, model.dtype
    )
    batch = PackedBatch.from_sequences([[5, 6, 7]], [0], [np.array([1])])
    with paddle.no_grad():
        first = model.forward(batch, cache).logits.numpy()
        bound = cache.bound_layers[cfg.num_hidden_layers]
        again = model.forward(batch, cache).logits.numpy()
    assert cache.bound_layers[cfg.num_hidden_layers] is bound
    np.testing.assert_array_equal(first, again)
    layers = model._decoder_layers()
    stale = layers[0]._native_inputs
    layers[0]._native_inputs = stale._replace(types=tuple(stale.types))  # a new object
    with paddle.no_grad():
        third = model.forward(batch, cache).logits.numpy()
    assert cache.bound_layers[cfg.num_hidden_layers] is not bound
    np.testing.assert_array_equal(first, third)


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 97, 200])
@pytest.mark.parametrize("k, n", [(576, 960), (64, 17), (33, 100), (5, 3)])  # ragged N and K
def test_panel_matmul_equals_the_matmul(rows: int, k: int, n: int) -> None:
    """Every row count a tile can take (1-6, several tiles, several row blocks) and a
    last panel only partly used."""
    rng = np.random.default_rng(rows * n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    matrix = ServingMatrix(w)
    assert matrix.packed
    with paddle.no_grad():
        got = matrix.matmul(paddle.to_tensor(x))
    assert got.shape == [rows, n]
    np.testing.assert_allclose(got.numpy(), x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 7, 13])
@pytest.mark.parametrize("k, n", [(576, 960), (33, 100), (5, 3)])
def test_half_panels_multiply_by_the_rounded_weight(rows: int, k: int, n: int) -> None:
    """Float16 panels (the draft side's): the product of the float16-rounded weight,
    summed in float32; built from ``[K, N]`` or its transpose alike."""
    rng = np.random.default_rng(rows + n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    w[0, 0] = 1e-6  # a float16 subnormal
    matrix = ServingMatrix(w, half=True)
    assert matrix.packed and matrix.half
    with paddle.no_grad():
        got = matrix.matmul(paddle.to_tensor(x)).numpy()
        transposed = ServingMatrix(np.ascontiguousarray(w.T), rows=True, half=True)
        np.testing.assert_array_equal(transposed.matmul(paddle.to_tensor(x)).numpy(), got)
    want = x.astype(np.float64) @ w.astype(np.float16).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    assert np.abs(got - want).max() < np.abs(got - exact).max() / 10  # the rounded weight's
    assert not ServingMatrix(w.astype(np.float64), half=True).packed  # float64 stays plain


def test_a_row_gets_the_same_result_in_any_batch() -> None:
    """Each output is summed over K in one fixed order, whatever the rows beside it and
    the thread count: a verified row equals the same row decoded alone, bit for bit."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((576, 200)).astype(np.float32)
    x = rng.standard_normal((13, 576)).astype(np.float32)
    matrix = ServingMatrix(w)
    with paddle.no_grad():
        whole = matrix.matmul(paddle.to_tensor(x)).numpy()
        for row in (0, 5, 12):
            alone = matrix.matmul(paddle.to_tensor(x[row : row + 1])).numpy()
            np.testing.assert_array_equal(alone[0], whole[row])


@pytest.mark.parametrize("k, n", [(3, 20), (576, 960), (7, 16), (5, 1)])
def test_the_native_packing_is_the_layout(k: int, n: int) -> None:
    """The runtime packs with the kernel; from ``[K, N]``, from its transpose (a tied
    embedding as the head) and from a NumPy array, it equals :func:`pack_panels`."""
    rng = np.random.default_rng(n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    want = pack_panels(w)
    with paddle.no_grad():
        np.testing.assert_array_equal(native_ops.pack_panels(paddle.to_tensor(w)).numpy(), want)
        rows = paddle.to_tensor(np.ascontiguousarray(w.T))
        np.testing.assert_array_equal(native_ops.pack_panels(rows, rows=True).numpy(), want)
    for matrix in (ServingMatrix(w), ServingMatrix(np.ascontiguousarray(w.T), rows=True)):
        assert matrix.shape == (k, n)
        x = rng.standard_normal((3, k)).astype(np.float32)
        with paddle.no_grad():
            got = matrix.matmul(paddle.to_tensor(x)).numpy()
        np.testing.assert_allclose(got, x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)


def test_pack_panels_layout() -> None:
    w = np.arange(3 * 20, dtype=np.float32).reshape(3, 20)
    panels = pack_panels(w)
    assert panels.shape == (2, 3, PANEL)
    np.testing.assert_array_equal(panels[0], w[:, :16])
    np.testing.assert_array_equal(panels[1, :, :4], w[:, 16:])
    assert not panels[1, :, 4:].any()  # the last panel is zero-padded


def test_not_for_float64_or_autograd() -> None:
    x = paddle.ones([2, 8], dtype="float64")
    with paddle.no_grad():
        assert native_ops.add_rms_norm(x, x, paddle.ones([8], dtype="float64"), 1e-6) is None
    y = paddle.ones([2, 8])
    panels = paddle.to_tensor(pack_panels(np.ones((8, 4), np.float32)))
    assert native_ops.panel_matmul(y, panels, 4) is None  # grad enabled


def test_off_switch_and_the_same_greedy_tokens_either_way() -> None:
    """SPECTRIO_NATIVE_OPS=0 runs the Python path; the bundled model's greedy tokens are
    the same with the kernels and without."""
    code = (
        "import json, trio\n"
        "from spectrio import RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime\n"
        "from spectrio.models.ops import native_ops\n"
        "async def main():\n"
        "    cfg = RuntimeConfig(speculative=SpeculativeConfig(num_speculative_tokens=2))\n"
        "    out = []\n"
        "    async with open_runtime(cfg) as rt:\n"
        "        p = SamplingParams(max_tokens=24, ignore_eos=True)\n"
        "        async for d in rt.generate('def fib(n):', p):\n"
        "            out += d.token_ids\n"
        "    print(json.dumps([native_ops.native_ops_available(), out]))\n"
        "trio.run(main)\n"
    )
    runs = {}
    for setting in ("on", "0"):
        env = dict(os.environ)
        if setting == "0":
            env["SPECTRIO_NATIVE_OPS"] = "0"
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[setting] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert runs["on"][0] is True and runs["0"][0] is False
    assert runs["on"][1] == runs["0"][1] and len(runs["on"][1]) == 24
