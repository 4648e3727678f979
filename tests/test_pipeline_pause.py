"""Runtime.pause() / resume(): no step runs while paused, nothing accepted is lost, and
the output is the same as without the pause (greedy, float64, against the oracle)."""

from __future__ import annotations

import functools

import pytest
import trio
import trio.testing
from pipeline_helpers import collect, oracle, prompts
from pipeline_helpers import float64_config as config

from spectrio import Runtime, SamplingParams, open_runtime

MAX_TOKENS = 24


def _prompts() -> list[list[int]]:
    from spectrio.models import load

    tok = load("bundled").tokenizer
    return prompts(tok)[:4]


async def test_a_request_sent_while_paused_waits_and_then_runs_unchanged() -> None:
    batch = _prompts()
    with trio.fail_after(300):
        async with open_runtime(config()) as rt:
            await rt.pause()
            assert rt.paused
            results: list[list[int]] = [[] for _ in batch]

            async def one(i: int) -> None:
                results[i] = await collect(rt, batch[i], SamplingParams(max_tokens=MAX_TOKENS))

            async with trio.open_nursery() as nursery:
                for i in range(len(batch)):
                    nursery.start_soon(one, i)
                steps = rt.num_steps
                await trio.sleep(0.3)
                assert rt.num_steps == steps, "a step ran while paused"
                assert rt.scheduler.num_in_flight == 0
                assert all(not r for r in results)
                rt.resume()
                assert not rt.paused
            assert rt.num_steps > steps
    assert results == [oracle("float64", p, MAX_TOKENS) for p in batch]


@pytest.mark.parametrize("overlap", [False, True])
async def test_pausing_mid_stream_stops_the_device_and_loses_no_token(overlap: bool) -> None:
    batch = _prompts()
    params = SamplingParams(max_tokens=MAX_TOKENS)
    with trio.fail_after(300):
        async with open_runtime(config(overlap=overlap, adaptive=True)) as rt:
            results: list[list[int]] = [[] for _ in batch]
            paused_once = trio.Event()
            progress = [trio.Event()]

            async def one(i: int) -> None:
                async for delta in rt.generate(batch[i], params):
                    results[i] += delta.token_ids
                    progress[0].set()

            async def conductor() -> None:
                # Pause and resume several times while the batch decodes.
                for _ in range(3):
                    progress[0] = trio.Event()
                    await progress[0].wait()  # a step has run since the last resume
                    await rt.pause()
                    # Every step in flight has returned and been delivered.
                    assert rt.scheduler.num_in_flight == 0
                    steps = rt.num_steps
                    await trio.testing.wait_all_tasks_blocked()  # consumers read what came
                    tokens = sum(map(len, results))
                    await trio.sleep(0.1)
                    assert rt.num_steps == steps and sum(map(len, results)) == tokens
                    paused_once.set()
                    rt.resume()
                    await trio.sleep(0.01)

            async with trio.open_nursery() as nursery:
                for i in range(len(batch)):
                    nursery.start_soon(one, i)
                nursery.start_soon(conductor)
            assert paused_once.is_set()
            await rt.wait_idle()
            assert rt.blocks.num_free_blocks == rt.blocks.num_blocks
    assert results == [oracle("float64", p, MAX_TOKENS) for p in batch]


async def test_abort_and_close_while_paused_end_the_streams_and_free_the_blocks() -> None:
    batch = _prompts()
    params = SamplingParams(max_tokens=MAX_TOKENS)
    first: list[int] = []
    reasons: list[str | None] = []
    finish: list[str | None] = []

    async def consume(rt: Runtime, prompt: list[int], out: list[str | None], **kw: str) -> None:
        async for delta in rt.generate(prompt, params, **kw):
            first.extend(delta.token_ids)
            if delta.finished:
                out.append(delta.finish_reason)

    with trio.fail_after(300):
        async with trio.open_nursery() as outer:
            async with open_runtime(config()) as rt:
                async with trio.open_nursery() as nursery:
                    await rt.pause()
                    await rt.pause()  # twice is the same as once
                    nursery.start_soon(
                        functools.partial(consume, rt, batch[0], reasons, request_id="a")
                    )
                    await trio.sleep(0.05)
                    assert await rt.abort("a")
                assert reasons == ["abort"] and first == []
                assert rt.blocks.num_free_blocks == rt.blocks.num_blocks
                # Still paused: a new request waits until the runtime closes, which ends
                # its stream.
                outer.start_soon(consume, rt, batch[1], finish)
                await trio.sleep(0.05)
                assert rt.paused and finish == []
    assert finish == ["abort"] and first == []


async def test_resume_without_pause_does_nothing() -> None:
    batch = _prompts()
    with trio.fail_after(300):
        async with open_runtime(config()) as rt:
            rt.resume()
            out = await collect(rt, batch[0], SamplingParams(max_tokens=8))
    assert out == oracle("float64", batch[0], 8)
