"""Step record: hand-worked layouts of the NumPy reference, header packing, unpack."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest

from spectrio.core.record import (
    KIND_DRAFT,
    KIND_TARGET,
    PREEMPTED,
    RECORD_VERSION,
    RecordError,
    pack_header,
    record_nbytes,
    record_width,
    unpack,
    unpack_header,
)
from spectrio.cuda_kernels.reference import pack_step_record, pack_topk_ref, speculate_save_ref

# Five slots, k = 2 (3 columns):
#   0: decoding, emits 3 tokens
#   1: preempted this step (its count is ignored)   -> -9
#   2: chunked prefill in progress (4 < 10)         -> 0
#   3: stopped, emits nothing                       -> 0
#   4: decoding, emits 1 token
TOKENS = np.array(
    [[10, 11, 12], [20, 21, 22], [30, 31, 32], [0, 0, 0], [40, 41, 42]], dtype=np.int64
)
COUNTS = np.array([3, 2, 1, 0, 1], dtype=np.int32)
PREEMPTED_FLAGS = np.array([False, True, False, False, False])
SEQ_LENS_DECODER = np.array([50, 7, 4, 9, 12], dtype=np.int32)
PROMPT_LENS = np.array([8, 7, 10, 9, 3], dtype=np.int64)
HEAD_WORDS = [RECORD_VERSION, KIND_TARGET, 5, 4, 3, -9, 0, 0, 1, 10, 11, 12, 40]


def head(kind: int = KIND_TARGET, width: int = 0) -> np.ndarray:
    return speculate_save_ref(
        TOKENS, COUNTS, PREEMPTED_FLAGS, SEQ_LENS_DECODER, PROMPT_LENS, kind, width
    )


def record(**kw: Any) -> bytes:
    return pack_step_record(TOKENS, COUNTS, PREEMPTED_FLAGS, SEQ_LENS_DECODER, PROMPT_LENS, **kw)


def topk_inputs(num_tokens: int, w_max: int = 21) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t = np.arange(num_tokens)[:, None]
    c = np.arange(w_max)[None, :]
    ids = (100 * t + c).astype(np.int32)
    vals = (-(t + 1) - c / 64).astype(np.float32)  # exactly representable
    ranks = np.arange(1, num_tokens + 1, dtype=np.int32)
    return ids, vals, ranks


# ------------------------------------------------------------------- header


def test_header_packs_kind_low_byte_and_width_above() -> None:
    h = pack_header(KIND_DRAFT, 21, 7, 9)
    assert h.dtype == np.dtype("<i4")
    assert h.tolist() == [RECORD_VERSION, 4 | (21 << 8), 7, 9]
    assert h[1] == 5380
    assert unpack_header(int(h[1])) == (KIND_DRAFT, 21)
    assert unpack_header(KIND_TARGET) == (KIND_TARGET, 0)
    assert pack_header(255, 0, 0, 0)[1] == 255


@pytest.mark.parametrize("kind", [256, 1000, -1])
def test_header_rejects_kind_outside_8_bits(kind: int) -> None:
    with pytest.raises(ValueError, match="8 bits"):
        pack_header(kind, 0, 1, 1)
    with pytest.raises(ValueError, match="8 bits"):
        head(kind=kind)


def test_record_width() -> None:
    assert record_width(None) == 0
    assert record_width(np.array([-1, -1])) == 0
    assert record_width(np.array([], dtype=np.int32)) == 0
    assert record_width(np.array([-1, 0])) == 1
    assert record_width(np.array([3, -1, 20])) == 21


# ----------------------------------------------------------- speculate_save


def test_speculate_save_hand_worked() -> None:
    out = head()
    assert out.dtype == np.dtype("<i4")
    assert out.tolist() == HEAD_WORDS


def test_width_zero_record_is_exactly_the_head() -> None:
    expected = struct.pack("<13i", *HEAD_WORDS)
    assert record() == expected
    assert record(logprobs=np.full(5, -1)) == expected
    assert record_nbytes(5, 4, 0) == len(expected) == 52


def test_draft_kind_and_header_width() -> None:
    out = head(kind=KIND_DRAFT, width=6)
    assert out[1] == KIND_DRAFT | (6 << 8)
    assert out[2:].tolist() == HEAD_WORDS[2:]


def test_all_slots_silent() -> None:
    out = speculate_save_ref(
        np.zeros((3, 4), dtype=np.int32),
        np.array([0, 4, 2], dtype=np.int32),
        np.array([True, True, False]),
        np.array([0, 0, 1], dtype=np.int32),
        np.array([0, 0, 5], dtype=np.int32),
        KIND_TARGET,
    )
    assert out.tolist() == [RECORD_VERSION, KIND_TARGET, 3, 0, PREEMPTED, PREEMPTED, 0]


def test_empty_batch() -> None:
    e = np.zeros(0, dtype=np.int32)
    out = speculate_save_ref(np.zeros((0, 3), dtype=np.int32), e, e.astype(bool), e, e, 3)
    assert out.tolist() == [RECORD_VERSION, KIND_TARGET, 0, 0]


def test_speculate_save_rejects_bad_counts_and_shapes() -> None:
    with pytest.raises(ValueError, match="accept_counts"):
        speculate_save_ref(TOKENS, COUNTS + 1, PREEMPTED_FLAGS, SEQ_LENS_DECODER, PROMPT_LENS, 3)
    with pytest.raises(ValueError, match="shape"):
        speculate_save_ref(TOKENS, COUNTS[:4], PREEMPTED_FLAGS, SEQ_LENS_DECODER, PROMPT_LENS, 3)


# ---------------------------------------------------------------- pack_topk


def test_pack_topk_mixed_widths() -> None:
    # Emitting tokens: slot 0 x3 (asked top-2), slot 4 x1 (asked logprobs=0).
    # Slot 2 (in prefill) asked top-5, so the record is 1 + 5 = 6 wide.
    ids, vals, ranks = topk_inputs(4)
    logprobs = np.array([2, -1, 5, -1, 0])
    buf = record(logprobs=logprobs, topk_ids=ids, topk_vals=vals, ranks=ranks)
    assert len(buf) == record_nbytes(5, 4, 6) == 4 * (13 + 2 * 4 * 6 + 4)

    rec = unpack(buf)
    assert (rec.kind, rec.width, rec.bsz, rec.num_tokens) == (KIND_TARGET, 6, 5, 4)
    assert rec.lp_ids is not None and rec.lp_vals is not None and rec.ranks is not None
    np.testing.assert_array_equal(
        rec.lp_ids,
        [
            [0, 1, 2, -1, -1, -1],
            [100, 101, 102, -1, -1, -1],
            [200, 201, 202, -1, -1, -1],
            [300, -1, -1, -1, -1, -1],
        ],
    )
    expected_vals = np.where(rec.lp_ids >= 0, vals[:, :6], 0.0).astype(np.float32)
    assert rec.lp_vals.tobytes() == expected_vals.tobytes()
    assert rec.lp_vals[0, 0] == -1.0 and rec.lp_vals[1, 2] == -2.0 - 2 / 64
    np.testing.assert_array_equal(rec.ranks, [1, 2, 3, 4])


def test_pack_topk_width_21_and_slot_without_logprobs() -> None:
    tokens = np.array([[5, 6, 7], [8, 9, 0]], dtype=np.int32)
    ids, vals, ranks = topk_inputs(3)
    buf = pack_step_record(
        tokens,
        np.array([2, 1]),
        np.array([False, False]),
        np.array([3, 3]),
        np.array([1, 1]),
        kind=KIND_TARGET,
        logprobs=np.array([20, -1]),
        topk_ids=ids,
        topk_vals=vals,
        ranks=ranks,
    )
    rec = unpack(buf)
    assert rec.width == 21
    assert rec.lp_ids is not None and rec.lp_vals is not None and rec.ranks is not None
    assert rec.lp_ids.shape == (3, 21)
    np.testing.assert_array_equal(rec.lp_ids[:2], ids[:2])
    np.testing.assert_array_equal(rec.lp_vals[:2], vals[:2])
    np.testing.assert_array_equal(rec.lp_ids[2], np.full(21, -1))
    assert rec.lp_vals[2].tobytes() == np.zeros(21, dtype=np.float32).tobytes()
    np.testing.assert_array_equal(rec.ranks, [1, 2, -1])
    np.testing.assert_array_equal(rec.token_ids, [5, 6, 8])


def test_pack_topk_ref_only_reads_width_columns() -> None:
    ids, vals, ranks = topk_inputs(2, w_max=21)
    lp_ids, lp_vals, out_ranks = pack_topk_ref(ids, vals, ranks, np.array([0, 0]), 1)
    assert lp_ids.shape == lp_vals.shape == (2, 1)
    assert lp_ids.dtype == np.dtype("<i4") and lp_vals.dtype == np.dtype("<f4")
    np.testing.assert_array_equal(lp_ids[:, 0], [0, 100])
    np.testing.assert_array_equal(out_ranks, [1, 2])


def test_pack_topk_ref_validation() -> None:
    ids, vals, ranks = topk_inputs(2, w_max=4)
    with pytest.raises(ValueError, match="narrower"):
        pack_topk_ref(ids, vals, ranks, np.array([3, 1]), 3)
    with pytest.raises(ValueError, match="width"):
        pack_topk_ref(ids, vals, ranks, np.array([0, 0]), 5)
    with pytest.raises(ValueError, match="required"):
        record(logprobs=np.array([1, -1, -1, -1, -1]))
    with pytest.raises(ValueError, match="rows"):
        i3, v3, r3 = topk_inputs(3)
        record(logprobs=np.array([0, 0, 0, 0, 0]), topk_ids=i3, topk_vals=v3, ranks=r3)


# ------------------------------------------------------------------- unpack


def test_unpack_hand_worked_head() -> None:
    rec = unpack(record())
    assert (rec.version, rec.kind, rec.width, rec.bsz, rec.num_tokens) == (1, 3, 0, 5, 4)
    np.testing.assert_array_equal(rec.accept_num, [3, -9, 0, 0, 1])
    np.testing.assert_array_equal(rec.token_ids, [10, 11, 12, 40])
    np.testing.assert_array_equal(rec.offsets, [0, 3, 3, 3, 3, 4])
    np.testing.assert_array_equal(rec.preempted, [False, True, False, False, False])
    np.testing.assert_array_equal(rec.slot_of_token, [0, 0, 0, 4])
    assert rec.lp_ids is None and rec.lp_vals is None and rec.ranks is None


def test_unpack_returns_views_not_copies() -> None:
    ids, vals, ranks = topk_inputs(4)
    lp = np.array([1, 0, 0, 0, 0])
    buf = bytearray(record(logprobs=lp, topk_ids=ids, topk_vals=vals, ranks=ranks))
    rec = unpack(buf)
    assert rec.lp_vals is not None
    backing = np.frombuffer(buf, dtype=np.uint8)
    for arr in (rec.accept_num, rec.token_ids, rec.lp_ids, rec.lp_vals, rec.ranks):
        assert np.shares_memory(arr, backing)
    assert not unpack(bytes(buf)).token_ids.flags.writeable
    # An int32 array (e.g. speculate_save_ref's output) unpacks too.
    assert unpack(head()).token_ids.tolist() == [10, 11, 12, 40]


def test_unpack_round_trip_random() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        bsz = int(rng.integers(0, 40))
        cols = int(rng.integers(1, 7))
        tokens = rng.integers(0, 50_000, size=(bsz, cols)).astype(np.int32)
        counts = rng.integers(0, cols + 1, size=bsz).astype(np.int32)
        pre = rng.random(bsz) < 0.15
        plen = rng.integers(1, 100, size=bsz).astype(np.int32)
        dec = np.where(rng.random(bsz) < 0.2, plen - 1, plen + 5).astype(np.int32)
        logprobs = np.where(rng.random(bsz) < 0.5, rng.integers(0, 21, size=bsz), -1)
        accept = np.where(pre, -9, np.where(dec < plen, 0, counts))
        n = int(np.maximum(accept, 0).sum())
        ids = rng.integers(0, 50_000, size=(n, 21)).astype(np.int32)
        vals = -rng.random((n, 21)).astype(np.float32)
        ranks = rng.integers(1, 100, size=n).astype(np.int32)
        kind = KIND_DRAFT if rng.random() < 0.5 else KIND_TARGET
        buf = pack_step_record(
            tokens,
            counts,
            pre,
            dec,
            plen,
            kind=kind,
            logprobs=logprobs,
            topk_ids=ids,
            topk_vals=vals,
            ranks=ranks,
        )
        rec = unpack(buf)
        width = record_width(logprobs)
        assert (rec.kind, rec.width, rec.bsz, rec.num_tokens) == (kind, width, bsz, n)
        assert len(buf) == record_nbytes(bsz, n, width)
        np.testing.assert_array_equal(rec.accept_num, accept)
        emit = np.arange(cols)[None, :] < np.maximum(accept, 0)[:, None]
        np.testing.assert_array_equal(rec.token_ids, tokens[emit])
        if width:
            assert rec.lp_ids is not None and rec.lp_vals is not None and rec.ranks is not None
            topn = logprobs[rec.slot_of_token]
            want = np.arange(width)[None, :] <= topn[:, None]
            np.testing.assert_array_equal(rec.lp_ids, np.where(want, ids[:, :width], -1))
            np.testing.assert_array_equal(rec.lp_vals, np.where(want, vals[:, :width], 0.0))
            np.testing.assert_array_equal(rec.ranks, np.where(topn >= 0, ranks, -1))
        else:
            assert rec.lp_ids is None


def test_unpack_rejects_malformed_records() -> None:
    good = record()
    with pytest.raises(RecordError, match="bytes"):
        unpack(good[:-4])
    with pytest.raises(RecordError, match="whole number"):
        unpack(good[:-1])
    with pytest.raises(RecordError, match="version"):
        unpack(struct.pack("<i", 99) + good[4:])
    bad = bytearray(good)
    bad[16:20] = struct.pack("<i", 2)  # accept_num[0] 3 -> 2, num_tokens still 4
    with pytest.raises(RecordError, match="sum"):
        unpack(bytes(bad))
    assert issubclass(RecordError, ValueError)


def test_the_moved_packer_keeps_its_old_name_with_a_warning() -> None:
    from spectrio.core import record

    with pytest.warns(DeprecationWarning, match="spectrio.cuda_kernels.reference"):
        assert record.pack_step_record is pack_step_record
    with pytest.raises(AttributeError):
        record.no_such_name  # noqa: B018 - the attribute access is the test
