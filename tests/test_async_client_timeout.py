"""Issue 9 item 10: the Trio client never hangs on a dead server.

A real ``spectrio serve`` subprocess is killed with SIGKILL while a request streams.
Every later wait of the :class:`AsyncClient` (the next step message, a ping, a submit)
raises the typed :class:`ClientTimeout` within the configured timeout.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import trio
import zmq

from spectrio import SamplingParams
from spectrio.wire.async_client import open_client
from spectrio.wire.client_requests import ClientTimeout
from spectrio.wire.codec import decode_request, encode
from spectrio.wire.schema import Abort, Ack, Error, ErrorCode, Ping
from spectrio.wire.zmq_transport import open_socket

TIMEOUT_S = 0.5
SLACK_S = 3.0  # scheduling on a busy 2-core machine


def start_server() -> tuple[subprocess.Popen[str], dict[str, str]]:
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spectrio.tools.cli",
            "serve",
            "--max-model-len",
            "512",
            "--requests",
            "tcp://127.0.0.1:*",
            "--outputs",
            "tcp://127.0.0.1:*",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert server.stdout is not None
    line = server.stdout.readline()
    assert line, "spectrio serve did not print its endpoints"
    return server, json.loads(line)


async def timed(call: object) -> float:
    """Seconds until ``call()`` raised ClientTimeout (fails if it returned)."""
    start = trio.current_time()
    try:
        await call()  # type: ignore[operator]
    except ClientTimeout:
        return trio.current_time() - start
    raise AssertionError("the call returned instead of timing out")


async def test_async_client_times_out_after_the_server_is_killed(tmp_path: Path) -> None:
    server, eps = start_server()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with trio.fail_after(120):
            async with open_client(
                eps["requests"], eps["outputs"], context=ctx, timeout_s=TIMEOUT_S
            ) as client:
                assert client.timeout_s == TIMEOUT_S
                # A real round trip first; the model is loaded and answers in time.
                with trio.fail_after(60):
                    while True:
                        try:
                            await client.ping()
                            break
                        except ClientTimeout:
                            continue
                long = SamplingParams(max_tokens=400, ignore_eos=True)
                rid = await client.submit("def fib(n):", long)
                got = 0
                while got == 0:  # a loaded host may take longer than the timeout to start
                    try:
                        got += sum(len(c.token_ids) for c in await client.next_chunks())
                    except ClientTimeout:
                        continue
                server.send_signal(signal.SIGKILL)
                server.wait(timeout=30)
                # Step messages already on their way may still arrive; then the wait for
                # the next one times out, never hangs.
                while True:
                    start = trio.current_time()
                    try:
                        chunks = await client.next_chunks()
                    except ClientTimeout as exc:
                        waited = trio.current_time() - start
                        assert isinstance(exc, TimeoutError)
                        break
                    assert not any(c.finished for c in chunks)
                assert TIMEOUT_S * 0.9 <= waited <= TIMEOUT_S + SLACK_S
                # Request calls time out too, each within the bound, every time.
                calls = (client.ping, lambda: client.submit("x = 1"), lambda: client.abort(rid))
                for call in calls:
                    for _ in range(2):
                        assert TIMEOUT_S * 0.9 <= await timed(call) <= TIMEOUT_S + SLACK_S
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        ctx.destroy(linger=0)


async def test_a_timed_out_call_does_not_take_a_later_calls_reply() -> None:
    """The reply to a call that timed out comes late; the next call still gets its own.
    The peer is a plain ROUTER that answers the first request after the client's timeout
    (no real server can be made that slow on purpose)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = open_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*")
    endpoint = router.socket.getsockopt_string(zmq.LAST_ENDPOINT)
    router.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a reply to a closed peer is dropped

    async def late_then_prompt() -> None:
        ident, frame = await router.recv_multipart()
        msg = decode_request(frame)
        assert isinstance(msg, Abort)
        await trio.sleep(TIMEOUT_S * 3)
        late = Error(code=ErrorCode.UNKNOWN_REQUEST, reason="late", request_id=msg.request_id)
        await router.send_multipart([ident, encode(late)])
        while True:
            ident, frame = await router.recv_multipart()
            assert isinstance(decode_request(frame), Ping)
            await router.send_multipart([ident, encode(Ack(of="ping"))])

    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(late_then_prompt)
                async with open_client(endpoint, context=ctx, timeout_s=TIMEOUT_S) as client:
                    assert TIMEOUT_S * 0.9 <= await timed(lambda: client.abort("first"))
                    await trio.sleep(TIMEOUT_S * 4)  # the late Error has been sent by now
                    # Reading the late Error here would raise RequestRefused.
                    await client.ping()
                    await client.ping()
                nursery.cancel_scope.cancel()
    finally:
        router.close()
        ctx.destroy(linger=0)
