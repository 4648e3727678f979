"""End to end over real ZeroMQ sockets (ipc:// and tcp://127.0.0.1): the bundled model
served by ``wire/server.py`` and read with the clients (``wire/sync_client.py``,
``wire/async_client.py``). Outputs must equal the in-process ``Runtime.generate`` token
for token, while garbage frames get ``Error`` replies and the valid requests carry on
unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import trio
import trio.lowlevel
import zmq

from spectrio.core.config import RuntimeConfig
from spectrio.core.params import SamplingParams
from spectrio.runtime.api import Runtime, open_runtime
from spectrio.runtime.streams import RequestStream
from spectrio.wire.async_client import AsyncClient, open_client
from spectrio.wire.client_requests import RequestRefused
from spectrio.wire.codec import decode_reply, encode
from spectrio.wire.schema import SCHEMA_VERSION, Abort, Ack, Error, Submit
from spectrio.wire.server import WireServer, check_endpoint, default_endpoints, serve
from spectrio.wire.stream_assembler import Chunk, SequenceGap, StreamAssembler
from spectrio.wire.sync_client import Client

TIMEOUT = 120
MAX_REQUEST_BYTES = 4096

Context = zmq.Context[zmq.Socket[bytes]]

PROMPTS = [
    "the cat sat on the mat",
    "once upon a time",
    "a b c d",
    "hello",
    "in the beginning",
    "the quick brown fox",
]


def params_for(i: int) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(max_tokens=12 + i)
    return SamplingParams(max_tokens=10 + i, temperature=0.8, top_k=20, seed=1000 + i)


@pytest.fixture
def ctx() -> Iterator[Context]:
    context: Context = zmq.Context()
    yield context
    context.destroy(linger=0)


def ipc_endpoints(tmp_path: Path) -> tuple[str, str, str]:
    """Requests, outputs and tap endpoints under a fresh folder of ``tmp_path``."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)  # the endpoint policy refuses a run directory others can enter
    return (f"ipc://{run_dir}/req", f"ipc://{run_dir}/out", f"ipc://{run_dir}/tap")


@pytest.fixture(params=["ipc", "tcp"])
def endpoints(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str, str]:
    if request.param == "ipc":
        return ipc_endpoints(tmp_path)
    return ("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "tcp://127.0.0.1:*")


async def reference(rt: Runtime) -> dict[str, tuple[list[int], str, str | None]]:
    """Each prompt's output from the in-process API, one request at a time."""
    out: dict[str, tuple[list[int], str, str | None]] = {}
    for i, prompt in enumerate(PROMPTS):
        ids: list[int] = []
        text, reason = "", None
        async for delta in rt.generate(prompt, params_for(i), request_id=f"ref-{i}"):
            ids += delta.token_ids
            text += delta.text
            reason = delta.finish_reason or reason
        out[prompt] = (ids, text, reason)
    return out


async def start_server(
    rt: Runtime,
    nursery: trio.Nursery,
    endpoints: tuple[str, str, str],
    ctx: Context,
    max_message_bytes: int | None = None,
) -> WireServer:
    server = await nursery.start(
        lambda task_status=trio.TASK_STATUS_IGNORED: serve(  # type: ignore[misc]
            rt,
            *endpoints,
            context=ctx,
            max_request_bytes=MAX_REQUEST_BYTES,
            max_message_bytes=max_message_bytes,
            task_status=task_status,
        )
    )
    assert isinstance(server, WireServer)
    return server


GARBAGE: list[tuple[bytes, str]] = [
    (b"\xc1\xff\x13garbage", "bad_frame"),
    (encode(Submit(v=SCHEMA_VERSION, request_id="t", prompt="hi"))[:-3], "bad_frame"),
    (msgspec.msgpack.encode([1, 2, 3]), "wrong_type"),
    (msgspec.msgpack.encode({"type": "launch", "v": SCHEMA_VERSION}), "unknown_type"),
    (
        msgspec.msgpack.encode({"type": "submit", "v": 99, "request_id": "x", "prompt": "a"}),
        "schema_version",
    ),
    (
        msgspec.msgpack.encode(
            {"type": "submit", "v": SCHEMA_VERSION, "request_id": "x", "prompt": "a", "extra": 1}
        ),
        "unknown_field",
    ),
    (
        msgspec.msgpack.encode({"type": "submit", "v": SCHEMA_VERSION, "prompt": "a"}),
        "missing_field",
    ),
    (
        encode(
            Submit(
                v=SCHEMA_VERSION,
                request_id="bad-temp",
                prompt="hi",
                params=SamplingParams(temperature=-1.0),
            )
        ),
        "invalid_params",
    ),
    (encode(Submit(v=SCHEMA_VERSION, request_id="empty", prompt="")), "empty_prompt"),
    (encode(Submit(v=SCHEMA_VERSION, request_id="long", prompt=[5] * 300)), "prompt_too_long"),
    (encode(Submit(v=SCHEMA_VERSION, request_id="vocab", prompt=[10**9])), "invalid_field"),
    (encode(Abort(v=SCHEMA_VERSION, request_id="nobody")), "unknown_request"),
    (
        msgspec.msgpack.encode(
            {
                "type": "submit",
                "v": SCHEMA_VERSION,
                "request_id": "salt",
                "prompt": "a",
                "cache_salt": "s" * 257,
            }
        ),
        "invalid_field",
    ),
    (b"\x92" + b"\x00" * (MAX_REQUEST_BYTES + 10), "too_large"),
]


async def send_garbage(client: AsyncClient) -> list[tuple[str, str]]:
    """Send every garbage frame; return (expected, got) codes."""
    results = []
    for frame, code in GARBAGE:
        reply = await client.send_raw(frame)
        assert isinstance(reply, Error), (code, reply)
        results.append((code, reply.code.value))
        await trio.lowlevel.checkpoint()
    return results


async def test_concurrent_clients_match_in_process(
    endpoints: tuple[str, str, str], ctx: Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(TIMEOUT):
        async with open_runtime(RuntimeConfig(dtype="float64", max_model_len=256)) as rt:
            expected = await reference(rt)
            # The server only waits for each request's end: its consumers read the step
            # records, so it never takes (nor detokenizes) a stream's deltas.
            taken: list[object] = []
            on_item = RequestStream._on_item
            monkeypatch.setattr(
                RequestStream,
                "_on_item",
                lambda self, item: taken.append(item) or on_item(self, item),
            )
            async with trio.open_nursery() as nursery:
                server = await start_server(rt, nursery, endpoints, ctx)
                assert server.endpoints is not None
                req_ep, out_ep = server.endpoints.requests, server.endpoints.outputs
                ids: dict[str, str] = {}  # request id -> prompt
                garbage: list[tuple[str, str]] = []

                async with open_client(outputs=out_ep, context=ctx) as consumer:

                    async def submitter(worker: int) -> None:
                        async with open_client(req_ep, context=ctx, stream=False) as client:
                            await client.ping()
                            for i in range(worker, len(PROMPTS), 3):
                                rid = await client.submit(
                                    PROMPTS[i], params_for(i), request_id=f"w{worker}-{i}"
                                )
                                ids[rid] = PROMPTS[i]

                    async def garbler() -> None:
                        async with open_client(req_ep, context=ctx) as client:
                            garbage.extend(await send_garbage(client))
                            await client.ping()  # still serving

                    async with trio.open_nursery() as clients:
                        for w in range(3):
                            clients.start_soon(submitter, w)
                        clients.start_soon(garbler)
                    got = await consumer.collect(list(ids))
                nursery.cancel_scope.cancel()

        assert [c for c, _ in garbage] == [g for _, g in garbage]
        assert len(ids) == len(PROMPTS) and taken == []
        for rid, prompt in ids.items():
            chunks = got[rid]
            tokens = [t for c in chunks for t in c.token_ids]
            text = "".join(c.text for c in chunks)
            want_ids, want_text, want_reason = expected[prompt]
            assert tokens == want_ids, rid
            assert text == want_text, rid
            assert chunks[-1].finish_reason == want_reason
        assert server.stats.errors.get("too_large") == 1
        assert server.stats.acks == len(PROMPTS) + 4  # the submits, 3 submitter pings, 1 final ping
        assert server.stats.steps_published >= 1


async def test_duplicate_abort_and_tap(endpoints: tuple[str, str, str], ctx: Context) -> None:
    with trio.fail_after(TIMEOUT):
        async with open_runtime(RuntimeConfig(dtype="float64", max_model_len=256)) as rt:
            async with trio.open_nursery() as nursery:
                server = await start_server(rt, nursery, endpoints, ctx)
                assert server.endpoints is not None and server.endpoints.tap is not None
                ep = server.endpoints
                async with (
                    open_client(ep.requests, ep.outputs, context=ctx) as client,
                    open_client(outputs=ep.tap, tap=True, context=ctx) as observer,
                ):
                    await client.ping()
                    await trio.sleep(0.2)  # let the SUB subscription reach the PUB
                    long = SamplingParams(max_tokens=200, ignore_eos=True)
                    rid = await client.submit("once upon a time", long, request_id="long")
                    with pytest.raises(RequestRefused) as refused:
                        await client.submit("again", long, request_id="long")
                    assert refused.value.error.code.value == "duplicate_request"
                    # Keep a second request running: the runtime publishes an aborted
                    # slot with the next step it runs.
                    await client.submit("the quick brown fox", long, request_id="bg")
                    first: list[Chunk] = []
                    while not any(c.request_id == rid for c in first):
                        first += await client.next_chunks()
                    await client.abort(rid)
                    chunks = [c for c in first if c.request_id == rid]
                    chunks += (await client.collect([rid]))[rid]
                    assert chunks[-1].finish_reason == "abort"
                    assert 0 < sum(len(c.token_ids) for c in chunks) < 200
                    with pytest.raises(RequestRefused) as unknown:
                        await client.abort(rid)
                    assert unknown.value.error.code.value == "unknown_request"
                    await client.abort("bg")
                    # The tap saw the same stream, without a gap.
                    tapped = (await observer.collect([rid]))[rid]
                    assert [t for c in tapped for t in c.token_ids] == [
                        t for c in chunks for t in c.token_ids
                    ]
                    assert tapped[-1].finish_reason == "abort"
                nursery.cancel_scope.cancel()


async def test_sync_client(ctx: Context, tmp_path: Path) -> None:
    eps = ipc_endpoints(tmp_path)
    with trio.fail_after(TIMEOUT):
        async with open_runtime(RuntimeConfig(dtype="float64", max_model_len=256)) as rt:
            want = [
                t
                async for d in rt.generate("hello", SamplingParams(max_tokens=8))
                for t in d.token_ids
            ]
            async with trio.open_nursery() as nursery:
                server = await start_server(rt, nursery, eps, ctx)
                assert server.endpoints is not None
                ep = server.endpoints

                def run_sync() -> list[int]:
                    with Client(ep.requests, ep.outputs, timeout_s=30, context=ctx) as client:
                        client.ping()
                        with pytest.raises(RequestRefused):
                            client.submit("", SamplingParams())
                        return [
                            t
                            for c in client.generate("hello", SamplingParams(max_tokens=8))
                            for t in c.token_ids
                        ]

                got = await trio.to_thread.run_sync(run_sync)
                nursery.cancel_scope.cancel()
        assert got == want


async def test_sequence_gap_is_detected(ctx: Context, tmp_path: Path) -> None:
    """Drop one step message between server and assembler: the next one raises."""
    eps = ipc_endpoints(tmp_path)
    with trio.fail_after(TIMEOUT):
        async with open_runtime(RuntimeConfig(dtype="float64", max_model_len=256)) as rt:
            async with trio.open_nursery() as nursery:
                server = await start_server(rt, nursery, eps, ctx)
                assert server.endpoints is not None
                ep = server.endpoints
                async with open_client(ep.requests, ep.outputs, context=ctx) as client:
                    rid = await client.submit(
                        "hello", SamplingParams(max_tokens=30, ignore_eos=True)
                    )
                    assert client._outputs is not None
                    assembler = StreamAssembler(track=[rid])
                    with pytest.raises(SequenceGap) as gap:
                        dropped = False
                        while True:
                            frames = await client._outputs.recv_multipart()
                            if assembler.received(rid) > 0 and not dropped:
                                dropped = True  # lose this step
                                continue
                            assembler.feed(frames)
                    assert gap.value.request_id == rid
                    assert gap.value.got > gap.value.expected
                nursery.cancel_scope.cancel()


def test_bind_policy(tmp_path: Path) -> None:
    """The server's policy in brief (every spelling: ``tests/test_endpoint_policy.py``)."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    check_endpoint(f"ipc://{private}/x")
    check_endpoint("tcp://127.0.0.1:5555")
    check_endpoint("tcp://localhost:5555")
    with pytest.raises(ValueError, match="not loopback"):
        check_endpoint("tcp://10.1.2.3:5555")
    check_endpoint("tcp://10.1.2.3:5555", allow_public=True)
    with pytest.raises(ValueError, match="unsupported"):
        check_endpoint("udp://127.0.0.1:1")
    with pytest.raises(ValueError, match="mode 1777"):
        check_endpoint("ipc:///tmp/x")  # a directory every user can enter
    eps = default_endpoints(tmp_path / "rt")
    assert eps.requests == f"ipc://{tmp_path}/rt/requests"
    assert (tmp_path / "rt").stat().st_mode & 0o777 == 0o700


async def test_oversized_message_is_cut_and_serving_continues(
    endpoints: tuple[str, str, str], ctx: Context
) -> None:
    """A message over MAXMSGSIZE (``max_message_bytes``) never reaches the server: libzmq
    drops the peer. One between the request cap and that limit gets ``too_large``. Other
    clients are unaffected."""
    with trio.fail_after(TIMEOUT):
        async with open_runtime(RuntimeConfig(dtype="float64", max_model_len=256)) as rt:
            async with trio.open_nursery() as nursery:
                server = await start_server(
                    rt, nursery, endpoints, ctx, max_message_bytes=8 * MAX_REQUEST_BYTES
                )
                assert server.endpoints is not None
                ep = server.endpoints
                async with open_client(ep.requests, context=ctx) as big:
                    reply = await big.send_raw(b"\x00" * (8 * MAX_REQUEST_BYTES))
                    assert isinstance(reply, Error) and reply.code == "too_large"
                async with open_client(ep.requests, context=ctx, stream=False) as big:
                    assert big._requests is not None
                    await big._requests.send(b"\x00" * (8 * MAX_REQUEST_BYTES + 1))
                    with trio.move_on_after(0.5) as scope:
                        await big._requests.recv()
                    assert scope.cancelled_caught  # no reply: the connection was cut
                async with open_client(ep.requests, ep.outputs, context=ctx) as client:
                    await client.ping()
                    rid = await client.submit("hello", SamplingParams(max_tokens=5))
                    out = (await client.collect([rid]))[rid]
                    assert sum(len(c.token_ids) for c in out) == 5
                # the too_large one, the ping, the Info for the tokenizer and the submit
                assert server.stats.requests == 4 and server.stats.infos == 1
                nursery.cancel_scope.cancel()


def test_serve_and_client_subprocesses(tmp_path: Path) -> None:
    """``serve`` in a subprocess (tcp loopback, port picked by the OS), ``client`` in
    another; the output equals the in-process runtime's; SIGTERM shuts down cleanly."""
    import json
    import signal
    import subprocess
    import sys

    async def in_process() -> list[int]:
        async with open_runtime(RuntimeConfig(dtype="float64", max_model_len=256)) as rt:
            return [
                t
                async for d in rt.generate("hello", SamplingParams(max_tokens=12))
                for t in d.token_ids
            ]

    want = trio.run(in_process)
    cli = [sys.executable, "-m", "spectrio.tools.cli.serve"]
    server = subprocess.Popen(
        [
            *cli,
            "serve",
            "--dtype",
            "float64",
            "--max-model-len",
            "256",
            "--requests",
            "tcp://127.0.0.1:*",
            "--outputs",
            "tcp://127.0.0.1:*",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert line, server.stderr.read() if server.stderr else ""
        ep = json.loads(line)
        assert ep["requests"].startswith("tcp://127.0.0.1:")
        done = subprocess.run(
            [
                *cli,
                "client",
                "hello",
                "--requests",
                ep["requests"],
                "--outputs",
                ep["outputs"],
                "--max-tokens",
                "12",
                "--json",
                "--timeout",
                "60",
            ],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["token_ids"] == want
        refused = subprocess.run(
            [*cli, "client", "", "--requests", ep["requests"], "--outputs", ep["outputs"]],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert refused.returncode == 2 and "empty_prompt" in refused.stderr
        # A refused request prints nothing to stdout (the prompt's echo waits for the
        # first chunk); an accepted one streams the prompt, then the continuation.
        endpoints = ["--requests", ep["requests"], "--outputs", ep["outputs"]]
        bad = subprocess.run(
            [*cli, "client", "hello", *endpoints, "--top-p", "0"],
            capture_output=True, text=True, timeout=TIMEOUT,
        )  # fmt: skip
        assert bad.returncode == 2 and bad.stdout == "" and "top_p" in bad.stderr, bad
        plain = subprocess.run(
            [*cli, "client", "hello", *endpoints, "--max-tokens", "4"],
            capture_output=True, text=True, timeout=TIMEOUT,
        )  # fmt: skip
        assert plain.returncode == 0 and plain.stdout.startswith("hello"), plain
        assert len(plain.stdout) > len("hello\n"), plain.stdout
        # SIGTERM with a request in flight: it finishes within the grace period.
        with Client(ep["requests"], ep["outputs"], timeout_s=60) as client:
            rid = client.submit("hello", SamplingParams(max_tokens=60, ignore_eos=True))
            stream = client.stream(rid)
            chunks = [next(stream)]
            server.send_signal(signal.SIGTERM)
            chunks += list(stream)
        assert chunks[-1].finish_reason == "length"
        assert sum(len(c.token_ids) for c in chunks) == 60
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


async def test_rate_limit_per_client(ctx: Context, tmp_path: Path) -> None:
    eps = default_endpoints(tmp_path / "rt")
    with trio.fail_after(TIMEOUT):
        async with open_runtime(RuntimeConfig(dtype="float64", max_model_len=256)) as rt:
            async with trio.open_nursery() as nursery:
                server = await nursery.start(
                    lambda task_status=trio.TASK_STATUS_IGNORED: serve(  # type: ignore[misc]
                        rt,
                        eps.requests,
                        eps.outputs,
                        context=ctx,
                        max_requests_per_s=1.0,
                        request_burst=3,
                        task_status=task_status,
                    )
                )
                assert isinstance(server, WireServer)
                async with (
                    open_client(eps.requests, context=ctx) as greedy,
                    open_client(eps.requests, context=ctx) as polite,
                ):
                    for _ in range(3):
                        await greedy.ping()
                    with pytest.raises(RequestRefused) as limited:
                        await greedy.ping()
                    assert limited.value.error.code.value == "rate_limited"
                    await polite.ping()  # a separate bucket
                    await trio.sleep(1.1)
                    await greedy.ping()  # refilled
                nursery.cancel_scope.cancel()


async def test_64_concurrent_requests_tcp(ctx: Context) -> None:
    """64 requests from 4 clients at once, over tcp loopback, with garbage in between:
    every token arrives exactly once, in order, equal to the in-process output."""
    n = 64
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(n)]
    with trio.fail_after(TIMEOUT * 2):
        async with open_runtime(RuntimeConfig(dtype="float64", max_model_len=256)) as rt:
            want: dict[str, list[int]] = {}

            async def local(i: int) -> None:
                want[prompts[i]] = [
                    t async for d in rt.generate(prompts[i], params_for(i % 6)) for t in d.token_ids
                ]

            async with trio.open_nursery() as ref:
                for i in range(n):
                    ref.start_soon(local, i)
            async with trio.open_nursery() as nursery:
                server = await start_server(
                    rt,
                    nursery,
                    ("tcp://127.0.0.1:*",) * 3,
                    ctx,  # type: ignore[arg-type]
                )
                assert server.endpoints is not None
                ep = server.endpoints
                ids: dict[str, str] = {}
                async with open_client(outputs=ep.outputs, context=ctx) as consumer:

                    async def submitter(worker: int) -> None:
                        async with open_client(ep.requests, context=ctx, stream=False) as client:
                            for i in range(worker, n, 4):
                                rid = await client.submit(prompts[i], params_for(i % 6))
                                ids[rid] = prompts[i]
                                reply = await client.send_raw(GARBAGE[i % len(GARBAGE)][0])
                                assert isinstance(reply, Error)

                    async with trio.open_nursery() as clients:
                        for w in range(4):
                            clients.start_soon(submitter, w)
                    got = await consumer.collect(list(ids))
                nursery.cancel_scope.cancel()
        assert len(ids) == n
        for rid, prompt in ids.items():
            assert [t for c in got[rid] for t in c.token_ids] == want[prompt], rid


def malformed_frames(n: int, seed: int = 1234) -> list[bytes]:
    """Random bytes, truncations and byte flips of real requests, and the fixed garbage."""
    import random

    rng = random.Random(seed)
    bases = [
        encode(Abort(v=SCHEMA_VERSION, request_id="fuzz-unknown")),
        encode(
            Submit(
                v=SCHEMA_VERSION,
                request_id="fuzz",
                prompt="",
                params=SamplingParams(temperature=-1.0),
            )
        ),
        *(frame for frame, _ in GARBAGE[:-1]),
    ]
    frames: list[bytes] = []
    for _ in range(n):
        kind = rng.randrange(4)
        if kind == 0:
            frames.append(rng.randbytes(rng.randrange(0, 64)))
        else:
            base = bytearray(rng.choice(bases))
            if kind == 1:
                base = base[: rng.randrange(len(base))]
            elif kind == 2:
                for _ in range(rng.randrange(1, 4)):
                    base[rng.randrange(len(base))] = rng.randrange(256)
            else:
                pos = rng.randrange(len(base) + 1)
                base[pos:pos] = rng.randbytes(rng.randrange(1, 8))
            frames.append(bytes(base))
    return frames


async def test_fuzz_10000_frames_while_serving(ctx: Context, tmp_path: Path) -> None:
    """10,000 malformed frames while valid requests run: every frame is answered, the
    server keeps serving, and the valid outputs equal the in-process ones."""
    eps = default_endpoints(tmp_path / "rt")
    frames = malformed_frames(10_000)
    with trio.fail_after(TIMEOUT * 2):
        async with open_runtime(RuntimeConfig(dtype="float64", max_model_len=256)) as rt:
            expected = await reference(rt)
            async with trio.open_nursery() as nursery:
                server = await start_server(
                    rt, nursery, (eps.requests, eps.outputs, str(eps.tap)), ctx
                )
                replies: list[Ack | Error] = []
                async with open_client(eps.requests, eps.outputs, context=ctx) as client:
                    ids = {await client.submit(p, params_for(i)): p for i, p in enumerate(PROMPTS)}

                    async def fuzz() -> None:
                        async with open_client(eps.requests, context=ctx, stream=False) as fuzzer:
                            sock = fuzzer._requests
                            assert sock is not None
                            for start in range(0, len(frames), 100):
                                batch = frames[start : start + 100]
                                for frame in batch:
                                    await sock.send(frame)
                                for _ in batch:
                                    replies.append(decode_reply(await sock.recv()))

                    async with trio.open_nursery() as work:
                        work.start_soon(fuzz)
                        got = await client.collect(list(ids))
                    await client.ping()
                nursery.cancel_scope.cancel()
        assert len(replies) == len(frames)
        assert server.stats.dropped_frames == 0
        # A rare mutation is itself a valid request (then it is acknowledged and runs).
        assert sum(isinstance(r, Error) for r in replies) > 0.95 * len(frames)
        answered = server.stats.acks + server.stats.infos + sum(server.stats.errors.values())
        assert answered == server.stats.requests
        for rid, prompt in ids.items():
            assert [t for c in got[rid] for t in c.token_ids] == expected[prompt][0]


async def test_consumer_reconnect_gets_no_duplicates(ctx: Context, tmp_path: Path) -> None:
    """A consumer that disconnects mid-stream and reconnects (keeping its assembler)
    never sees a token twice: either the stream continues exactly, or the lost steps
    raise SequenceGap."""
    eps = default_endpoints(tmp_path / "rt")
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    with trio.fail_after(TIMEOUT):
        async with open_runtime(RuntimeConfig(dtype="float64", max_model_len=256)) as rt:
            want = [t async for d in rt.generate("once upon a time", params) for t in d.token_ids]
            async with trio.open_nursery() as nursery:
                await start_server(rt, nursery, (eps.requests, eps.outputs, str(eps.tap)), ctx)
                async with open_client(eps.requests, context=ctx, stream=False) as client:
                    rid = await client.submit("once upon a time", params)
                got: list[int] = []
                async with open_client(outputs=eps.outputs, context=ctx) as first:
                    while not got:
                        got += [t for c in await first.next_chunks() for t in c.token_ids]
                    assembler = first.assembler
                async with open_client(outputs=eps.outputs, context=ctx) as second:
                    second.assembler = assembler
                    try:
                        for chunk in (await second.collect([rid]))[rid]:
                            got += chunk.token_ids
                    except SequenceGap as gap:
                        assert gap.got > gap.expected  # lost tokens, never repeated ones
                        assert got == want[: len(got)]
                    else:
                        assert got == want
                nursery.cancel_scope.cancel()


async def test_drain_aborts_what_outlives_the_grace_and_consumers_see_it(
    ctx: Context, tmp_path: Path
) -> None:
    """Shutdown: a request still running when the grace period ends is aborted with
    reason ``shutdown``, and the wire consumer sees it end (no silent cut)."""
    eps = default_endpoints(tmp_path / "rt")
    with trio.fail_after(TIMEOUT):
        async with open_runtime(RuntimeConfig(dtype="float64", max_model_len=256)) as rt:
            async with trio.open_nursery() as nursery:
                server = await nursery.start(
                    lambda task_status=trio.TASK_STATUS_IGNORED: serve(  # type: ignore[misc]
                        rt,
                        eps.requests,
                        eps.outputs,
                        context=ctx,
                        task_status=task_status,
                    )
                )
                assert isinstance(server, WireServer)
                async with open_client(eps.requests, eps.outputs, context=ctx) as client:
                    rid = await client.submit(
                        "def f():", SamplingParams(max_tokens=200, ignore_eos=True)
                    )
                    first = await client.next_chunks()
                    assert first and first[0].request_id == rid
                    clean = await server.drain(0.05)
                    rest = (await client.collect([rid]))[rid]
                assert not clean
                assert rest[-1].finish_reason == "abort"
                assert rt.blocks.num_used_blocks == 0
                nursery.cancel_scope.cancel()


async def test_client_chunks_carry_the_same_logprobs_as_the_embedding_api(
    ctx: Context, tmp_path: Path
) -> None:
    """Issue 13: the client decodes the record's logprob columns into ``Chunk.logprobs``,
    equal (to float32 precision) to the embedding API's ``Delta.logprobs``."""
    eps = ipc_endpoints(tmp_path)
    params = SamplingParams(max_tokens=8, logprobs=3)
    with trio.fail_after(TIMEOUT):
        async with open_runtime(RuntimeConfig(dtype="float64", max_model_len=256)) as rt:
            want = [lp async for d in rt.generate("hello", params) for lp in (d.logprobs or [])]
            async with trio.open_nursery() as nursery:
                server = await start_server(rt, nursery, eps, ctx)
                assert server.endpoints is not None
                ep = server.endpoints

                def run_sync() -> list[object]:
                    with Client(ep.requests, ep.outputs, timeout_s=30, context=ctx) as client:
                        plain = [
                            c.logprobs
                            for c in client.generate("hello", SamplingParams(max_tokens=4))
                        ]
                        assert plain == [None] * len(plain)
                        return [
                            lp
                            for c in client.generate("hello", params)
                            for lp in (c.logprobs or [])
                        ]

                got = await trio.to_thread.run_sync(run_sync)
                nursery.cancel_scope.cancel()
    assert len(got) == len(want) == 8
    for g, w in zip(got, want, strict=True):
        assert g.token_id == w.token_id and g.rank == w.rank  # type: ignore[attr-defined]
        assert g.logprob == pytest.approx(w.logprob, abs=1e-5)  # type: ignore[attr-defined]
        assert [t for t, _ in g.top] == [t for t, _ in w.top]  # type: ignore[attr-defined]
        assert len(g.top) == 3  # type: ignore[attr-defined]


async def test_cache_salt_travels_and_the_final_chunk_says_what_was_cached(
    ctx: Context, tmp_path: Path
) -> None:
    """Schema 1.6: a ``Submit``'s ``cache_salt`` reaches the runtime's prefix cache, and
    a request's final chunk carries ``cached_tokens`` from the step envelope."""
    prompt = list(range(300, 341))  # 2 full blocks of 16 before the last token
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with trio.fail_after(TIMEOUT):
        async with open_runtime(RuntimeConfig(dtype="float64", max_model_len=256)) as rt:
            async with trio.open_nursery() as nursery:
                server = await start_server(rt, nursery, ipc_endpoints(tmp_path), ctx)
                assert server.endpoints is not None
                ep = server.endpoints
                async with open_client(ep.requests, ep.outputs, context=ctx) as client:
                    got = {}
                    for rid, salt in (("a1", "a"), ("b1", "b"), ("a2", "a")):
                        await client.submit(prompt, params, request_id=rid, cache_salt=salt)
                        chunks = (await client.collect([rid]))[rid]
                        got[rid] = ([t for c in chunks for t in c.token_ids], chunks[-1])
                    with pytest.raises(RequestRefused) as bad:
                        await client.submit(prompt, params, cache_salt="x" * 300)
                    assert bad.value.error.code.value == "invalid_field"
                    assert "cache_salt" in bad.value.error.reason
                nursery.cancel_scope.cancel()
    assert [got[r][1].cached_tokens for r in ("a1", "b1", "a2")] == [0, 0, 32]
    assert got["a1"][0] == got["b1"][0] == got["a2"][0]
