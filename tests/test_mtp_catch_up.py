"""The MTP proposer's deferred catch-up: when a step may skip the MTP layer, and the
hidden rows it keeps across the steps it skipped (pure rules and the store)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny_model

from spectrio import SamplingParams
from spectrio.core.messages import SeqWork
from spectrio.models.ops.paddle_setup import paddle
from spectrio.stages.device.draft.mtp import CatchUp, HiddenStore


def _work(start: int, drafts: int, prompt: int, output: int) -> SeqWork:
    return SeqWork(
        slot=0,
        seq_id=1,
        request_id="r",
        block_table=[0],
        start_pos=start,
        token_ids=[5],
        sample=True,
        num_drafts=drafts,
        eos_token_ids=[],
        max_new_tokens=10,
        params=SamplingParams(),
        num_output=output,
        context_len=prompt + output,
        speculative=True,
    )


def test_a_step_defers_only_past_a_caught_up_prompt_within_the_lag() -> None:
    cu = CatchUp()
    tokens = list(range(40))
    prompt = 10
    assert not cu.may_defer(_work(10, 0, prompt, 1), 8)  # never seen: its prompt is not
    cu.advance(1, 6, tokens)  # a first prompt chunk caught up to 6 (of 10)
    assert not cu.may_defer(_work(10, 0, prompt, 1), 8)  # prompt positions 6..9 lag
    cu.advance(1, 10, tokens)  # the first decode step catches the prompt up
    assert cu.may_defer(_work(11, 0, prompt, 2), 8)
    assert not cu.may_defer(_work(11, 2, prompt, 2), 8)  # drafting needs the catch-up
    assert cu.may_defer(_work(18, 0, prompt, 9), 8)
    assert not cu.may_defer(_work(19, 0, prompt, 10), 8)  # would lag 9 > 8
    first, nxt = cu.advance(1, 19, tokens)
    assert (first, nxt) == (10, tokens[11:20])  # every lagging position at once


def _step(rows: int, start: int) -> paddle.Tensor:
    """A step's hidden rows, row r holding the value ``start + r`` in every column."""
    return paddle.to_tensor(
        np.repeat(np.arange(start, start + rows, dtype=np.float64), 3).reshape(rows, 3)
    )


def test_rows_of_several_kept_steps_are_read_from_the_step_that_last_wrote_them() -> None:
    """Each verify step keeps [last token, drafts...] rows; the next one starts after its
    accepted drafts, so rejected rows are superseded. A deferred catch-up reads every
    position from the latest step that holds it."""
    store = HiddenStore(tiny_model())
    # step A: positions 10..13 (3 drafts), 1 accepted -> step B starts at 12
    store.store(1, 10, _step(4, 10), 0, 4)
    store.store(1, 12, _step(8, 112), 2, 2)  # rows 2..3 of an 8-row step: positions 12..13
    store.store(1, 14, _step(1, 214), 0, 1)  # a k = 0 step: position 14
    got = store.rows_of([(1, 10, 5)]).numpy()[:, 0]
    np.testing.assert_array_equal(got, [10, 11, 114, 115, 214])
    store.drop_before(1, 12)  # caught up to 12: step A is no longer needed
    np.testing.assert_array_equal(store.rows_of([(1, 12, 3)]).numpy()[:, 0], [114, 115, 214])
    with pytest.raises(RuntimeError, match="outside stored hidden rows"):
        store.rows_of([(1, 11, 2)])
    store.store(1, 13, _step(2, 313), 0, 2)  # rewinds past position 14: the k = 0 step goes
    np.testing.assert_array_equal(store.rows_of([(1, 12, 3)]).numpy()[:, 0], [114, 313, 314])
