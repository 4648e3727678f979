"""asyncio programs drive the same runtime through Trio guest mode."""

from __future__ import annotations

import asyncio

import pytest
from pipeline_helpers import oracle

from spectrio import Delta, InvalidRequest, RuntimeConfig, SamplingParams
from spectrio.errors import EngineDead
from spectrio.runtime.aio import open_runtime_asyncio


def test_asyncio_run_streams_the_reference_tokens(bundled64: object) -> None:
    prompts = [bundled64.tokenizer.encode(p) for p in ("def fib(n):", "import os\n", "class A:\n")]  # type: ignore[attr-defined]

    async def main() -> tuple[list[list[int]], str]:
        cfg = RuntimeConfig(dtype="float64", max_model_len=256)
        async with open_runtime_asyncio(cfg, encoded_channels=True) as rt:

            async def one(p: list[int]) -> list[int]:
                out: list[int] = []
                async for delta in rt.generate(p, SamplingParams(max_tokens=16)):
                    out += delta.token_ids
                return out

            results = await asyncio.gather(*(one(p) for p in prompts))
            try:
                async for _ in rt.generate("", SamplingParams()):
                    pass
                error = ""
            except InvalidRequest as exc:
                error = str(exc)
            # Breaking out early aborts the request inside the runtime.
            async for _ in rt.generate("x = 1", SamplingParams(max_tokens=100, ignore_eos=True)):
                break
            for _ in range(100):
                if rt.runtime.blocks.num_used_blocks == 0:
                    break
                await asyncio.sleep(0.05)
            assert rt.runtime.blocks.num_used_blocks == 0
            return list(results), error

    results, error = asyncio.run(asyncio.wait_for(main(), timeout=120))
    assert error.startswith("prompt:")
    for p, got in zip(prompts, results, strict=True):
        assert got == oracle("float64", p, 16)


# ---- issue 9 item 11: leaving the bridge, and item 12: stopping a stream -------------------

LONG = SamplingParams(max_tokens=480, ignore_eos=True)
PROMPTS = ("def fib(n):", "import os\n", "class A:\n")


def find(exc: BaseException, kind: type[BaseException]) -> bool:
    if isinstance(exc, kind):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return any(find(e, kind) for e in exc.exceptions)
    return False


def test_leaving_the_bridge_ends_every_running_stream_with_a_shutdown_delta(
    bundled: object,
) -> None:
    deltas: dict[int, list[Delta]] = {i: [] for i in range(len(PROMPTS))}

    async def main() -> None:
        first = [asyncio.Event() for _ in PROMPTS]
        async with open_runtime_asyncio(RuntimeConfig(max_model_len=512)) as rt:

            async def consume(i: int) -> str:
                # Both spellings: a plain loop, and the documented async with.
                if i == 0:
                    async for delta in rt.generate(PROMPTS[i], LONG):
                        deltas[i].append(delta)
                        first[i].set()
                    return "ended"
                async with rt.generate(PROMPTS[i], LONG) as stream:
                    async for delta in stream:
                        deltas[i].append(delta)
                        first[i].set()
                return "ended"

            async def sleeper() -> None:
                async with rt.generate("x = 1", LONG) as stream:
                    async for _ in stream:
                        await asyncio.sleep(3600)  # still inside when the bridge goes away

            tasks = [asyncio.create_task(consume(i)) for i in range(len(PROMPTS))]
            sleeping = asyncio.create_task(sleeper())
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first)), 60)
            await asyncio.sleep(0.05)
            assert not any(t.done() for t in tasks)
        # The bridge is gone: the streams ended with their final delta, on their own.
        assert await asyncio.wait_for(asyncio.gather(*tasks), 10) == ["ended"] * len(PROMPTS)
        # A task cancelled afterwards sees asyncio's CancelledError, not Trio's RunFinishedError.
        sleeping.cancel()
        try:
            await asyncio.wait_for(sleeping, 10)
        except asyncio.CancelledError:
            pass
        assert sleeping.cancelled()
        # A stream asked for after the bridge is gone is refused, as in Trio.
        try:
            async with rt.generate("y = 2", SamplingParams()):
                raise AssertionError("a stream started after shutdown")
        except RuntimeError as exc:
            assert "not running" in str(exc)

    asyncio.run(asyncio.wait_for(main(), timeout=120))
    for i, ds in deltas.items():
        assert ds and sum(len(d.token_ids) for d in ds) < LONG.max_tokens, i
        last = ds[-1]
        assert (last.finished, last.finish_reason, last.abort_reason) == (True, "abort", "shutdown")
        assert all(not d.finished for d in ds[:-1])


def test_waiting_tasks_get_engine_dead_when_a_stage_fails(bundled: object) -> None:
    class Boom(Exception):
        pass

    async def main() -> tuple[list[BaseException | None], BaseException | None]:
        first = [asyncio.Event() for _ in PROMPTS]
        crash: BaseException | None = None
        errors: list[BaseException | None] = []
        try:
            async with open_runtime_asyncio(RuntimeConfig(max_model_len=512)) as rt:

                async def consume(i: int) -> None:
                    async with rt.generate(PROMPTS[i], LONG) as stream:
                        async for _ in stream:
                            first[i].set()

                tasks = [asyncio.create_task(consume(i)) for i in range(len(PROMPTS))]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first)), 60)

                async def failing_sink(published: object) -> None:
                    raise Boom("a record sink failed")

                rt.runtime.add_record_sink(failing_sink)  # the engine dies at the next step
                await asyncio.wait(tasks, timeout=30)
                errors = [t.exception() if t.done() else None for t in tasks]
        except BaseException as exc:  # the engine's failure surfaces when the bridge is left
            crash = exc
        return errors, crash

    errors, crash = asyncio.run(asyncio.wait_for(main(), timeout=120))
    for err in errors:
        assert isinstance(err, EngineDead) and err.stage == "publisher"
        assert isinstance(err.cause, Boom)
    assert crash is not None and find(crash, EngineDead)


def test_closing_or_cancelling_a_stream_aborts_it_at_once(bundled: object) -> None:
    async def main() -> None:
        async with open_runtime_asyncio(RuntimeConfig(max_model_len=512)) as rt:
            runtime = rt.runtime

            async def idle() -> None:
                for _ in range(400):
                    if not runtime._requests and runtime.blocks.num_used_blocks == 0:
                        return
                    await asyncio.sleep(0.01)
                raise AssertionError("the request was not aborted")

            # break out of the documented async with
            async with rt.generate(PROMPTS[0], LONG) as stream:
                async for delta in stream:
                    if delta.token_ids:
                        break
            assert stream.finished
            await idle()
            # a held stream closed with aclose(); its id is taken while it runs
            held = rt.generate(PROMPTS[1], LONG, request_id="held")
            async for _ in held:
                break
            try:
                async with rt.generate("x", SamplingParams(), request_id="held"):
                    raise AssertionError("a running request id was reused")
            except InvalidRequest as exc:
                assert exc.field == "request_id"
            await held.aclose()
            await idle()
            # a consumer cancelled while it waits for the next delta
            started = asyncio.Event()

            async def consume() -> None:
                async for _ in rt.generate(PROMPTS[2], LONG):
                    started.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(started.wait(), 60)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            assert task.cancelled()
            await idle()

    asyncio.run(asyncio.wait_for(main(), timeout=120))


def test_the_asyncio_api_matches_the_trio_api(bundled: object) -> None:
    """Issue 15, item 13: abort returns a bool, wait_idle and stats exist, generate checks
    at once, and a second runtime in the same thread is refused clearly."""
    from spectrio.errors import InvalidRequest, SpectrioError

    async def main() -> None:
        async with open_runtime_asyncio(RuntimeConfig(max_model_len=512)) as rt:
            with pytest.raises(InvalidRequest):
                rt.generate(None, LONG)  # type: ignore[arg-type]
            stream = rt.generate(PROMPTS[0], LONG)
            first = await stream.__anext__()
            assert first.token_ids
            assert await rt.abort(stream.request_id) is True
            assert await rt.abort(stream.request_id) is False
            assert await rt.abort("no such request") is False
            await rt.wait_idle()
            stats = rt.stats()
            assert stats.running == 0 and stats.free_kv_blocks == stats.num_kv_blocks
            assert stats.finished.get("abort") == 1 and rt.step_timings()
            with pytest.raises(SpectrioError, match="per thread"):
                async with open_runtime_asyncio(RuntimeConfig(max_model_len=512)):
                    pass

    asyncio.run(asyncio.wait_for(main(), timeout=120))
