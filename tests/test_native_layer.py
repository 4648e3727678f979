"""The native decoder layer (``models/ops/csrc/spectrio_layer.cc``, issue 57): each
architecture's float32 serving forward and the MTP pass through it against the op-by-op
Paddle path, batch invariance (a row's logits are bit-identical whatever shares its step,
however many rows and threads), and its addressing errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import paddle
import pytest

from spectrio.models import LoadedModel, PackedBatch, PagedKVCache, load
from spectrio.models.ops import native_ops
from spectrio.models.ops.paddle_setup import configure_paddle, configured_threads

pytestmark = pytest.mark.skipif(
    not native_ops.native_ops_available(), reason="spectrio's native kernels do not build here"
)

ARCHS = Path(__file__).resolve().parent / "data" / "archs"
CASES = sorted(p.name for p in ARCHS.iterdir() if p.is_dir())


@pytest.fixture
def threads() -> Iterator[None]:
    """Restore the process's thread count after a test that changes it."""
    before = configured_threads()
    yield
    configure_paddle(before or 1)


def _cache(loaded: LoadedModel, blocks: int = 32, block: int = 4) -> PagedKVCache:
    cfg = loaded.config
    return PagedKVCache(
        cfg.num_hidden_layers, blocks, block, cfg.num_key_value_heads, cfg.head_dim, "float32"
    )


def _steps(loaded: LoadedModel, native: bool) -> list[np.ndarray]:
    """Logits of a mixed prefill, a decode step of two sequences, and a step mixing a
    verification (4 rows), a decode row and a new prefill chunk."""
    model = loaded.model
    model.native_layers = native
    cache = _cache(loaded)
    vocab = loaded.config.vocab_size
    rng = np.random.default_rng(7)
    a, b, c = (rng.integers(0, vocab, n).tolist() for n in (13, 6, 11))
    ta, tb, tc = np.arange(0, 8), np.arange(8, 16), np.arange(16, 24)
    out = []
    with paddle.no_grad():
        out.append(model.forward(PackedBatch.from_sequences([a, b], [0, 0], [ta, tb]), cache))
        out.append(model.forward(PackedBatch.from_sequences([[3], [4]], [13, 6], [ta, tb]), cache))
        mixed = PackedBatch.from_sequences([[1, 2, 3, 4], [5], c], [14, 7, 0], [ta, tb, tc])
        out.append(model.forward(mixed, cache))
    return [o.logits.numpy() for o in out]


@pytest.mark.parametrize("name", CASES)
def test_every_architecture_runs_the_layer_op_as_the_paddle_path(name: str) -> None:
    loaded = load(ARCHS / name, dtype="float32")
    layers = list(loaded.model.model.layers)
    assert all(layer.native_ready() for layer in layers), name
    want, got = _steps(loaded, native=False), _steps(loaded, native=True)
    for w, g in zip(want, got, strict=True):
        scale = float(np.abs(w).max())
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-5 * max(scale, 1.0), err_msg=name)


@pytest.mark.parametrize("name", CASES)
def test_a_run_of_layers_in_one_op_is_the_layers_op_by_op_bit_for_bit(name: str) -> None:
    """``spectrio_decoder_layers`` (every layer of a pass in one op) against the two ops
    per layer that a tensor-parallel shard runs, with its layers told so: the same bits,
    as the same team functions run in the same order."""
    loaded = load(ARCHS / name, dtype="float32")
    layers = list(loaded.model.model.layers)
    one_op = _steps(loaded, native=True)
    try:
        for layer in layers:
            layer.partial_sums = True  # as a shard's layers: two ops per layer
        by_layer = _steps(loaded, native=True)
    finally:
        for layer in layers:
            del layer.partial_sums
    for w, g in zip(by_layer, one_op, strict=True):
        np.testing.assert_array_equal(g, w, err_msg=name)


def test_the_run_op_checks_its_lists(bundled: LoadedModel) -> None:
    """Lists of different lengths are refused, naming the rule, before any pool is
    written."""
    model, cfg = bundled.model, bundled.config
    cache = _cache(bundled, blocks=4)
    layers = model._decoder_layers()[: cfg.num_hidden_layers]
    inputs = [layer.native_inputs() for layer in layers]
    rows = (
        paddle.to_tensor(np.array([0], np.int64)),
        paddle.to_tensor(np.array([0], np.int64)),
        paddle.to_tensor(np.array([[1]], np.int64)),
    )
    rope = model._rope_tables(np.arange(1))
    x = paddle.randn([1, cfg.hidden_size])
    with paddle.no_grad():
        before = cache.pools(0)[0].numpy().copy()
        short = [cache.pools(i) for i in range(len(layers) - 1)]
        with pytest.raises(Exception, match="every list has one entry per layer"):
            native_ops.decoder_layers(x, inputs, short, rope, rows, cache.block_size)  # type: ignore[arg-type]
        np.testing.assert_array_equal(cache.pools(0)[0].numpy(), before)
        pools = [cache.pools(i) for i in range(len(layers))]
        native_ops.decoder_layers(x, inputs, pools, rope, rows, cache.block_size)  # type: ignore[arg-type]
        assert not np.array_equal(cache.pools(0)[0].numpy(), before)


def test_the_mtp_pass_runs_the_layer_op_as_the_paddle_path(bundled: LoadedModel) -> None:
    model = bundled.model
    assert model.mtp is not None and model.mtp.native_ready()
    vocab = bundled.config.vocab_size
    ids = np.random.default_rng(3).integers(0, vocab, 9).tolist()
    hidden = paddle.randn([9, bundled.config.hidden_size])
    results = []
    try:
        for native in (False, True):
            model.native_layers = native
            cfg = bundled.config
            cache = PagedKVCache(1, 8, 4, cfg.num_key_value_heads, cfg.head_dim, "float32")
            with paddle.no_grad():
                first = model.mtp_forward(
                    PackedBatch.from_sequences([ids], [0], [np.arange(4)]), hidden, cache
                )
                nxt = model.mtp_forward(
                    PackedBatch.from_sequences([[ids[-1]]], [9], [np.arange(4)]),
                    first.hidden[-1:], cache,
                )  # fmt: skip
            results.append([first.logits.numpy(), first.hidden.numpy(), nxt.logits.numpy()])
    finally:
        model.native_layers = True
    for w, g in zip(*results, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-5 * max(float(np.abs(w).max()), 1.0))


def _rows_of_a(loaded: LoadedModel, others: list[list[int]], threads_: int) -> np.ndarray:
    """Sequence A's logits (a 9-token prefill, then a 3-row verification) computed beside
    ``others`` (each a prefill in the same steps), on ``threads_`` threads."""
    configure_paddle(threads_)
    model = loaded.model
    cache = _cache(loaded, blocks=256)
    a = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    tables = [np.arange(12 * i, 12 * i + 12) for i in range(len(others) + 1)]
    logits = []
    with paddle.no_grad():
        first = PackedBatch.from_sequences([a, *others], [0] * (len(others) + 1), tables)
        logits.append(model.forward(first, cache).logits.numpy()[: len(a)])
        verify = PackedBatch.from_sequences(
            [[20, 21, 22], *[[7] for _ in others]],
            [len(a), *[len(o) for o in others]],
            tables,
        )
        logits.append(model.forward(verify, cache).logits.numpy()[:3])
    return np.concatenate(logits)


def test_a_rows_logits_do_not_depend_on_its_step(bundled: LoadedModel, threads: None) -> None:
    """Batch invariance, bit for bit: alone on one thread, beside one short sequence, and
    beside 17 sequences of odd lengths (up to a 40-row chunk, past the 6-row tiles and
    the 96-row blocks of the panel kernel) on two threads."""
    assert bundled.model.native_layers
    alone = _rows_of_a(bundled, [], 1)
    rng = np.random.default_rng(5)
    crowd = [rng.integers(0, 4000, n).tolist() for n in [1, 40, 3, *range(2, 16)]]
    for others, n in (([[5, 6]], 2), (crowd, 2), (crowd, 1), ([], 2)):
        np.testing.assert_array_equal(_rows_of_a(bundled, others, n), alone)


def test_a_block_table_too_short_is_refused_naming_the_position(bundled: LoadedModel) -> None:
    cache = _cache(bundled)
    batch = PackedBatch.from_sequences([[1] * 9], [0], [np.arange(2)])  # 2 blocks of 4
    with paddle.no_grad(), pytest.raises(ValueError, match="cannot hold position 8"):
        bundled.model.forward(batch, cache)


def test_the_op_checks_its_addressing(bundled: LoadedModel) -> None:
    """The op itself refuses what the Python side would never send: a block id past the
    pool, a row naming a missing sequence. It raises before touching the pools."""
    layer = bundled.model.model.layers[0]
    attn = layer.self_attn
    cfg = bundled.config
    cache = _cache(bundled, blocks=4)
    rope = bundled.model._rope_tables(np.arange(8))
    x = paddle.randn([2, cfg.hidden_size])

    def call(row_seq: list[int], table: list[int]) -> None:
        rows = (
            paddle.to_tensor(np.array([0, 1], np.int64)),
            paddle.to_tensor(np.array(row_seq, np.int64)),
            paddle.to_tensor(np.array([table], np.int64)),
        )
        assert attn._qkv_weight is not None and attn._o_weight is not None
        native_ops.attention_block(
            x, None, None, attn._qkv_weight.panels, attn._qkv_bias, attn._qk_norm_weight,
            rope, cache.pools(0), attn._o_weight.panels, rows,
            (attn.num_heads, attn.num_kv_heads, attn.head_dim, cache.block_size), 1e-5,
        )  # fmt: skip

    with paddle.no_grad():
        before = cache.pools(0)[0].numpy().copy()
        with pytest.raises(Exception, match="names block 9 of 4"):
            call([0, 0], [9])
        with pytest.raises(Exception, match="names sequence 1 of 1"):
            call([0, 1], [0])
        np.testing.assert_array_equal(cache.pools(0)[0].numpy(), before)
        call([0, 0], [1])  # a valid call runs
