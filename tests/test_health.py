"""Issue 62, parts 3 and 4: a health check that tells the truth, and a watchdog log line.

The verdict's rules (``spectrio.runtime.health.judge_health``) on plain numbers; the
``stall_timeout_s`` field; and, through a real runtime on the synthetic device: a record
sink that holds the publisher makes ``rt.health()``, ``/health`` and ``spectrio_healthy``
fail within the threshold, naming the sink, logs one warning per episode, and all of it
recovers when the sink lets go; a stalled device, a pause, an unread finished stream and
a dead engine are judged as the rules say."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import structlog
import trio
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from spectrio import ConfigError, RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.core.messages import PublishedStep
from spectrio.errors import EngineDead
from spectrio.http_api.front import HttpFront
from spectrio.http_api.server import serve_http
from spectrio.runtime import Health
from spectrio.runtime.api import Runtime
from spectrio.runtime.health import judge_health
from spectrio.runtime.metrics import ServeMetrics
from spectrio.tools.cli.runtime_flags import parse_runtime_flags

STALL = 0.5  # the runtime tests' stall_timeout_s
SLACK = 2.0  # what a loaded 2-core machine may add to it
SYNTH = "synthetic:step_ms=1,per_row_us=0"


def judge(**kw: Any) -> Health:
    base: dict[str, Any] = {"now": 100.0, "stall_timeout_s": 10.0, "open_requests": 0}
    return judge_health(**{**base, **kw})


# ---- the rules, on plain numbers --------------------------------------------------------------


def test_an_idle_runtime_is_healthy_however_long_ago_its_last_step() -> None:
    h = judge(last_step_at=1.0, active_since=0.5)
    assert h.ok and h.reason is None and h.cause is None
    assert h.open_requests == 0 and h.seconds_since_step == 99.0
    assert h.blocked_sink is None and h.blocked_s is None and h.stall_timeout_s == 10.0
    fresh = judge()  # no step yet, no request yet
    assert fresh.ok and fresh.seconds_since_step is None


def test_work_arriving_after_idleness_starts_the_stall_clock() -> None:
    # the last step was long ago, but the request came 2 s ago: not a stall
    assert judge(open_requests=1, last_step_at=1.0, active_since=98.0).ok
    # ... and no step in the 10.5 s since it came is
    h = judge(open_requests=3, last_step_at=1.0, active_since=89.5)
    assert not h.ok and h.cause == "stalled"
    assert h.reason == "no step completed for 10.5 s (over 10 s) with 3 open requests"
    one = judge(open_requests=1, active_since=80.0)  # no step ever
    assert one.cause == "stalled" and "20.0 s" in str(one.reason)
    assert str(one.reason).endswith("with 1 open request")


def test_the_stall_clock_counts_from_the_later_mark_and_only_past_the_threshold() -> None:
    assert judge(open_requests=1, last_step_at=95.0, active_since=50.0).ok
    assert judge(open_requests=1, last_step_at=90.0, active_since=50.0).ok  # exactly 10 s
    assert not judge(open_requests=1, last_step_at=89.9, active_since=50.0).ok


def test_a_paused_runtime_is_not_stalled() -> None:
    h = judge(open_requests=2, last_step_at=1.0, active_since=1.0, paused=True)
    assert h.ok and h.paused


def test_a_sink_held_past_the_threshold_is_named_with_its_seconds() -> None:
    held = judge(sink="WireServer.on_step", sink_since=95.0, open_requests=1, active_since=99.0)
    assert held.ok and held.blocked_sink == "WireServer.on_step" and held.blocked_s == 5.0
    h = judge(sink="wire", sink_since=87.75, last_step_at=87.7)
    assert not h.ok and h.cause == "sink_blocked" and h.blocked_s == 12.25
    assert h.reason is not None and "'wire'" in h.reason and "12.2 s" in h.reason


def test_death_and_stopping_come_first() -> None:
    h = judge(dead="stage 'verify' failed: boom", sink="wire", sink_since=0.0, open_requests=1)
    assert not h.ok and h.cause == "engine_dead"
    assert h.reason == "the engine is dead: stage 'verify' failed: boom"
    assert h.blocked_sink == "wire"  # the counters still say what they saw
    stopped = judge(stopped=True)
    assert not stopped.ok and stopped.cause == "stopped"


# ---- the config field ---------------------------------------------------------------------------


def test_stall_timeout_is_a_positive_finite_number() -> None:
    assert RuntimeConfig().stall_timeout_s == 10.0
    assert RuntimeConfig().sink_warn_s == 5.0
    assert RuntimeConfig(stall_timeout_s=3).stall_timeout_s == 3
    for bad in (0, -1.0, math.nan, math.inf, "5", True, None):
        with pytest.raises(ConfigError, match=r"^stall_timeout_s: must be a finite number"):
            RuntimeConfig(stall_timeout_s=bad)  # type: ignore[arg-type]
    assert parse_runtime_flags(["--stall-timeout-s", "2.5"]).stall_timeout_s == 2.5


# ---- through a runtime ----------------------------------------------------------------------


@pytest.fixture(autouse=True)
def every_level() -> Iterator[None]:
    """The watchdog's info lines reach ``capture_logs`` even after an earlier test (a CLI
    entry point) configured structlog to drop levels below warning."""
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        yield
    finally:
        structlog.configure(**saved)


def config(**kw: Any) -> RuntimeConfig:
    return RuntimeConfig(
        model=SYNTH,
        max_model_len=256,
        stall_timeout_s=STALL,
        speculative=SpeculativeConfig(num_speculative_tokens=2, adaptive=False),
        **kw,
    )


@asynccontextmanager
async def http_front(rt: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    front = HttpFront(rt, model_name="synthetic")
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_http, front, "127.0.0.1", 0)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            yield client
        front.stop()


async def wait_for(rt: Runtime, ok: bool, within: float) -> Health:
    """Poll ``rt.health()`` until its ``ok`` is ``ok``; fail after ``within`` seconds."""
    with trio.fail_after(within):
        while True:
            h = rt.health()
            if h.ok == ok:
                return h
            await trio.sleep(0.02)


async def logged(logs: list[dict[str, Any]], event: str) -> None:
    """Wait for the watchdog's next look to log ``event``; fail after ``SLACK`` seconds."""
    with trio.fail_after(SLACK):
        while True:
            if any(e["event"] == event for e in logs):
                return
            await trio.sleep(0.02)


def scrape(metrics: ServeMetrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels
    }


async def test_a_sink_that_holds_the_publisher_fails_health_then_recovers() -> None:
    release = trio.Event()
    seen = 0

    async def holding_sink(pub: PublishedStep) -> None:
        nonlocal seen
        seen += 1
        await release.wait()

    params = SamplingParams(max_tokens=30, ignore_eos=True)
    metrics = ServeMetrics()
    with structlog.testing.capture_logs() as logs, trio.fail_after(60):
        async with open_runtime(config()) as rt, http_front(rt) as client:
            await trio.sleep(STALL * 1.5)  # idle for longer than the threshold
            idle = await client.get("/health")
            assert idle.status_code == 200, idle.text
            body = idle.json()
            assert body["status"] == "ok" and body["open_requests"] == 0
            assert body["blocked_sink"] is None and body["stall_timeout_s"] == STALL
            rt.add_record_sink(holding_sink)
            tokens: list[int] = []
            first = rt.generate([5, 6, 7], params)
            assert rt.health().ok  # work just arrived after idleness: no stall

            async def consume() -> None:
                async for delta in first:
                    tokens.extend(delta.token_ids)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume)
                bad = await wait_for(rt, ok=False, within=STALL + SLACK)
                assert bad.cause == "sink_blocked" and bad.blocked_sink is not None
                assert bad.blocked_sink.endswith("holding_sink")
                assert bad.reason is not None and "holding_sink" in bad.reason
                assert bad.open_requests == 1 and bad.blocked_s is not None
                assert bad.blocked_s > STALL
                # a second request queues behind the held publisher: open, and counted
                second = rt.generate([8, 9], params)
                assert rt.health().open_requests == 2
                response = await client.get("/health")
                assert response.status_code == 503, response.text
                got = response.json()
                assert got["error"]["code"] == "sink_blocked"
                assert got["error"]["type"] == "server_error"
                assert "holding_sink" in got["error"]["message"]
                assert got["status"] == "unhealthy" and got["open_requests"] == 2
                assert got["blocked_sink"] == bad.blocked_sink and got["blocked_s"] > STALL
                metrics.update(rt)
                held = scrape(metrics)
                assert held["spectrio_healthy"] == 0 and held["spectrio_open_requests"] == 2
                assert held["spectrio_record_sink_blocked_seconds"] > STALL
                assert seen == 1  # the first step's record, held all along
                await logged(logs, "runtime unhealthy")
                release.set()
                await wait_for(rt, ok=True, within=SLACK)
                await logged(logs, "runtime healthy again")
                async for _ in second:
                    pass
            await rt.wait_idle()
            assert len(tokens) == 30 and seen > 1
            healthy = await client.get("/health")
            assert healthy.status_code == 200, healthy.text
            assert healthy.json()["open_requests"] == 0
            metrics.update(rt)
            after = scrape(metrics)
            assert after["spectrio_healthy"] == 1 and after["spectrio_open_requests"] == 0
            assert after["spectrio_record_sink_blocked_seconds"] == 0
            assert 0 <= after["spectrio_seconds_since_step"] < SLACK
    sink_logs = [e for e in logs if "publisher" in e["event"]]
    warned = [e for e in sink_logs if e["log_level"] == "warning"]
    assert len(warned) == 1, sink_logs  # one line per episode, however long it lasts
    assert warned[0]["event"] == "record sink holds the publisher"
    assert warned[0]["sink"] == bad.blocked_sink and warned[0]["held_s"] > STALL / 2
    let_go = [e for e in sink_logs if e["event"] == "record sink let the publisher go"]
    assert len(let_go) == 1 and let_go[0]["sink"] == bad.blocked_sink
    assert let_go[0]["held_s"] >= bad.blocked_s
    changes = [e["event"] for e in logs if e["event"].startswith("runtime ")]
    assert changes[-2:] == ["runtime unhealthy", "runtime healthy again"], changes


async def test_a_sink_named_at_registration_and_a_removed_one() -> None:
    release = trio.Event()

    async def tap(pub: PublishedStep) -> None:
        await release.wait()

    with trio.fail_after(60):
        async with open_runtime(config()) as rt:
            remove = rt.add_record_sink(tap, name="wire")
            async with trio.open_nursery() as nursery:

                async def consume() -> None:
                    async for _ in rt.generate([5, 6], SamplingParams(max_tokens=5)):
                        pass

                nursery.start_soon(consume)
                bad = await wait_for(rt, ok=False, within=STALL + SLACK)
                assert bad.blocked_sink == "wire" and "'wire'" in str(bad.reason)
                remove()  # gone from the next step on; this await still ends
                release.set()
            await rt.wait_idle()
            assert rt.health().ok


async def test_a_stalled_device_fails_health_and_recovers() -> None:
    gate = threading.Event()
    with trio.fail_after(60):
        async with open_runtime(config()) as rt:
            verify = rt.worker.verify

            def held_verify(*args: Any, **kwargs: Any) -> Any:
                gate.wait(30)
                return verify(*args, **kwargs)

            rt.worker.verify = held_verify  # type: ignore[method-assign]
            try:
                async with trio.open_nursery() as nursery:

                    async def consume() -> None:
                        async for _ in rt.generate([5, 6, 7], SamplingParams(max_tokens=4)):
                            pass

                    nursery.start_soon(consume)
                    bad = await wait_for(rt, ok=False, within=STALL + SLACK)
                    assert bad.cause == "stalled" and bad.blocked_sink is None
                    assert "with 1 open request" in str(bad.reason)
                    gate.set()
                    await wait_for(rt, ok=True, within=SLACK)
            finally:
                gate.set()
            await rt.wait_idle()
            assert rt.health().ok


async def test_pauses_and_unread_finished_streams_are_not_stalls() -> None:
    with trio.fail_after(60):
        async with open_runtime(config()) as rt:
            # a finished request whose consumer has not read its last delta is not open
            unread = rt.generate([5, 6, 7], SamplingParams(max_tokens=3))
            await rt.wait_idle()
            await trio.sleep(STALL * 2)
            h = rt.health()
            assert h.ok and h.open_requests == 0, h
            async for _ in unread:
                pass
            # a request held by a pause waits without being a stall; resuming restarts
            # the clock
            await rt.pause()
            waiting = rt.generate([8, 9], SamplingParams(max_tokens=3))
            await trio.sleep(STALL * 2)
            h = rt.health()
            assert h.ok and h.paused and h.open_requests == 1, h
            rt.resume()
            assert rt.health().ok
            async for _ in waiting:
                pass
            assert rt.health().open_requests == 0


async def test_a_dead_engine_is_unhealthy() -> None:
    def broken(*_: object) -> None:
        raise RuntimeError("injected fault")

    with trio.fail_after(60), pytest.raises(EngineDead):
        async with open_runtime(config()) as rt:
            rt.worker.sample = broken  # type: ignore[method-assign,assignment]
            with pytest.raises(EngineDead):
                async for _ in rt.generate([5, 6], SamplingParams(max_tokens=3)):
                    pass
            h = rt.health()
            assert not h.ok and h.cause == "engine_dead" and "injected fault" in str(h.reason)
            assert h.open_requests == 0
