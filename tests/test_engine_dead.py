"""A stage that crashes must not hang anyone: every waiting caller gets EngineDead naming
the stage and the cause, wait_idle raises it, new requests are refused with it, and
leaving the runtime raises it. One injected fault per stage."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio

from spectrio import RuntimeConfig, SamplingParams, open_runtime
from spectrio.errors import EngineDead, SpectrioError
from spectrio.runtime.api import Runtime


class Injected(Exception):
    pass


def _raise(*_: object) -> None:
    raise Injected("injected fault")


def _break_draft(rt: Runtime) -> None:
    rt.worker.draft = _raise  # type: ignore[method-assign,assignment]


def _break_verify(rt: Runtime) -> None:
    rt.worker.verify = _raise  # type: ignore[method-assign,assignment]


def _break_sampler(rt: Runtime) -> None:
    rt.worker.sample = _raise  # type: ignore[method-assign,assignment]


def _break_scheduler(rt: Runtime) -> None:
    rt.scheduler.schedule = _raise  # type: ignore[method-assign,assignment]


def _break_publisher(rt: Runtime) -> None:
    async def sink(_: object) -> None:
        raise Injected("injected fault")

    rt.add_record_sink(sink)


FAULTS: dict[str, Callable[[Runtime], None]] = {
    "draft": _break_draft,
    "verify": _break_verify,
    "sampler": _break_sampler,
    "scheduler": _break_scheduler,
    "publisher": _break_publisher,
}


@pytest.mark.parametrize("stage", list(FAULTS))
async def test_a_crashed_stage_raises_engine_dead_everywhere(bundled: object, stage: str) -> None:
    errors: list[BaseException] = []
    with trio.fail_after(120):
        with pytest.raises(EngineDead) as left:
            async with open_runtime(RuntimeConfig(max_model_len=128)) as rt:
                started = trio.Event()

                async def consume(i: int) -> None:
                    try:
                        async for _ in rt.generate([5 + i, 6, 7], SamplingParams(max_tokens=200)):
                            started.set()
                    except EngineDead as exc:
                        errors.append(exc)

                async with trio.open_nursery() as nursery:
                    for i in range(3):
                        nursery.start_soon(consume, i)
                    await started.wait()
                    FAULTS[stage](rt)
                with pytest.raises(EngineDead):
                    await rt.wait_idle()
                with pytest.raises(EngineDead):
                    rt.generate("x", SamplingParams())
    assert len(errors) == 3
    for exc in errors + [left.value]:
        assert isinstance(exc, SpectrioError)
        assert exc.stage == stage and isinstance(exc.cause, Injected), exc  # type: ignore[attr-defined]
        assert stage in str(exc)


async def test_final_deltas_and_records_carry_per_request_speculation_totals(
    bundled: object,
) -> None:
    """Issue 13: each request's final delta, and the final step record's ``drafts``, carry
    the drafts proposed and accepted over the request's life; rt.metrics() is a snapshot."""
    from spectrio import SpeculativeConfig
    from spectrio.core.messages import PublishedStep

    spec = SpeculativeConfig(num_speculative_tokens=2, adaptive=False)
    finals: dict[str, list[int]] = {}

    def observe(pub: PublishedStep) -> None:
        finals.update(pub.drafts)

    with trio.fail_after(120):
        async with open_runtime(RuntimeConfig(max_model_len=128, speculative=spec)) as rt:
            rt.add_record_observer(observe)
            proposed = accepted = 0
            last = None
            async with rt.generate(
                "def fib(n):", SamplingParams(max_tokens=24, ignore_eos=True)
            ) as s:
                async for delta in s:
                    proposed += delta.num_drafts
                    accepted += min(delta.num_accepted, delta.num_drafts)
                    last = delta
            assert last is not None and last.finished
            assert (last.total_drafts, last.total_accepted) == (proposed, accepted)
            assert proposed > 0
            await rt.wait_idle()
            assert finals[s.request_id] == [proposed, accepted]
            m = rt.metrics()
            assert m["drafts_proposed"] == proposed and m["finished"] == {"length": 1}
            assert 0 <= m["acceptance_rate"] <= 1  # type: ignore[operator]
            stream = rt.generate("import os", SamplingParams(max_tokens=200))
            await stream.__anext__()
            assert await rt.abort(stream.request_id)
            final = [d async for d in stream][-1]
            assert final.finish_reason == "abort" and final.total_drafts is not None
            await rt.wait_idle()  # the step that reports the abort carries its totals too
            assert finals[stream.request_id] == [final.total_drafts, final.total_accepted]
