"""Engine death reaches every wire consumer (issue 43, part 2): when a stage fails or a
tensor-parallel rank dies, the server publishes one last step that ends every open
request with ``finish_reason="abort"`` and an ``engine_dead`` error, and refuses new
requests naming the cause."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import zmq
from test_serve_process import Server
from test_tensor_parallel import _children
from test_wire_server import ipc_endpoints, start_server

from spectrio import RuntimeConfig, SamplingParams, open_runtime
from spectrio.core.record import unpack
from spectrio.errors import EngineDead
from spectrio.wire.async_client import open_client
from spectrio.wire.client_requests import RequestRefused
from spectrio.wire.schema import ErrorCode
from spectrio.wire.server import death_step
from spectrio.wire.sync_client import Client

Context = zmq.Context[zmq.Socket[bytes]]
LONG = SamplingParams(max_tokens=400, ignore_eos=True)


@pytest.fixture
def ctx() -> Iterator[Context]:
    context: Context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_the_death_step_aborts_each_slot() -> None:
    published = death_step(12, ["a", "b", "c"])
    assert published.step == 12 and published.finish_reasons == ["abort"] * 3
    rec = unpack(published.record)
    assert rec.accept_num.tolist() == [-9, -9, -9] and rec.token_ids.size == 0


class Injected(Exception):
    pass


async def test_a_failed_stage_ends_every_open_request_on_the_wire(
    tmp_path: Path, ctx: Context
) -> None:
    endpoints = ipc_endpoints(tmp_path)
    ids = [f"r{i}" for i in range(5)]
    ended: dict[str, tuple[str | None, str | None]] = {}
    with trio.fail_after(120), pytest.raises(EngineDead):
        async with open_runtime(RuntimeConfig(max_model_len=512)) as rt:
            async with trio.open_nursery() as nursery:
                server = await start_server(rt, nursery, endpoints, ctx)
                assert server.endpoints is not None
                eps = server.endpoints
                async with (
                    open_client(outputs=eps.outputs, context=ctx) as consumer,
                    open_client(eps.requests, context=ctx, stream=False) as client,
                ):
                    for i, rid in enumerate(ids):
                        await client.submit(f"def f{i}(x):", LONG, request_id=rid)
                    started: set[str] = set()
                    broken = False
                    while len(ended) < len(ids):
                        for chunk in await consumer.next_chunks():
                            started.add(chunk.request_id)
                            if chunk.finished:
                                ended[chunk.request_id] = (chunk.finish_reason, chunk.error)
                        if started == set(ids) and not broken:
                            broken = True  # every request is streaming: break a stage

                            def fail(*_: object) -> None:
                                raise Injected("injected verify fault")

                            rt.worker.verify = fail  # type: ignore[method-assign,assignment]
                    await server.death_published.wait()
                    # New requests are refused, naming the cause.
                    with pytest.raises(RequestRefused) as refused:
                        await client.submit("def g(x):", LONG, request_id="late")
                    assert refused.value.error.code == ErrorCode.UNAVAILABLE
                    assert "engine_dead" in str(refused.value)
                nursery.cancel_scope.cancel()
    assert sorted(ended) == ids
    for reason, error in ended.values():
        assert reason == "abort"
        assert error is not None and error.startswith("unavailable: engine_dead: ")
        assert "verify" in error


def test_killing_a_tensor_parallel_rank_ends_every_stream_within_15_s(tmp_path: Path) -> None:
    """The issue's reproduction: ``serve --tensor-parallel-size 2``, five streaming
    requests, ``kill -9`` on rank 1. Every request gets its final step, and the server
    exits with status 1 naming the dead rank."""
    args = [
        "serve", "--run-dir", str(tmp_path / "run"), "--tensor-parallel-size", "2",
        "--threads", "1", "--max-model-len", "1024",
    ]  # fmt: skip
    server = Server(tmp_path, *args)
    try:
        eps = server.wait_endpoints(timeout=240)
        ids = [f"r{i}" for i in range(5)]
        reasons: dict[str, str] = {}
        errors: dict[str, str] = {}
        with Client(eps["requests"], eps["outputs"], timeout_s=60) as client:
            for i, rid in enumerate(ids):
                client.submit(f"def f{i}(x):", LONG, request_id=rid)
            client.next_chunks()  # running
            followers = [p for p in _children(server.pid) if p != server.pid]
            assert followers, "no follower rank process"
            for pid in followers:
                os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            while len(reasons) < len(ids) and time.monotonic() - t0 < 15:
                for chunk in client.next_chunks():
                    if chunk.finished:
                        reasons[chunk.request_id] = chunk.finish_reason or ""
                        if chunk.error is not None:
                            errors[chunk.request_id] = chunk.error
            took = time.monotonic() - t0
        code = server.proc.wait(timeout=30)
    finally:
        server.stop()
    assert sorted(reasons) == ids, server.stderr()
    assert set(reasons.values()) == {"abort"}
    assert took < 15.0
    assert sorted(errors) == ids and all("engine_dead" in e for e in errors.values())
    assert code == 1
    assert "error:" in server.stderr() and "rank 1" in server.stderr()
