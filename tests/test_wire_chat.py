"""Chats over the wire (schema 1.5, issue 42 item 4), over real ZeroMQ sockets: a
``Submit`` with ``messages`` is rendered by the served model's template and answered as
``rt.chat`` answers it; exactly one of prompt and messages; a malformed chat gets the
embedding API's reason; a model without a template refuses with ``no_chat_template``;
a client that predates 1.5 is served as before; ``spectrio client --chat`` against
``spectrio serve``."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
import zmq
from chat_helpers import write_chat_checkpoint
from test_chat import ANSWER, CHAT, RENDERED, config

from spectrio import RuntimeConfig, SamplingParams, open_runtime
from spectrio.runtime.api import Runtime
from spectrio.wire.async_client import AsyncClient, open_client
from spectrio.wire.client_requests import RequestRefused
from spectrio.wire.schema import SCHEMA_MINOR, Ack, Error, ErrorCode
from spectrio.wire.server import WireServer, serve

Context = zmq.Context[zmq.Socket[bytes]]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_checkpoint(tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture
def ctx() -> Iterator[Context]:
    context: Context = zmq.Context()
    yield context
    context.destroy(linger=0)


async def start(rt: Runtime, nursery: trio.Nursery, tmp: Path, ctx: Context) -> WireServer:
    run_dir = tmp / "run"
    run_dir.mkdir(mode=0o700)
    server = await nursery.start(
        lambda task_status=trio.TASK_STATUS_IGNORED: serve(  # type: ignore[misc]
            rt,
            f"ipc://{run_dir}/req",
            f"ipc://{run_dir}/out",
            context=ctx,
            task_status=task_status,
        )
    )
    assert isinstance(server, WireServer) and server.endpoints is not None
    return server


def frame(**fields: Any) -> bytes:
    """A request as any msgpack library writes it (the way a client older than 1.5 does)."""
    return msgpack.packb({"type": "submit", "v": 1, **fields})


async def answer(client: AsyncClient, rid: str) -> tuple[list[int], str, str | None]:
    chunks = (await client.collect([rid]))[rid]
    return (
        [t for c in chunks for t in c.token_ids],
        "".join(c.text for c in chunks),
        chunks[-1].finish_reason,
    )


REFUSED = [
    ({"prompt": "hi", "messages": CHAT}, ErrorCode.INVALID_FIELD, "prompt: a submit carries"),
    ({}, ErrorCode.MISSING_FIELD, "prompt: a submit needs a prompt"),
    ({"messages": "hi"}, ErrorCode.WRONG_TYPE, "messages: must be a non-empty list"),
    ({"messages": []}, ErrorCode.EMPTY_PROMPT, "messages: must be a non-empty list"),
    ({"messages": ["hi"]}, ErrorCode.WRONG_TYPE, "messages: each must be a message"),
    (
        {"messages": [{"role": "user", "content": 3}]},
        ErrorCode.WRONG_TYPE,
        "messages: each must have a string 'content', got {'role': 'user', 'content': 3} at "
        "index 0",
    ),
    ({"messages": [{"role": "user"}]}, ErrorCode.MISSING_FIELD, "Object missing required field"),
    (
        {"messages": [{"role": "user", "content": "x", "name": "n"}]},
        ErrorCode.UNKNOWN_FIELD,
        "Object contains unknown field `name`",
    ),
    (
        {"messages": [{"role": "user", "content": "hi " * 80}]},
        ErrorCode.PROMPT_TOO_LONG,
        "messages: rendered by the chat template",
    ),
]


async def test_a_chat_round_trip_equals_rt_chat_and_old_clients_still_work(
    chat_dir: Path, ctx: Context, tmp_path: Path
) -> None:
    params = SamplingParams(max_tokens=10)
    with trio.fail_after(60):
        async with open_runtime(config(chat_dir, "ngram", k=3)) as rt, trio.open_nursery() as n:
            want = [t async for d in rt.chat(CHAT, params) for t in d.token_ids]
            assert want == ANSWER
            server = await start(rt, n, tmp_path, ctx)
            eps = server.endpoints
            assert eps is not None
            async with open_client(eps.requests, eps.outputs, context=ctx) as client:
                info = await client.info()
                assert info.minor == SCHEMA_MINOR >= 5 and info.chat_template  # chat: since 1.5
                rid = await client.submit(params=params, messages=CHAT)
                assert await answer(client, rid) == (ANSWER, "hi there", "stop")
                # A prompt from a 1.5 client carries no "messages" key (an older server
                # refuses unknown keys), and a frame written before 1.5 runs as before.
                plain = await client.send_raw(frame(request_id="old", prompt=RENDERED))
                assert isinstance(plain, Ack), plain
                client.assembler.follow("old")
                out = await answer(client, "old")
                assert out[0][:3] == ANSWER and len(out[0]) > 3  # no template stops here
                for i, (fields, code, reason) in enumerate(REFUSED):
                    reply = await client.send_raw(frame(request_id=f"bad{i}", **fields))
                    assert isinstance(reply, Error), (fields, reply)
                    assert (reply.code, reply.request_id) == (code, f"bad{i}")
                    assert reply.reason.startswith(reason), reply.reason
            n.cancel_scope.cancel()


def test_a_new_client_sends_no_messages_key_with_a_prompt() -> None:
    from spectrio.wire.client_requests import submit_frame

    body = msgpack.unpackb(submit_frame("hi", None, "r"))
    assert "messages" not in body and body["prompt"] == "hi"
    body = msgpack.unpackb(submit_frame(None, None, "r", CHAT))
    assert "prompt" not in body and body["messages"] == CHAT


async def test_a_model_without_a_template_refuses_chats(ctx: Context, tmp_path: Path) -> None:
    cfg = RuntimeConfig(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=256)
    with trio.fail_after(120):
        async with open_runtime(cfg) as rt, trio.open_nursery() as n:
            server = await start(rt, n, tmp_path, ctx)
            eps = server.endpoints
            assert eps is not None
            async with open_client(eps.requests, eps.outputs, context=ctx) as client:
                assert not (await client.info()).chat_template
                with pytest.raises(RequestRefused) as info:
                    await client.submit(messages=CHAT)
                error = info.value.error
                assert error.code is ErrorCode.NO_CHAT_TEMPLATE
                assert error.reason.startswith("messages: model 'bundled' has no chat template")
                rid = await client.submit("def f(", SamplingParams(max_tokens=2))
                assert (await answer(client, rid))[0]  # prompts are served as before
            n.cancel_scope.cancel()


def test_client_chat_against_a_serve_process(chat_dir: Path, tmp_path: Path) -> None:
    from test_wire_raw import ServeProcess

    table = {"model": str(chat_dir), "max_model_len": 64, "speculative": {"method": None}}
    server = ServeProcess(tmp_path, table)
    try:
        eps = server.endpoints
        cli = [sys.executable, "-m", "spectrio.tools.cli", "client"]
        where = ["--requests", eps["requests"], "--outputs", eps["outputs"], "--timeout", "60"]
        done = subprocess.run(
            [*cli, "--chat", "hi there", "--system", "friend", *where, "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout)
        assert (out["token_ids"], out["text"], out["finish_reason"]) == (ANSWER, "hi there", "stop")
        done = subprocess.run(
            [*cli, "--chat", "hi", "--system", "x", *where], capture_output=True, text=True
        )
        assert done.returncode == 0 and done.stdout == "hi there\n", done.stderr
    finally:
        server.stop()
