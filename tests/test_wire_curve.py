"""CURVE: an encrypted, server-authenticated tcp endpoint, over real sockets."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import zmq
import zmq.utils.z85

from spectrio import RuntimeConfig, SamplingParams, open_runtime
from spectrio.wire.async_client import open_client
from spectrio.wire.client_requests import RequestRefused
from spectrio.wire.curve import CurveError, client_keys, create_keys, load_server_keys, zap_reply
from spectrio.wire.server import WireServer, serve
from spectrio.wire.sync_client import Client


def test_key_files(tmp_path: Path) -> None:
    public, secret = create_keys(tmp_path / "keys")
    assert (public.name, secret.name) == ("server.key", "server.key_secret")
    assert secret.stat().st_mode & 0o077 == 0
    server = load_server_keys(secret)
    assert client_keys(public).server_public == server.public
    with pytest.raises(CurveError, match="no secret key"):
        load_server_keys(public)
    with pytest.raises(CurveError, match="cannot read"):
        client_keys(tmp_path / "missing.key")


async def test_curve_client_is_served_and_a_plain_client_is_not(tmp_path: Path) -> None:
    public, secret = create_keys(tmp_path / "keys")
    ctx = zmq.Context()
    with trio.fail_after(120):
        async with open_runtime(RuntimeConfig(dtype="float64", max_model_len=128)) as rt:
            want = []
            async for delta in rt.generate("def fib(n):", SamplingParams(max_tokens=8)):
                want += delta.token_ids
            async with trio.open_nursery() as nursery:
                server = await nursery.start(
                    lambda task_status=trio.TASK_STATUS_IGNORED: serve(  # type: ignore[misc]
                        rt,
                        "tcp://127.0.0.1:*",
                        "tcp://127.0.0.1:*",
                        context=ctx,
                        curve=load_server_keys(secret),
                        task_status=task_status,
                    )
                )
                assert isinstance(server, WireServer)
                eps = server.endpoints
                async with open_client(
                    eps.requests, eps.outputs, context=ctx, curve=client_keys(public)
                ) as client:
                    rid = await client.submit("def fib(n):", SamplingParams(max_tokens=8))
                    chunks = (await client.collect([rid]))[rid]
                    assert [t for c in chunks for t in c.token_ids] == want
                # Without the server's key the handshake never completes: no reply at all.
                plain = await trio.to_thread.run_sync(_plain_ping, eps.requests)
                assert plain == "no reply"
                nursery.cancel_scope.cancel()
    ctx.term()


def _plain_ping(endpoint: str) -> str:
    with Client(endpoint, None, timeout_s=1.0) as client:
        try:
            client.ping()
        except zmq.Again:
            return "no reply"
    return "answered"


async def test_abort_is_scoped_to_the_curve_key(tmp_path: Path) -> None:
    """With CURVE the key is the client: another key cannot abort the request (it gets
    ``unknown_request``, as for an id that does not exist), while a new connection with
    the submitter's key can."""
    public, secret = create_keys(tmp_path / "keys")
    ctx = zmq.Context()
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    with trio.fail_after(120):
        async with open_runtime(RuntimeConfig(dtype="float64", max_model_len=512)) as rt:
            async with trio.open_nursery() as nursery:
                server = await nursery.start(
                    lambda task_status=trio.TASK_STATUS_IGNORED: serve(  # type: ignore[misc]
                        rt,
                        "tcp://127.0.0.1:*",
                        "tcp://127.0.0.1:*",
                        context=ctx,
                        curve=load_server_keys(secret),
                        task_status=task_status,
                    )
                )
                assert isinstance(server, WireServer) and server.endpoints is not None
                eps = server.endpoints
                mine, theirs = client_keys(public), client_keys(public)
                async with open_client(eps.requests, eps.outputs, context=ctx, curve=mine) as owner:
                    rid = await owner.submit("once upon a time", long)
                    await owner.next_chunks()
                    async with open_client(eps.requests, context=ctx, curve=theirs) as other:
                        with pytest.raises(RequestRefused) as refused:
                            await other.abort(rid)
                        assert refused.value.error.code.value == "unknown_request"
                    async with open_client(eps.requests, context=ctx, curve=mine) as again:
                        await again.abort(rid)  # same key, new connection: allowed
                    chunks = (await owner.collect([rid]))[rid]
                    assert chunks[-1].finish_reason == "abort"
                    assert sum(len(c.token_ids) for c in chunks) < 400
                nursery.cancel_scope.cancel()
    ctx.term()


def test_zap_replies() -> None:
    key = bytes(range(32))
    request = [b"1.0", b"7", b"spectrio", b"127.0.0.1", b"", b"CURVE", key]
    assert zap_reply(request) == [b"1.0", b"7", b"200", b"OK", zmq.utils.z85.encode(key), b""]
    assert zap_reply([b"1.0", b"8", b"", b"", b"", b"NULL"])[2] == b"200"
    assert zap_reply([b"1.0", b"9", b"", b"", b"", b"PLAIN", b"user", b"pass"])[2] == b"400"
    assert zap_reply([b"2.0", b"1"])[:3] == [b"1.0", b"1", b"400"]
