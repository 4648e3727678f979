"""Paged KV block manager: growth, failure without partial allocation, freeing, invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spectrio.stages.planning.block_manager import BlockManager, BlockManagerError, OutOfBlocks


def test_starts_all_free() -> None:
    bm = BlockManager(8, 4)
    assert bm.num_blocks == 8 and bm.block_size == 4
    assert bm.num_free_blocks == 8
    assert bm.num_used_blocks == 0
    bm.check_invariants()


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 4), (True, 4)])
def test_bad_sizes(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


def test_growth_across_block_boundaries() -> None:
    bm = BlockManager(10, 4)
    assert bm.allocate("a", 1) == [0]
    assert bm.allocate("a", 4) == []  # still fits in block 0
    assert bm.block_table("a") == [0]
    assert bm.allocate("a", 5) == [1]  # crosses into a second block
    assert bm.allocate("a", 8) == []
    assert bm.allocate("a", 9) == [2]
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.capacity("a") == 12
    assert bm.allocate("a", 3) == []  # never shrinks
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.allocate("a", 20) == [3, 4]  # several blocks at once
    assert bm.num_used_blocks == 5
    assert bm.num_free_blocks == 5
    bm.check_invariants()


def test_blocks_needed_and_can_allocate() -> None:
    bm = BlockManager(4, 16)
    assert bm.blocks_needed("x", 0) == 0
    assert bm.blocks_needed("x", 1) == 1
    assert bm.blocks_needed("x", 16) == 1
    assert bm.blocks_needed("x", 17) == 2
    assert bm.can_allocate("x", 64)
    assert not bm.can_allocate("x", 65)
    bm.allocate("x", 20)
    assert bm.blocks_needed("x", 20) == 0
    assert bm.blocks_needed("x", 33) == 1
    assert bm.can_allocate("x", 64)  # 2 held + 2 free
    assert not bm.can_allocate("y", 33)  # 3 needed, 2 free
    with pytest.raises(ValueError):
        bm.blocks_needed("x", -1)


def test_interleaved_sequences_get_lowest_ids() -> None:
    bm = BlockManager(8, 2)
    bm.allocate(1, 2)
    bm.allocate(2, 2)
    bm.allocate(1, 4)
    assert bm.block_table(1) == [0, 2]
    assert bm.block_table(2) == [1]
    assert bm.free(1) == 2
    assert bm.allocate(3, 6) == [0, 2, 3]  # freed ids come back lowest first
    bm.check_invariants()


def test_no_partial_allocation_on_failure() -> None:
    bm = BlockManager(5, 4)
    bm.allocate("a", 12)  # 3 blocks
    before_table = bm.block_table("a")
    with pytest.raises(OutOfBlocks) as info:
        bm.allocate("a", 24)  # needs 3 more, 2 free
    assert info.value.needed == 3
    assert info.value.available == 2
    assert info.value.seq_id == "a"
    assert bm.block_table("a") == before_table
    assert bm.num_free_blocks == 2
    with pytest.raises(OutOfBlocks):
        bm.allocate("b", 9)  # needs 3
    assert "b" not in bm  # a failed first allocation does not register the sequence
    assert bm.num_free_blocks == 2
    bm.check_invariants()
    assert bm.allocate("b", 8) == [3, 4]  # exactly what is left
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_free_returns_all_blocks_and_is_idempotent() -> None:
    bm = BlockManager(6, 3)
    bm.allocate("a", 7)
    bm.allocate("b", 4)
    assert bm.num_used_blocks == 5
    assert bm.free("a") == 3
    assert bm.free("a") == 0
    assert bm.free("never") == 0
    assert "a" not in bm
    with pytest.raises(KeyError):
        bm.block_table("a")
    assert bm.free("b") == 2
    assert bm.num_free_blocks == 6
    assert bm.num_used_blocks == 0
    assert list(bm.seq_ids()) == []
    bm.check_invariants()


def test_slots() -> None:
    bm = BlockManager(6, 4)
    bm.allocate("pad", 4)  # block 0
    bm.allocate("s", 6)  # blocks 1, 2
    assert bm.slot("s", 0) == 4
    assert bm.slot("s", 3) == 7
    assert bm.slot("s", 4) == 8
    assert bm.slots("s", 2, 6) == [6, 7, 8, 9]
    assert bm.slot("s", 7) == 11
    with pytest.raises(IndexError):
        bm.slot("s", 8)
    with pytest.raises(IndexError):
        bm.slot("s", -1)


def test_check_invariants_detects_corruption() -> None:
    bm = BlockManager(4, 2)
    bm.allocate("a", 4)
    bm.allocate("b", 2)
    bm._tables["b"].append(0)  # double-owned
    with pytest.raises(BlockManagerError, match="owned by both"):
        bm.check_invariants()

    bm = BlockManager(4, 2)
    bm.allocate("a", 2)
    bm._tables["a"].clear()  # block 0 lost
    with pytest.raises(BlockManagerError, match="neither free nor owned"):
        bm.check_invariants()

    bm = BlockManager(4, 2)
    bm.allocate("a", 2)
    bm._free.append(0)  # free and owned
    with pytest.raises(BlockManagerError):
        bm.check_invariants()


def test_two_instances_are_independent() -> None:
    target, mtp = BlockManager(4, 4), BlockManager(4, 4)
    target.allocate(7, 10)
    assert mtp.num_free_blocks == 4
    mtp.allocate(7, 3)
    assert target.block_table(7) == [0, 1, 2]
    assert mtp.block_table(7) == [0]


# --------------------------------------------------------------- property test

_op = st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 5), st.integers(0, 40)),
    st.tuples(st.just("free"), st.integers(0, 5), st.just(0)),
)


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(1, 12),
    block_size=st.integers(1, 5),
    ops=st.lists(_op, max_size=60),
)
def test_random_ops_keep_invariants(
    num_blocks: int, block_size: int, ops: list[tuple[str, int, int]]
) -> None:
    bm = BlockManager(num_blocks, block_size)
    model: dict[int, int] = {}  # seq -> blocks held, the reference model
    for kind, seq, tokens in ops:
        if kind == "alloc":
            want = -(-tokens // block_size)
            needed = max(0, want - model.get(seq, 0))
            free_before = bm.num_free_blocks
            table_before = bm.block_table(seq) if seq in bm else []
            assert bm.blocks_needed(seq, tokens) == needed
            assert bm.can_allocate(seq, tokens) == (needed <= free_before)
            if needed <= free_before:
                new = bm.allocate(seq, tokens)
                assert len(new) == needed
                assert new == sorted(new)
                model[seq] = model.get(seq, 0) + needed
                assert bm.block_table(seq) == table_before + new
                assert bm.capacity(seq) >= tokens
            else:
                with pytest.raises(OutOfBlocks):
                    bm.allocate(seq, tokens)
                assert bm.num_free_blocks == free_before
                assert (bm.block_table(seq) if seq in bm else []) == table_before
        else:
            assert bm.free(seq) == model.pop(seq, 0)
            assert seq not in bm
        bm.check_invariants()
        assert bm.num_used_blocks == sum(model.values())
        assert bm.num_free_blocks == num_blocks - sum(model.values())
    for seq in list(model):
        bm.free(seq)
    assert bm.num_free_blocks == num_blocks
    bm.check_invariants()
