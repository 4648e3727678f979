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
