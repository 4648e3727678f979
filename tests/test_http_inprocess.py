"""The HTTP front in the runtime's own Trio run (``serve_http`` next to ``open_runtime``,
as ``spectrio serve --http`` runs it), reached with httpx on the same loop: a client
that disconnects aborts its requests at once (the scheduler's blocks are all free), and
a dying engine ends every open stream with an error event and ``[DONE]``, after which
every request and ``/health`` get 503."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
import trio

from spectrio import RuntimeConfig, open_runtime
from spectrio.errors import EngineDead
from spectrio.http_api.front import HttpFront
from spectrio.http_api.server import serve_http
from spectrio.models import LoadedModel
from spectrio.runtime.api import Runtime

CONFIG = RuntimeConfig(max_model_len=512)
LONG = {"prompt": "def f(x):", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


@asynccontextmanager
async def http_front(rt: Runtime) -> AsyncIterator[tuple[HttpFront, httpx.AsyncClient]]:
    front = HttpFront(rt, model_name="bundled")
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_http, front, "127.0.0.1", 0)
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            yield front, client
        front.stop()


async def wait_free(rt: Runtime, aborted: int) -> None:
    """Every KV block back and ``aborted`` requests ended by abort, within 2 s."""
    with trio.fail_after(2):
        while True:
            s = rt.stats()
            if s.running == 0 and s.free_kv_blocks == s.num_kv_blocks:
                if s.finished.get("abort", 0) == aborted:
                    return
            await trio.sleep(0.01)


async def test_a_client_that_disconnects_aborts_its_requests_at_once(
    bundled: LoadedModel,
) -> None:
    with trio.fail_after(120):
        async with open_runtime(CONFIG) as rt, http_front(rt) as (front, client):
            # streaming, n = 2: both choices go when the client does
            body = {**LONG, "stream": True, "n": 2}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                events = 0
                async for line in response.aiter_lines():
                    events += line.startswith("data: ")
                    if events == 4:
                        break
                assert rt.stats().running == 2
            await wait_free(rt, aborted=2)
            assert front.open_requests == 0
            # not streaming: the server notices the disconnect while it collects
            with trio.move_on_after(0.5):
                await client.post("/v1/completions", json=LONG)
            await wait_free(rt, aborted=3)
            # and the server goes on
            ok = await client.post("/v1/completions", json={**LONG, "max_tokens": 3})
            assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def _break_verify(rt: Runtime) -> None:
    def fail(*_: object) -> None:
        raise RuntimeError("injected fault")

    rt.worker.verify = fail  # type: ignore[method-assign,assignment]


async def test_engine_death_ends_open_streams_with_an_error_event_then_done(
    bundled: LoadedModel,
) -> None:
    with trio.fail_after(120):
        with pytest.raises(EngineDead):
            async with open_runtime(CONFIG) as rt, http_front(rt) as (front, client):
                lines: list[str] = []
                body = {**LONG, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        lines.append(line)
                        if len(lines) == 1:
                            _break_verify(rt)
                events = [line for line in lines if line]
                assert events[-1] == "data: [DONE]"
                error = json.loads(events[-2].removeprefix("data: "))["error"]
                assert error["code"] == "engine_dead" and "injected fault" in error["message"]
                assert error["type"] == "server_error"
                await front.died.wait()  # the front's watch task sees it next
                health = await client.get("/health")
                assert health.status_code == 503
                assert health.json()["error"]["code"] == "engine_dead"
                late = await client.post("/v1/completions", json=LONG)
                assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"


async def test_cache_salt_and_cached_prompt_tokens_in_usage(bundled: LoadedModel) -> None:
    """vLLM's ``cache_salt`` reaches the prefix cache; ``usage.prompt_tokens_details``
    says how many prompt tokens came from it (OpenAI's field)."""
    prompt = list(range(300, 341))  # 2 full blocks of 16 before the last token
    body = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    with trio.fail_after(120):
        async with open_runtime(CONFIG) as rt, http_front(rt) as (_, client):
            cached = []
            for salt in ("a", "b", "a"):
                r = await client.post("/v1/completions", json={**body, "cache_salt": salt})
                assert r.status_code == 200, r.text
                cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            assert cached == [0, 0, 32]
            r = await client.post("/v1/completions", json={**body, "cache_salt": "x" * 300})
            assert r.status_code == 400 and "cache_salt" in r.text
