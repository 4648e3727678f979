"""A GGUF file served from its blocks (models/loading/block_serving.py) and read by spectrio's own
header reader (models/loading/gguf_header.py): what is served from blocks, what is widened and
said so, exact re-storing of mixed groups, tensor-parallel shares, and the header's
refusals."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import paddle
import pytest
from gguf import GGMLQuantizationType as Q
from structlog.testing import capture_logs
from test_gguf import write_gguf

from spectrio.errors import CheckpointError
from spectrio.models import PackedBatch, PagedKVCache, load
from spectrio.models.loading.block_serving import Shard, as_q8_0, plan_blocks, served_weight_bytes
from spectrio.models.loading.gguf_file import GGUFFile
from spectrio.models.loading.gguf_header import GGUFHeader, GGUFHeaderError
from spectrio.models.ops import native_ops
from spectrio.models.ops.gguf_blocks import BLOCK_TYPES, dequantize, synthetic_blocks

needs_kernels = pytest.mark.skipif(
    not native_ops.native_ops_available(), reason="the block kernels do not build here"
)


def _logits(model: object, ids: list[int]) -> np.ndarray:
    cfg = model.config  # type: ignore[attr-defined]
    cache = PagedKVCache(cfg.num_hidden_layers, 4, 16, cfg.num_key_value_heads, cfg.head_dim)
    batch = PackedBatch.from_sequences([ids], [0], [np.arange(4)])
    with paddle.no_grad():
        return model.forward(batch, cache).logits.numpy()  # type: ignore[attr-defined]


# ---- the header reader -----------------------------------------------------------------


def test_the_header_reads_what_the_gguf_package_reads(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, qtype=Q.Q8_0)
    mine, theirs = GGUFHeader(path), gguf.GGUFReader(str(path))
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):  # the package's own pseudo-fields
            assert mine.fields[key] == field.contents(), key
    assert [t.name for t in mine.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(mine.tensors, theirs.tensors, strict=True):
        assert a.ggml_type == int(b.tensor_type) and a.data.dtype == b.data.dtype
        np.testing.assert_array_equal(a.data, b.data)


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda b: b"GGUX" + b[4:], "bad magic"),
        (lambda b: b[:4] + (1).to_bytes(4, "little") + b[8:], "version 1"),
        (lambda b: b[:4] + (3).to_bytes(4, "big") + b[8:], "big-endian"),
        (lambda b: b[:200], "past the end"),
        (lambda b: b[: len(b) - 64], "runs past the end of the file"),
    ],
)
def test_a_damaged_header_is_refused_naming_why(tmp_path: Path, damage: object, words: str) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, qtype=Q.Q8_0)
    path.write_bytes(damage(path.read_bytes()))  # type: ignore[operator]
    with pytest.raises(GGUFHeaderError, match=words):
        GGUFHeader(path)
    with pytest.raises(CheckpointError, match="corrupt or unreadable GGUF file"):
        GGUFFile(path)


# ---- what is served, and how -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["Q4_0", "Q5_0"])
def test_a_narrow_group_member_is_re_stored_as_q8_0_exactly(kind: str) -> None:
    rows = synthetic_blocks(kind, 6, 64, np.random.default_rng(3))
    wide = as_q8_0(rows, kind)
    assert wide.shape == (6, BLOCK_TYPES["Q8_0"].row_bytes(64))
    np.testing.assert_array_equal(dequantize(wide, "Q8_0"), dequantize(rows, kind))


def test_a_row_parallel_share_must_be_whole_blocks() -> None:
    rows = synthetic_blocks("Q8_0", 4, 64, np.random.default_rng(0))
    left = Shard(0, 2).columns(rows, "Q8_0", 64, "o")
    assert left.shape == (4, BLOCK_TYPES["Q8_0"].row_bytes(32))
    with pytest.raises(CheckpointError, match=r"'blk.0.ffn_down.weight' \(Q8_0\).*4 tensor"):
        Shard(0, 4).columns(rows, "Q8_0", 64, "blk.0.ffn_down.weight")


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.Q5_0])
def test_a_quantized_file_serves_from_its_blocks_alone(tmp_path: Path, qtype: Q) -> None:
    """Every matrix from the file's blocks, the embedding never widened, and the logits
    those of the same weights dequantized, to the int8 rounding of the activations."""
    path = tmp_path / "tiny.gguf"
    write_gguf(path, qtype=qtype)
    widened = load(path, mtp_head=False)
    served = load(path, mtp_head=False, serving=True)
    model = served.model
    plan = plan_blocks(GGUFFile(path), served.config)
    assert not plan.widened and plan.counts() == {qtype.name: 4 * 2 + 1}
    assert not model.model.embed_tokens.weight._is_initialized()
    assert not model.model.layers[0].self_attn.q_proj.weight._is_initialized()
    ids = [3, 17, 40, 5, 60, 2, 9]
    want, got = _logits(widened.model, ids), _logits(model, ids)
    # hidden size 32: one int8 scale per activation row, the coarsest rounding there is
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()
    q8 = BLOCK_TYPES[qtype.name]
    cfg = served.config
    assert served_weight_bytes(GGUFFile(path), cfg) == (
        cfg.num_hidden_layers
        * (
            q8.row_bytes(32) * (32 + 2 * 16 + 32 + 2 * 64)  # q|k|v, o (in 32), gate|up
            + q8.row_bytes(64) * 32  # down
            + 2 * 32 * 4  # norms
        )
        + 32 * 4  # the final norm
        + 96 * q8.row_bytes(32)  # the tied head
    )


@needs_kernels
def test_a_type_without_a_kernel_is_widened_and_says_what_it_costs(tmp_path: Path) -> None:
    path = tmp_path / "tiny-f16.gguf"
    write_gguf(path, qtype=Q.F16)
    with capture_logs() as logs:
        served = load(path, mtp_head=False, serving=True)
    widened = [e for e in logs if "widened to float32" in e["event"]]
    assert {e["type"] for e in widened} == {"F16"}
    assert "model.layers.0.self_attn.q_proj.weight" in {e["tensor"] for e in widened}
    assert all(e["float32_mb"] >= 0 for e in widened)
    ids = [3, 17, 40, 5]
    np.testing.assert_allclose(
        _logits(served.model, ids), _logits(load(path, mtp_head=False).model, ids), atol=1e-5
    )
