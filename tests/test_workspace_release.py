"""Issue 9, item 4: a request's device state (stored hidden rows) is dropped when the
request finishes or is aborted, not when the next step is planned (float64, real model)."""

from __future__ import annotations

import pytest
import trio

from spectrio import RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.core.messages import StepPlan


def config(**kw: object) -> RuntimeConfig:
    fields: dict[str, object] = {
        "dtype": "float64",
        "max_model_len": 64,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 16,
        "speculative": SpeculativeConfig(num_speculative_tokens=2, adaptive=False),
    }
    fields.update(kw)
    return RuntimeConfig(**fields)  # type: ignore[arg-type]


async def test_finished_requests_leave_no_state_before_the_next_plan(bundled64: object) -> None:
    with trio.fail_after(120):
        async with open_runtime(config(), encoded_channels=True) as rt:
            ws, sched = rt.workspace, rt.scheduler
            stale: list[list[int]] = []  # ended sequences still held when a step is planned
            schedule = sched.schedule

            def checked() -> StepPlan | None:
                # Every sequence the workspace holds state for is one the scheduler runs.
                live = {s.seq_id for s in [*sched.running, *sched.waiting]}
                held = [i for i in range(1, 64) if ws.holds(i) and i not in live]
                if held:
                    stale.append(held)
                return schedule()

            sched.schedule = checked  # type: ignore[method-assign]

            async def one(prompt: str, max_tokens: int) -> None:
                async for _ in rt.generate(
                    prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
                ):
                    pass

            async with trio.open_nursery() as nursery:
                for i, n in enumerate((3, 9, 17, 30)):  # they finish in different steps
                    nursery.start_soon(one, f"def f{i}(x):", n)
            await rt.wait_idle()
            assert stale == []
            # The last request finished with no step after it: nothing is left behind.
            assert ws.num_states == 0 and rt.sampler.num_states == 0
            steps = rt.num_steps
            async for _ in rt.generate("import os", SamplingParams(max_tokens=5)):
                pass
            await rt.wait_idle()
            assert rt.num_steps > steps and ws.num_states == 0


async def test_an_aborted_requests_state_goes_with_the_next_step(bundled64: object) -> None:
    """An abort frees the request's blocks once the steps in flight that compute for it
    have returned (what they wrote of its prompt is registered in the prefix cache
    first); its device state goes at the start of the next step (the plan's
    ``released``: the device worker alone touches the workspace), which is the step that
    reports the abort; the last request aborted gets an abort-only step, so nothing is
    left behind when the runtime is idle."""
    with trio.fail_after(120):
        async with open_runtime(config(enable_overlap=True), encoded_channels=True) as rt:
            ws = rt.workspace
            streams = [
                rt.generate(list(range(40, 50)), SamplingParams(max_tokens=40)) for _ in "ab"
            ]
            seqs = [rt._requests[s.request_id].seq_id for s in streams]
            for s in streams:
                await s.__anext__()
            assert all(ws.holds(q) for q in seqs)
            used = rt.blocks.num_used_blocks
            assert await rt.abort(streams[0].request_id)
            # Steps planned before the abort may still be in flight (two with overlap) and
            # their deltas may be queued already; once they return the blocks are freed,
            # and a step planned after the abort drops the state.
            for _ in range(12):
                if not ws.holds(seqs[0]) and rt.blocks.num_used_blocks < used:
                    break
                await streams[1].__anext__()
            assert rt.blocks.num_used_blocks < used
            assert not ws.holds(seqs[0]) and ws.holds(seqs[1])
            assert await rt.abort(streams[1].request_id)
            await rt.wait_idle()
            assert ws.num_states == 0 and rt.blocks.num_used_blocks == 0
            assert rt.sampler.num_states == 0


def test_stored_hidden_rows_share_a_small_step_and_copy_from_a_large_one() -> None:
    """A decode step's hidden states are shared unsliced by its sequences; a sequence of
    a prefill-sized step keeps only its own rows, so it cannot pin the whole tensor."""
    import numpy as np
    from conftest import tiny_model

    from spectrio.models.ops.paddle_setup import paddle
    from spectrio.stages.device.draft.mtp import SHARE_ROWS, HiddenStore

    ws = HiddenStore(tiny_model())
    for rows in (8, SHARE_ROWS + 1):
        step = paddle.to_tensor(np.arange(rows * 3, dtype=np.float64).reshape(rows, 3))
        ws.store(7, 10, step, 4, 3)  # positions 10..12 are rows 4..6 of the step
        held = ws._rows[7][-1].hidden
        assert (held is step) == (rows <= SHARE_ROWS)
        assert held.shape[0] == (rows if rows <= SHARE_ROWS else 3)
        np.testing.assert_array_equal(ws.rows_of([(7, 11, 2)]).numpy(), step.numpy()[5:7])


def test_hidden_rows_of_many_sequences_are_stacked_in_order() -> None:
    """One gather where every sequence's rows sit in one shared step; slices and a concat
    where they do not (a prefill-sized step's own copy); either way the rows asked for."""
    import numpy as np
    from conftest import tiny_model

    from spectrio.models.ops.paddle_setup import paddle
    from spectrio.stages.device.draft.mtp import SHARE_ROWS, HiddenStore

    ws = HiddenStore(tiny_model())
    step = paddle.to_tensor(np.arange(24, dtype=np.float64).reshape(8, 3))
    ws.store(1, 20, step, 0, 3)  # positions 20..22: rows 0..2
    ws.store(2, 5, step, 3, 1)  # position 5: row 3
    ws.store(3, 9, step, 4, 4)  # positions 9..12: rows 4..7
    want = [(3, 10, 2), (1, 22, 1), (2, 5, 1)]
    expect = step.numpy()[[5, 6, 2, 3]]
    np.testing.assert_array_equal(ws.rows_of(want).numpy(), expect)
    big = paddle.to_tensor(np.full((SHARE_ROWS + 1, 3), 7.0))
    ws.store(1, 20, big, 10, 3)  # now a copy of its own rows
    expect[2] = 7.0
    np.testing.assert_array_equal(ws.rows_of(want).numpy(), expect)
    with pytest.raises(RuntimeError, match="outside stored hidden rows"):
        ws.rows_of([(2, 5, 2)])
