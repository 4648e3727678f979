"""No front holds another (issue 62), over real ZeroMQ sockets and the bundled model:

* any number of wire clients share a server, each reading the steps of its own requests
  on its own connection (``Submit.stream``, schema 1.7), complete and in order;
* a wire destination that reads nothing (the PUSH outputs socket with no consumer, a
  stream connection that stops reading, a client that dies) holds only its own
  requests: HTTP and in-process requests keep completing while its queue grows past the
  socket's high-water mark, and its requests end within the stated bound with an
  ``output_stalled`` error its client can read, their KV blocks freed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
import trio
import zmq

from spectrio.core.config import RuntimeConfig
from spectrio.core.messages import PublishedStep
from spectrio.core.params import SamplingParams
from spectrio.cuda_kernels.reference import pack_step_record
from spectrio.http_api.front import HttpFront
from spectrio.http_api.server import serve_http
from spectrio.models import LoadedModel
from spectrio.runtime.api import Runtime, open_runtime
from spectrio.wire.async_client import open_client
from spectrio.wire.codec import decode_reply, decode_step, encode, encode_step
from spectrio.wire.outbox import RECONNECT_S
from spectrio.wire.schema import (
    SCHEMA_VERSION,
    Abort,
    Ack,
    Error,
    ErrorCode,
    Info,
    ModelInfo,
    Submit,
)
from spectrio.wire.server import PUSH, WireServer, default_endpoints, serve
from spectrio.wire.stream_connection import is_step_message
from spectrio.wire.sync_client import Client

TIMEOUT = 120
Context = zmq.Context[zmq.Socket[bytes]]
CONFIG = RuntimeConfig(max_model_len=2000)
#: A request that outlasts every time window these tests wait through (a stall bound, the
#: reconnect grace) on a fast machine, until the server ends it.
LONG = 1900


@pytest.fixture
def ctx() -> Iterator[Context]:
    context: Context = zmq.Context()
    yield context
    context.destroy(linger=0)


@asynccontextmanager
async def served(
    rt: Runtime, ctx: Context, tmp_path: Path, **options: object
) -> AsyncIterator[WireServer]:
    eps = default_endpoints(tmp_path / "run")
    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            lambda task_status=trio.TASK_STATUS_IGNORED: serve(  # type: ignore[misc]
                rt, eps.requests, eps.outputs, context=ctx, task_status=task_status, **options
            )
        )
        assert isinstance(server, WireServer)
        yield server
        nursery.cancel_scope.cancel()


async def idle_and_free(rt: Runtime) -> None:
    """The runtime has nothing running and every KV block back."""
    with trio.fail_after(10):
        while True:
            s = rt.stats()
            if s.running == 0 and s.waiting == 0 and s.free_kv_blocks == s.num_kv_blocks:
                return
            await trio.sleep(0.02)


def dealer(ctx: Context, endpoint: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


async def recv(sock: zmq.Socket[bytes], within_s: float = 10.0) -> list[bytes]:
    with trio.fail_after(within_s):
        while True:
            try:
                return sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                await trio.sleep(0.005)


async def test_eight_clients_each_read_their_own_complete_output(
    bundled: LoadedModel, ctx: Context, tmp_path: Path
) -> None:
    prompts = ["def fib(n):", "import os\n", "class Stack:", "for i in range(3):"]
    with trio.fail_after(TIMEOUT):
        async with open_runtime(CONFIG) as rt:
            want: dict[tuple[int, int], list[int]] = {}
            for c in range(8):
                for j in range(2):
                    p = SamplingParams(max_tokens=8 + c + j, ignore_eos=True)
                    want[c, j] = [
                        t async for d in rt.generate(prompts[(c + j) % 4], p) for t in d.token_ids
                    ]
            async with served(rt, ctx, tmp_path) as server:
                assert server.endpoints is not None
                got: dict[tuple[int, int], list[int]] = {}

                async def one_client(c: int) -> None:
                    async with open_client(server.endpoints.requests, context=ctx) as client:
                        rids = {
                            await client.submit(
                                prompts[(c + j) % 4],
                                SamplingParams(max_tokens=8 + c + j, ignore_eos=True),
                            ): j
                            for j in range(2)
                        }
                        out = await client.collect(list(rids))
                        for rid, j in rids.items():
                            got[c, j] = [t for chunk in out[rid] for t in chunk.token_ids]
                            assert out[rid][-1].finish_reason == "length"

                async with trio.open_nursery() as nursery:
                    for c in range(8):
                        nursery.start_soon(one_client, c)
                assert got == want
                # Nothing of them went to the PUSH socket, which nobody reads.
                push = server.outbox(PUSH)
                assert push is not None and push.stats.queued == 0


async def test_no_output_consumer_holds_only_its_own_requests(
    bundled: LoadedModel, ctx: Context, tmp_path: Path
) -> None:
    """The CI guard: a wire request whose steps go to a PUSH socket nobody reads, with a
    high-water mark of 1 and a queue of 4, while HTTP and in-process requests run. Its
    steps pass the mark many times over, everyone else completes, and it is ended with
    ``output_stalled`` within the stall bound, its KV blocks freed."""
    stall_s = 1.0
    with trio.fail_after(TIMEOUT):
        async with (
            open_runtime(CONFIG) as rt,
            served(
                rt, ctx, tmp_path, output_sndhwm=1, output_high_water=4, output_stall_s=stall_s
            ) as server,
        ):
            assert server.endpoints is not None
            sock = dealer(ctx, server.endpoints.requests)
            long = SamplingParams(max_tokens=LONG, ignore_eos=True)
            sock.send(
                encode(Submit(v=SCHEMA_VERSION, request_id="w", prompt=[1, 2, 3], params=long))
            )
            assert decode_reply((await recv(sock))[-1]) == Ack(of="submit", request_id="w")
            started = trio.current_time()
            ended_after: list[float] = []

            refused: list[Ack | Error | ModelInfo] = []

            async def watch() -> None:
                while server.stats.requests_stalled == 0:  # noqa: ASYNC110 - a counter
                    await trio.sleep(0.01)
                ended_after.append(trio.current_time() - started)
                # A new request for the stalled socket is refused (until its queue is
                # dropped, 3 stall periods after its requests were ended).
                again = Submit(v=SCHEMA_VERSION, request_id="w2", prompt=[1], params=long)
                sock.send(encode(again))
                refused.append(decode_reply((await recv(sock))[-1]))

            front = HttpFront(rt, model_name="bundled")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                url = await nursery.start(serve_http, front, "127.0.0.1", 0)
                async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                    for i in range(6):  # in-process and HTTP requests keep completing
                        p = SamplingParams(max_tokens=16, ignore_eos=True)
                        ids = [t async for d in rt.generate(f"x = {i}", p) for t in d.token_ids]
                        assert len(ids) == 16
                        body = {"prompt": f"y = {i}", "max_tokens": 16, "ignore_eos": True}
                        r = await http.post("/v1/completions", json=body)
                        assert r.status_code == 200, r.text
                        assert r.json()["usage"]["completion_tokens"] == 16
                front.stop()
            push = server.outbox(PUSH)
            assert push is not None
            # More steps than the socket's high-water mark and the server's queue together.
            assert push.stats.queued > 1 + 4
            # Ended within the bound: its queue stalls once full (or after stall_s), and the
            # supervisor looks every stall_s / 4.
            assert ended_after and ended_after[0] < stall_s + 1, ended_after
            await idle_and_free(rt)
            assert rt.stats().finished.get("abort") == 1
            # The wire request's owner reads why.
            sock.send(encode(Abort(v=SCHEMA_VERSION, request_id="w")))
            reply = decode_reply((await recv(sock))[-1])
            assert isinstance(reply, Error) and reply.code is ErrorCode.OUTPUT_STALLED
            assert "not read" in reply.reason
            (reply,) = refused
            assert isinstance(reply, Error) and reply.code is ErrorCode.RATE_LIMITED
            with trio.fail_after(stall_s * 3 + 2):
                while push:  # noqa: ASYNC110 - polling a queue
                    await trio.sleep(0.05)
            assert server.stats.steps_dropped > 0
            sock.close(linger=0)


async def test_a_stream_client_that_stops_reading_reads_why_when_it_resumes(
    bundled: LoadedModel, ctx: Context, tmp_path: Path
) -> None:
    """A connection's libzmq queues are kept at one message, and its request's steps are
    large (21 logprob columns, one token a step), so they outgrow the OS buffers and the
    server's queue holds them: the request is ended after the stall bound, and the
    client, reading again, gets everything up to that ending."""
    stall_s = 1.0
    with trio.fail_after(TIMEOUT):
        async with (
            open_runtime(CONFIG) as rt,
            served(
                rt, ctx, tmp_path, output_sndhwm=1, output_high_water=1000, output_stall_s=stall_s
            ) as server,
        ):
            assert server.endpoints is not None
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.RCVBUF, 2048)
            sock.connect(server.endpoints.requests)
            # One step a token with 21 logprob columns: the steps outgrow those buffers.
            long = SamplingParams(max_tokens=LONG, ignore_eos=True, logprobs=20, speculative=False)
            frame = Submit(
                v=SCHEMA_VERSION, request_id="s", prompt=[5, 6], params=long, stream=True
            )
            sock.send(encode(frame))
            # Meanwhile another stream client is served in full, beside the stall: the
            # stalled client resumes as soon as the stall is seen, whatever the other's
            # pace, so it stays within 3 stall periods (before its queue is dropped).
            served_tokens: list[int] = []

            async def other_client() -> None:
                assert server.endpoints is not None
                async with open_client(server.endpoints.requests, context=ctx) as other:
                    rid = await other.submit(
                        "def f(x):", SamplingParams(max_tokens=20, ignore_eos=True)
                    )
                    out = (await other.collect([rid]))[rid]
                    served_tokens.append(sum(len(c.token_ids) for c in out))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(other_client)
                while server.stats.requests_stalled == 0:  # noqa: ASYNC110 - a counter
                    await trio.sleep(0.02)
                # Resuming, it reads its Ack, then its steps in order, then the ending.
                first = await recv(sock)
                assert decode_reply(first[-1]) == Ack(of="submit", request_id="s")
                count, errors, reason = 0, [], None
                while reason is None:
                    frames = await recv(sock)
                    assert is_step_message(frames)
                    env, tokens = decode_step(frames)
                    assert env.request_ids == ["s"] and env.seqnos == [count]
                    count += len(tokens.get("s", []))
                    reason = env.finish_reasons[0]
                    errors = env.errors
            assert reason == "abort" and 0 < count < 500
            assert [e.code for e in errors] == [ErrorCode.OUTPUT_STALLED]
            assert served_tokens == [20]
            await idle_and_free(rt)
            sock.close(linger=0)


async def test_a_client_that_dies_has_its_requests_ended_at_once(
    bundled: LoadedModel, ctx: Context, tmp_path: Path
) -> None:
    with trio.fail_after(TIMEOUT):
        async with open_runtime(CONFIG) as rt, served(rt, ctx, tmp_path) as server:
            assert server.endpoints is not None
            sock = dealer(ctx, server.endpoints.requests)  # libzmq picks its routing id
            long = SamplingParams(max_tokens=LONG, ignore_eos=True)
            for rid in ("a", "b"):
                frame = Submit(
                    v=SCHEMA_VERSION, request_id=rid, prompt=[7], params=long, stream=True
                )
                sock.send(encode(frame))
            for _ in range(4):  # its Acks and a first step or two
                await recv(sock)
            sock.close(linger=0)
            with trio.fail_after(5):  # far below the 10 s stall bound: the close is seen
                await idle_and_free(rt)
            assert rt.stats().finished.get("abort") == 2
            assert server.stats.clients_gone == 1


async def test_a_client_with_its_own_routing_id_that_dies_is_ended_after_the_grace(
    bundled: LoadedModel, ctx: Context, tmp_path: Path
) -> None:
    """The library's clients choose their routing id (so a transport reconnect keeps
    their streams): when one closes, the server gives it RECONNECT_S to come back, then
    ends its requests, far below the stall bound."""
    with trio.fail_after(TIMEOUT):
        async with open_runtime(CONFIG) as rt, served(rt, ctx, tmp_path) as server:
            assert server.endpoints is not None
            endpoint = server.endpoints.requests

            def submit_and_die() -> None:
                with Client(endpoint, timeout_s=30, context=ctx) as client:
                    long = SamplingParams(max_tokens=LONG, ignore_eos=True)
                    rid = client.submit("def f(x):", long)
                    client.submit("class A:", long)
                    for chunk in client.stream(rid):
                        if chunk.token_ids:
                            return  # closes the socket with both requests running

            await trio.to_thread.run_sync(submit_and_die)
            closed = trio.current_time()
            await idle_and_free(rt)
            assert trio.current_time() - closed < RECONNECT_S + 1.5
            assert rt.stats().finished.get("abort") == 2
            assert server.stats.requests_stalled == 2


async def test_an_id_is_not_reused_before_its_final_step(
    bundled: LoadedModel, ctx: Context, tmp_path: Path
) -> None:
    """An aborted request's final (``-9``) slot comes with the next step: until it is
    routed, a new request with the same id is refused (``duplicate_request``), so the
    old slot can never end the new request, nor go to another client."""
    with trio.fail_after(TIMEOUT):
        async with open_runtime(CONFIG) as rt, served(rt, ctx, tmp_path) as server:
            assert server.endpoints is not None
            sock = dealer(ctx, server.endpoints.requests)
            long = SamplingParams(max_tokens=LONG, ignore_eos=True)
            short = SamplingParams(max_tokens=8, ignore_eos=True)

            def submit(params: SamplingParams) -> bytes:
                return encode(
                    Submit(
                        v=SCHEMA_VERSION, request_id="r1", prompt=[3, 4], params=params, stream=True
                    )
                )

            sock.send(submit(long))
            assert decode_reply((await recv(sock))[-1]) == Ack(of="submit", request_id="r1")
            sock.send(encode(Abort(v=SCHEMA_VERSION, request_id="r1")))
            sock.send(submit(short))  # at once: the old one's final slot is not out yet
            replies: list[Ack | Error | ModelInfo] = []
            ends: list[tuple[str, int]] = []  # (finish reason, tokens) per r1 stream
            count = 0

            def resubmitted() -> bool:
                return Ack(of="submit", request_id="r1") in replies

            # The abort's Ack and the resubmit's reply (in either order), the old stream's
            # end, and the new one's too if the resubmit was taken.
            while len(replies) < 2 or len(ends) < (2 if resubmitted() else 1):
                frames = await recv(sock)
                if not is_step_message(frames):
                    replies.append(decode_reply(frames[-1]))
                    continue
                env, tokens = decode_step(frames)
                assert env.request_ids == ["r1"] and env.seqnos == [count]
                count += len(tokens.get("r1", []))
                if env.finish_reasons[0] is not None:
                    ends.append((env.finish_reasons[0], count))
                    count = 0
            assert Ack(of="abort", request_id="r1") in replies
            second = next(r for r in replies if r != Ack(of="abort", request_id="r1"))
            assert ends[0][0] == "abort"
            if isinstance(second, Error):  # refused inside the window, as it should be
                assert second.code is ErrorCode.DUPLICATE_REQUEST
                assert len(ends) == 1
                sock.send(submit(short))  # after the final slot: accepted
                assert decode_reply((await recv(sock))[-1]) == Ack(of="submit", request_id="r1")
                while True:
                    env, tokens = decode_step(await recv(sock))
                    count += len(tokens.get("r1", []))
                    if env.finish_reasons[0] is not None:
                        ends.append((env.finish_reasons[0], count))
                        break
            assert ends[1] == ("length", 8)
            await idle_and_free(rt)
            sock.close(linger=0)


async def test_sync_stream_client_and_info_health(
    bundled: LoadedModel, ctx: Context, tmp_path: Path
) -> None:
    """The blocking client streams on its own connection too, and ``Info`` says the
    pipeline is healthy and how long outputs may wait."""
    with trio.fail_after(TIMEOUT):
        async with open_runtime(CONFIG) as rt, served(rt, ctx, tmp_path) as server:
            assert server.endpoints is not None
            endpoint = server.endpoints.requests

            def run_client() -> tuple[list[int], ModelInfo]:
                with Client(endpoint, timeout_s=30, context=ctx) as client:
                    info = client.info()
                    p = SamplingParams(max_tokens=12, ignore_eos=True)
                    chunks = list(client.generate("def g():", p))
                    return [t for c in chunks for t in c.token_ids], info

            tokens, info = await trio.to_thread.run_sync(run_client)
            assert len(tokens) == 12
            assert info.healthy is True and info.health is None
            assert info.output_stall_s == 10.0


async def test_stream_needs_a_dealer(bundled: LoadedModel, ctx: Context, tmp_path: Path) -> None:
    with trio.fail_after(TIMEOUT):
        async with open_runtime(CONFIG) as rt, served(rt, ctx, tmp_path) as server:
            assert server.endpoints is not None
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(server.endpoints.requests)
            frame = Submit(v=SCHEMA_VERSION, request_id="q", prompt=[1], stream=True)
            sock.send(encode(frame))
            reply = decode_reply((await recv(sock))[-1])
            assert isinstance(reply, Error) and reply.code is ErrorCode.INVALID_FIELD
            assert reply.reason.startswith("stream: ")
            sock.send(encode(Info(v=SCHEMA_VERSION)))
            info = msgspec.msgpack.decode((await recv(sock))[-1])
            assert info["healthy"] is True
            sock.close(linger=0)


# ---- the command-line client --------------------------------------------------------------

CLIENT = [sys.executable, "-m", "spectrio.tools.cli", "client"]


def test_eight_client_processes_each_print_their_own_output(tmp_path: Path) -> None:
    """Eight ``spectrio client`` processes started at once against one ``spectrio serve``
    (default flags, so it has an outputs socket nobody reads) each print their own
    complete output: the tokens one client alone gets for that prompt."""
    from test_wire_raw import ServeProcess

    server = ServeProcess(tmp_path, {"max_model_len": 256})
    try:
        requests = server.endpoints["requests"]

        def command(i: int) -> list[str]:
            return [
                *CLIENT,
                f"def f{i}(x):",
                "--requests",
                requests,
                "--json",
                "--max-tokens",
                str(10 + i),
                "--ignore-eos",
            ]

        alone = [
            json.loads(
                subprocess.run(command(i), capture_output=True, text=True, check=True).stdout
            )
            for i in (0, 7)
        ]
        procs = [
            subprocess.Popen(command(i), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(8)
        ]
        outs = []
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=120)
            assert proc.returncode == 0, stderr
            outs.append(json.loads(stdout))
        for i, out in enumerate(outs):
            assert len(out["token_ids"]) == 10 + i and out["finish_reason"] == "length"
        assert [outs[0]["token_ids"], outs[7]["token_ids"]] == [a["token_ids"] for a in alone]
        assert "Traceback" not in server.stderr()
    finally:
        server.stop()


def test_a_gap_ends_the_client_with_one_error_line(tmp_path: Path) -> None:
    """A server whose step message skips tokens (here a ROUTER of the test's, speaking the
    protocol): ``spectrio client`` exits with status 2 and one ``error:`` line, no
    traceback."""
    ctx: Context = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    proc = subprocess.Popen(
        [*CLIENT, "hello", "--requests", f"tcp://127.0.0.1:{port}", "--timeout", "20"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        router.setsockopt(zmq.RCVTIMEO, 20_000)
        while True:
            ident, body = router.recv_multipart()
            request = msgspec.msgpack.decode(body)
            if request["type"] == "info":  # an older server: the client uses the bundled tokenizer
                reply = Error(code=ErrorCode.UNKNOWN_TYPE, reason="no such request")
                router.send_multipart([ident, encode(reply)])
                continue
            assert request["type"] == "submit" and request["stream"] is True
            rid = request["request_id"]
            router.send_multipart([ident, encode(Ack(of="submit", request_id=rid))])
            record = pack_step_record(
                np.array([[5]]), np.array([1]), np.array([False]), np.zeros(1), np.zeros(1)
            )
            step = PublishedStep(step=1, request_ids=[rid], finish_reasons=[None], record=record)
            router.send_multipart([ident, *encode_step(step, [3])])  # 3 tokens never sent
            break
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
        router.close()
        ctx.term()
    assert proc.returncode == 2, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("error: lost step messages"), stderr
    assert "Traceback" not in stderr
