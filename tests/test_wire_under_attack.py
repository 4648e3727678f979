"""The request endpoint under attack (issue 9, items 5, 6 and 12): real ZeroMQ sockets,
the bundled model, hostile clients beside an honest one.

* Huge text prompts are refused (``prompt_too_long``) before they are tokenized, and the
  ones that must be tokenized are tokenized off the event loop: another stream's largest
  gap between tokens stays within twice its largest gap alone.
* A client that floods without reading its replies loses its own replies; another
  client's submit-to-ack p99 stays under 50 ms.
* ``Abort`` is scoped to the client that submitted the request.

Latency bounds compare with a baseline measured in the same test (a busy 2-core machine).
"""

from __future__ import annotations

import gc
import json
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio
import zmq

from spectrio.core.config import RuntimeConfig
from spectrio.core.params import SamplingParams
from spectrio.runtime.api import Runtime, open_runtime
from spectrio.tools.training.corpus import corpus_files, read_texts
from spectrio.wire.client import AsyncClient, RequestRefused, open_client
from spectrio.wire.codec import decode_reply, encode
from spectrio.wire.schema import SCHEMA_VERSION, Abort, Error, Ping, Submit
from spectrio.wire.server import PromptTokenizer, WireServer, serve

Context = zmq.Context[zmq.Socket[bytes]]
TIMEOUT = 240


@pytest.fixture
def ctx() -> Iterator[Context]:
    context: Context = zmq.Context()
    yield context
    context.destroy(linger=0)


def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    path.mkdir(mode=0o700)
    return path


async def start(rt: Runtime, nursery: trio.Nursery, tmp_path: Path, ctx: Context) -> WireServer:
    d = run_dir(tmp_path)
    server = await nursery.start(
        lambda task_status=trio.TASK_STATUS_IGNORED: serve(  # type: ignore[misc]
            rt,
            f"ipc://{d}/req",
            f"ipc://{d}/out",
            context=ctx,
            task_status=task_status,
        )
    )
    assert isinstance(server, WireServer) and server.endpoints is not None
    return server


def code_text(size: int) -> str:
    """Real source text (the held-out corpus), repeated to ``size`` characters."""
    text = "\n".join(read_texts(corpus_files("heldout")))
    return (text * (size // len(text) + 1))[:size]


FLOOD_SCRIPT = r"""
import json, selectors, struct, sys, time, msgspec, zmq
endpoint, frames_path = sys.argv[1], sys.argv[2]
read, pause = sys.argv[3] == "1", float(sys.argv[4])
data = open(frames_path, "rb").read()
frames, i = [], 0
while i < len(data):
    (n,) = struct.unpack_from("<I", data, i)
    frames.append(data[i + 4 : i + 4 + n])
    i += 4 + n
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.setsockopt(zmq.RCVTIMEO, 30000)
sock.setsockopt(zmq.SNDTIMEO, 100)
if not read:
    sock.setsockopt(zmq.RCVHWM, 1)  # its replies pile up at the server
sock.connect(endpoint)
sent, codes = 0, set()
sel = selectors.DefaultSelector()
sel.register(sys.stdin, selectors.EVENT_READ)  # a line on stdin: stop
print("ready", flush=True)
while not sel.select(0):
    try:
        sock.send(frames[sent % len(frames)])
    except zmq.Again:
        continue
    sent += 1
    if read:
        reply = msgspec.msgpack.decode(sock.recv())
        codes.add(reply.get("code", "ack"))
    if pause:
        time.sleep(pause)
print(json.dumps({"sent": sent, "codes": sorted(codes)}), flush=True)
"""


class Flooder:
    """A hostile client in its own process: sends ``frames`` round-robin in a loop,
    waiting for each reply (``read=True``) or never reading one (``read=False``)."""

    def __init__(
        self,
        tmp_path: Path,
        endpoint: str,
        frames: list[bytes],
        *,
        read: bool,
        pause_s: float = 0.0,
    ) -> None:
        path = tmp_path / f"frames-{time.monotonic_ns()}"
        path.write_bytes(b"".join(struct.pack("<I", len(f)) + f for f in frames))
        self._args = [
            sys.executable,
            "-c",
            FLOOD_SCRIPT,
            endpoint,
            str(path),
            "1" if read else "0",
            str(pause_s),
        ]
        self.sent = 0
        self.codes: set[str] = set()  # the reply codes it read ("ack" for an Ack)
        self._proc: trio.Process | None = None

    async def __aenter__(self) -> Flooder:
        self._proc = await trio.lowlevel.open_process(
            self._args, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self._lines = self._read_lines()
        assert await self._lines.__anext__() == "ready"
        return self

    async def _read_lines(self) -> AsyncIterator[str]:
        assert self._proc is not None and self._proc.stdout is not None
        buf = b""
        async for data in self._proc.stdout:
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                yield line.decode()

    async def __aexit__(self, *exc: object) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        with trio.fail_after(60):
            await self._proc.stdin.send_all(b"stop\n")
            async for line in self._lines:
                report = json.loads(line)
                self.sent, self.codes = report["sent"], set(report["codes"])
            assert await self._proc.wait() == 0


async def token_gaps(client: AsyncClient, prompt: list[int], params: SamplingParams) -> list[float]:
    """Submit one request and return the gaps (s) between its consecutive chunks."""
    rid = await client.submit(prompt, params)
    times: list[float] = []
    while True:
        for chunk in await client.next_chunks():
            if chunk.request_id == rid and chunk.token_ids:
                times.append(time.perf_counter())
            if chunk.request_id == rid and chunk.finished:
                return [b - a for a, b in zip(times, times[1:], strict=False)]


async def loop_lags(seconds: float) -> list[float]:
    """How late the event loop wakes a task that sleeps 1 ms, for ``seconds``."""
    lags: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        await trio.sleep(0.001)
        lags.append(time.perf_counter() - t0 - 0.001)
    return lags


# ---- item 5 ---------------------------------------------------------------------------------


def test_the_text_bound_never_exceeds_the_real_token_count(bundled: object) -> None:
    """The byte bound may refuse only prompts that really are too long: for real code,
    long runs of whitespace (the longest tokens), special-token text, multi-byte text and
    random bytes, the bound stays at or below the tokenizer's count."""

    class _Rt:  # PromptTokenizer reads the model folder and the runtime's tokenizer only
        loaded = bundled
        tokenizer = bundled.tokenizer  # type: ignore[attr-defined]

    tok = PromptTokenizer(_Rt())  # type: ignore[arg-type]
    assert tok.max_token_bytes is not None and 8 <= tok.max_token_bytes <= 64
    import random

    rng = random.Random(9)
    texts = [
        code_text(20_000),
        "\n" + " " * 4000,
        ("\n" + " " * 40) * 200,
        "<|endoftext|>" * 300,
        "é中🙂" * 2000,
        "x" * 5000,
    ]
    texts += ["".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(3000)) for _ in range(3)]
    texts += [bytes(rng.randrange(256) for _ in range(4000)).decode("latin-1") for _ in range(3)]
    bound = tok.max_token_bytes
    for text in texts:
        floor = -(-len(text.encode("utf-8", "surrogatepass")) // bound)
        assert floor <= len(tok.encode(text)), text[:40]
        assert tok.encode(text) == bundled.tokenizer.encode(text)  # type: ignore[attr-defined]


async def test_huge_prompts_do_not_stall_another_stream(ctx: Context, tmp_path: Path) -> None:
    """One client sends ~900 KB text prompts in a loop (about 30 a second: each is 0.8 s
    of tokenizing when tokenized, so the server of the issue could not keep up with even
    one). Another stream keeps its pace (median gap within 2x, largest gap within 500 ms of
    its largest gap without the attack: one prompt tokenized would stall it 0.8 s, while
    a 2-core machine shared with another busy process deschedules it for up to about
    0.4 s); no huge prompt reaches the tokenizer.

    The client pauses 10 ms between prompts: a local client that sends 400 MB/s without
    a pause takes CPU from the model on a 2-core machine whatever the server does, which
    is what the per-client rate limit (``--max-requests-per-s``) is for."""
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    huge = code_text(900_000)
    frames = [
        encode(Submit(v=SCHEMA_VERSION, request_id=f"big-{i}", prompt=huge[i:])) for i in range(3)
    ]
    with trio.fail_after(TIMEOUT):
        async with open_runtime(RuntimeConfig(max_model_len=2000)) as rt:
            prompt = rt.tokenizer.encode("def fib(n):")
            gc.freeze()  # as `spectrio serve` does: full collections scan new objects only
            async with trio.open_nursery() as nursery:
                server = await start(rt, nursery, tmp_path, ctx)
                ep = server.endpoints
                assert ep is not None
                async with open_client(ep.requests, ep.outputs, context=ctx) as client:
                    await token_gaps(client, prompt, params)  # warm
                    alone: list[float] = []
                    attacked: list[float] = []
                    sent = 0
                    for _ in range(3):  # interleaved, so both see the same machine load
                        alone += await token_gaps(client, prompt, params)
                        seen = server.stats.requests
                        async with Flooder(
                            tmp_path, ep.requests, frames, read=True, pause_s=0.01
                        ) as flood:
                            while server.stats.requests < seen + 3:  # noqa: ASYNC110
                                await trio.sleep(0.01)
                            attacked += await token_gaps(client, prompt, params)
                        sent += flood.sent
                        assert set(flood.codes) == {"prompt_too_long"}
                nursery.cancel_scope.cancel()
    gc.unfreeze()
    print(
        f"gaps alone: median {statistics.median(alone) * 1e3:.1f} ms, "
        f"max {max(alone) * 1e3:.1f} ms; "
        f"under attack: median {statistics.median(attacked) * 1e3:.1f} ms, "
        f"max {max(attacked) * 1e3:.1f} ms; {sent} huge prompts"
    )
    assert sent >= 30
    assert server.stats.prompts_tokenized == 0  # refused by the byte bound, never tokenized
    # A stall would be the ~2 s a 2 MB tokenization takes; scheduling noise on a shared
    # 2-core CI machine is tens of milliseconds, so bound the pace loosely but far below
    # a stall: the median keeps pace, the worst gap stays under 100 ms more than alone.
    assert statistics.median(attacked) <= 2 * statistics.median(alone)
    assert max(attacked) <= max(alone) + 0.5


async def test_tokenizing_runs_off_the_event_loop(ctx: Context, tmp_path: Path) -> None:
    """Text prompts that pass the byte bound are tokenized in a worker thread with the
    GIL released: while one client sends 80 KB prompts (random printable ASCII, the
    costliest text to tokenize: tens of ms each), the event loop still wakes a 1 ms
    sleeper within half the time one prompt takes to tokenize."""
    import random

    rng = random.Random(5)
    text = "".join(chr(rng.randrange(33, 127)) for _ in range(80_000))
    near = encode(Submit(v=SCHEMA_VERSION, request_id="near", prompt=text))
    with trio.fail_after(TIMEOUT):
        async with open_runtime(RuntimeConfig(max_model_len=2000)) as rt:
            async with trio.open_nursery() as nursery:
                server = await start(rt, nursery, tmp_path, ctx)
                ep = server.endpoints
                assert ep is not None
                quiet = await loop_lags(1.0)
                t0 = time.perf_counter()
                async with Flooder(tmp_path, ep.requests, [near], read=True) as flood:
                    busy = await loop_lags(2.0)
                per_prompt = (time.perf_counter() - t0) / max(flood.sent, 1)
                nursery.cancel_scope.cancel()
    print(
        f"loop lag quiet: max {max(quiet) * 1e3:.2f} ms; while tokenizing: max "
        f"{max(busy) * 1e3:.2f} ms; {flood.sent} prompts, {per_prompt * 1e3:.0f} ms each"
    )
    assert set(flood.codes) == {"prompt_too_long"}
    assert server.stats.prompts_tokenized == flood.sent >= 5
    # On the loop (or holding the GIL), each prompt would hold it for all of that time.
    assert max(busy) < per_prompt / 2


async def test_prompt_length_refusals(ctx: Context, tmp_path: Path) -> None:
    """Token-id prompts by length, text by the byte bound, both before tokenizing; text
    under the bound that tokenizes too long is refused after tokenizing; a prompt that
    fits is served."""
    with trio.fail_after(TIMEOUT):
        async with open_runtime(RuntimeConfig(dtype="float64", max_model_len=256)) as rt:
            async with trio.open_nursery() as nursery:
                server = await start(rt, nursery, tmp_path, ctx)
                ep = server.endpoints
                assert ep is not None
                bound = rt.tokenizer.max_token_bytes
                assert bound is not None
                async with open_client(ep.requests, ep.outputs, context=ctx) as client:
                    cases = [
                        ([1] * 256, "256 tokens"),
                        ([10**9] * 300, "300 tokens"),  # refused on length, before the vocab scan
                        (code_text(255 * bound + 1), "at least 256 tokens"),
                        (code_text(255 * bound), "tokens leave no room"),  # tokenized, then refused
                    ]
                    for prompt, why in cases:
                        before = server.stats.prompts_tokenized
                        with pytest.raises(RequestRefused) as refused:
                            await client.submit(prompt, SamplingParams(max_tokens=4))
                        assert refused.value.error.code.value == "prompt_too_long"
                        assert why in refused.value.error.reason
                        tokenized = server.stats.prompts_tokenized - before
                        assert tokenized == (1 if why == "tokens leave no room" else 0)
                    rid = await client.submit(code_text(300), SamplingParams(max_tokens=4))
                    out = (await client.collect([rid]))[rid]
                    assert sum(len(c.token_ids) for c in out) == 4
                nursery.cancel_scope.cancel()


# ---- item 6 ---------------------------------------------------------------------------------


async def test_a_client_that_never_reads_loses_only_its_own_replies(
    ctx: Context, tmp_path: Path
) -> None:
    """A hostile client floods pings and garbage without reading a reply. Another
    client's 200 submits are acknowledged with a p99 under 50 ms."""
    hostile = [
        encode(Ping(v=SCHEMA_VERSION)),
        b"\xc1garbage",
        encode(Abort(v=SCHEMA_VERSION, request_id="nobody")),
    ]
    params = SamplingParams(max_tokens=1)
    with trio.fail_after(TIMEOUT):
        async with open_runtime(RuntimeConfig(dtype="float64", max_model_len=256)) as rt:
            async with trio.open_nursery() as nursery:
                server = await start(rt, nursery, tmp_path, ctx)
                ep = server.endpoints
                assert ep is not None
                async with open_client(ep.requests, ep.outputs, context=ctx) as client:
                    await client.ping()
                    async with Flooder(tmp_path, ep.requests, hostile, read=False) as flood:
                        while server.stats.replies_dropped == 0:  # noqa: ASYNC110
                            await trio.sleep(0.01)  # its reply queue is full now
                        latencies: list[float] = []
                        ids = []
                        for i in range(200):
                            t0 = time.perf_counter()
                            ids.append(await client.submit([5 + i % 50, 7, 9], params))
                            latencies.append(time.perf_counter() - t0)
                    got = await client.collect(ids)
                nursery.cancel_scope.cancel()
    p99 = statistics.quantiles(latencies, n=100)[98]
    print(
        f"submit-to-ack: median {statistics.median(latencies) * 1e3:.2f} ms, "
        f"p99 {p99 * 1e3:.2f} ms; hostile sent {flood.sent}, "
        f"{server.stats.replies_dropped} of its replies dropped"
    )
    assert p99 < 0.050
    assert server.stats.replies_dropped > 0
    assert all(chunks[-1].finish_reason == "length" for chunks in got.values())


# ---- item 12: abort is scoped to the submitting client --------------------------------------


async def test_abort_is_scoped_to_the_submitting_client(ctx: Context, tmp_path: Path) -> None:
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    with trio.fail_after(TIMEOUT):
        async with open_runtime(RuntimeConfig(dtype="float64", max_model_len=512)) as rt:
            async with trio.open_nursery() as nursery:
                server = await start(rt, nursery, tmp_path, ctx)
                ep = server.endpoints
                assert ep is not None
                async with (
                    open_client(ep.requests, ep.outputs, context=ctx) as owner,
                    open_client(ep.requests, context=ctx) as other,
                ):
                    rid = await owner.submit("once upon a time", long, request_id="mine")
                    first = await owner.next_chunks()
                    assert not any(c.finished for c in first)
                    with pytest.raises(RequestRefused) as theirs:
                        await other.abort(rid)
                    with pytest.raises(RequestRefused) as missing:
                        await other.abort("mine-not")
                    # Exactly the reply for an id that does not exist: nothing leaks.
                    assert theirs.value.error.code == missing.value.error.code
                    assert theirs.value.error.code.value == "unknown_request"
                    assert theirs.value.error.reason.replace(
                        "'mine'", "X"
                    ) == missing.value.error.reason.replace("'mine-not'", "X")
                    # Still running: the owner reads more tokens, then aborts it.
                    more = await owner.next_chunks()
                    assert any(c.request_id == rid and c.token_ids for c in more)
                    assert rid in server._running
                    await owner.abort(rid)
                    rest = (await owner.collect([rid]))[rid]
                    assert rest[-1].finish_reason == "abort"
                nursery.cancel_scope.cancel()


async def test_an_abort_sent_right_behind_its_submit_ends_the_request(
    ctx: Context, tmp_path: Path
) -> None:
    """A client that pipelines ``Submit`` (text, so the reply waits for the tokenizer)
    and ``Abort`` gets both acknowledged, in either order, and the request ends with
    ``finish_reason="abort"``: an accepted request is never lost."""
    import random

    rng = random.Random(3)
    text = "".join(chr(rng.randrange(33, 127)) for _ in range(1500))  # fits under 2000
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    with trio.fail_after(TIMEOUT):
        async with open_runtime(RuntimeConfig(max_model_len=2000)) as rt:
            async with trio.open_nursery() as nursery:
                server = await start(rt, nursery, tmp_path, ctx)
                ep = server.endpoints
                assert ep is not None
                async with open_client(outputs=ep.outputs, context=ctx) as consumer:
                    orders = []
                    for i in range(5):
                        rid = f"piped-{i}"
                        async with open_client(ep.requests, context=ctx, stream=False) as client:
                            sock = client._requests
                            assert sock is not None
                            await sock.send(
                                encode(
                                    Submit(
                                        v=SCHEMA_VERSION, request_id=rid, prompt=text, params=params
                                    )
                                )
                            )
                            await sock.send(encode(Abort(v=SCHEMA_VERSION, request_id=rid)))
                            replies = [decode_reply(await sock.recv()) for _ in range(2)]
                        assert all(not isinstance(r, Error) for r in replies), replies
                        orders.append([r.of for r in replies])  # type: ignore[union-attr]
                        chunks = (await consumer.collect([rid]))[rid]
                        assert chunks[-1].finish_reason == "abort"
                        assert sum(len(c.token_ids) for c in chunks) < 300
                nursery.cancel_scope.cancel()
    print("reply orders:", orders)
