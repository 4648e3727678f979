"""ZeroMQ endpoints for a running :class:`~spectrio.runtime.api.Runtime` (wire schema v1,
``docs/wire.md``).

Three sockets, each driven by exactly one owner task:

* **requests** (ROUTER): every frame is untrusted. It is decoded with
  :func:`spectrio.wire.codec.decode_request` and checked with
  :func:`~spectrio.wire.codec.check_submit`; every request gets an ``Ack`` or an
  ``Error`` with a specific code. A valid ``Submit`` runs ``runtime.generate`` in a task of
  its own; its output reaches consumers only through the step stream.
* **outputs** (PUSH, lossless): one ``[envelope, record]`` message per published step,
  with per-request sequence numbers (:class:`~spectrio.wire.codec.SequenceCounter`).
  A PUSH with no connected consumer holds messages rather than dropping them.
* **tap** (PUB, optional): the same messages for observers. It drops when a subscriber
  is slow or when its bounded buffer is full; sequence numbers make the gap visible.

Backpressure. The server is a record sink of the runtime (``add_record_sink``): the
publisher stage awaits it for every step. The sink appends the encoded step to the
output backlog and, while the backlog holds more than ``output_high_water`` steps, waits
for the PUSH owner task to hand steps to the consumer. A slow consumer therefore holds
the publisher, and through it the whole pipeline, and the backlog stays bounded at
``output_high_water + 1`` steps. Meanwhile the request task stops reading new requests,
so the runtime's request queue does not grow either.

Only rank 0 serves: on any other rank :func:`serve` binds nothing.
"""

from __future__ import annotations

import collections
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import msgspec
import structlog
import trio
import zmq
from spectrio.runtime.api import Runtime
from spectrio.runtime.messages import PublishedStep
from spectrio.runtime.params import InvalidRequest
from spectrio.wire.codec import (
    DEFAULT_MAX_REQUEST_BYTES,
    SequenceCounter,
    WireError,
    check_submit,
    decode_request,
    encode,
    encode_step,
)
from spectrio.wire.schema import Abort, Ack, Error, ErrorCode, Ping, Submit
from spectrio.wire.curve import CurveServerKeys
from spectrio.wire.zmq_transport import TrioSocket, open_socket

__all__ = [
    "ServerEndpoints",
    "ServerStats",
    "WireServer",
    "check_endpoint",
    "default_endpoints",
    "serve",
]

log = structlog.get_logger("spectrio.server")

Context = zmq.Context[zmq.Socket[bytes]]


_LOOPBACK_HOSTS = ("localhost", "[::1]", "::1")


def default_endpoints(run_dir: str | os.PathLike[str] | None = None) -> ServerEndpoints:
    """``ipc://`` endpoints under ``run_dir`` (default ``$XDG_RUNTIME_DIR/spectrio``, else
    ``<tmp>/spectrio-<uid>``), created with mode 0700 so only this user can connect."""
    if run_dir is None:
        base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        name = "spectrio" if os.environ.get("XDG_RUNTIME_DIR") else f"spectrio-{os.getuid()}"
        run_dir = Path(base) / name
    path = Path(run_dir)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return ServerEndpoints(
        requests=f"ipc://{path}/requests", outputs=f"ipc://{path}/outputs", tap=f"ipc://{path}/tap"
    )


def check_endpoint(endpoint: str, *, allow_public: bool = False) -> None:
    """Refuse a bind that reaches beyond this machine unless ``allow_public``: ``ipc://``
    and ``tcp://`` on a loopback address pass; any other ``tcp://`` host needs the flag;
    other transports are refused. Wildcards (``*``, ``0.0.0.0``) are refused by
    :func:`~spectrio.wire.zmq_transport.open_socket` in every case."""
    if endpoint.startswith("ipc://"):
        return
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"unsupported endpoint {endpoint!r}: use ipc:// or tcp://")
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0]
    if host in _LOOPBACK_HOSTS or host.startswith("127."):
        return
    if not allow_public:
        raise ValueError(
            f"refusing to bind {endpoint!r}: not loopback (pass allow_public=True, "
            "and use CURVE authentication, to serve beyond this machine)"
        )


class ServerEndpoints(msgspec.Struct, frozen=True, kw_only=True):
    """The endpoints actually bound (``tcp://127.0.0.1:*`` resolved to its port)."""

    requests: str
    outputs: str
    tap: str | None = None


class ServerStats(msgspec.Struct, kw_only=True):
    """Counters, for logs and tests."""

    requests: int = 0  # frames received on the request socket
    acks: int = 0
    errors: dict[str, int] = msgspec.field(default_factory=dict)  # ErrorCode value -> count
    dropped_frames: int = 0  # messages with no usable reply address
    unreplied: int = 0  # replies that could not be delivered (peer gone or not reading)
    steps_published: int = 0  # step messages handed to the PUSH socket
    tap_dropped: int = 0  # step messages the tap dropped
    request_failures: int = 0  # accepted requests that failed inside the runtime
    max_backlog: int = 0  # largest output backlog seen, in steps


class WireServer:
    """The state shared by the three owner tasks. Create it through :func:`serve`."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        max_request_bytes: int,
        output_high_water: int,
        tap_buffer: int,
        reply_timeout_s: float,
        rate: float | None = None,
        burst: int = 64,
    ) -> None:
        self.runtime = runtime
        self._rate = rate
        self._burst = float(burst)
        self._buckets: dict[bytes, tuple[float, float]] = {}  # identity -> (tokens, time)
        self.stats = ServerStats()
        self._max_request_bytes = max_request_bytes
        self._high_water = output_high_water
        self._reply_timeout_s = reply_timeout_s
        self._counter = SequenceCounter()
        self._backlog: collections.deque[list[bytes]] = collections.deque()
        self._backlog_changed = trio.Event()
        self._tap_tx, self._tap_rx = trio.open_memory_channel[list[bytes]](tap_buffer)
        self._tap_enabled = False
        self._active: set[str] = set()
        self._finished = trio.Event()  # replaced each time a request task ends
        self._closing = False
        self.endpoints: ServerEndpoints | None = None  # set once bound

    # ---- output side ----------------------------------------------------------------

    async def on_step(self, published: PublishedStep) -> None:
        """Record sink: encode the step, queue it for the output owner task, then hold the
        publisher (and with it the pipeline) while more than ``output_high_water`` steps
        wait for the consumer. Returns at once after the server stops."""
        self._queue_step(published)
        while len(self._backlog) > self._high_water and not self._closing:
            await self._backlog_changed.wait()

    def _queue_step(self, published: PublishedStep) -> None:
        seqnos = self._counter.advance(published)
        frames = encode_step(published, seqnos)
        self._backlog.append(frames)
        self.stats.max_backlog = max(self.stats.max_backlog, len(self._backlog))
        self._wake()
        if self._tap_enabled:
            try:
                self._tap_tx.send_nowait(frames)
            except trio.WouldBlock:
                self.stats.tap_dropped += 1

    def _wake(self) -> None:
        self._backlog_changed.set()
        self._backlog_changed = trio.Event()

    @property
    def backlog(self) -> int:
        """Steps encoded but not yet handed to the PUSH socket."""
        return len(self._backlog)

    async def run_outputs(self, sock: TrioSocket) -> None:
        while True:
            if not self._backlog:
                await self._backlog_changed.wait()
                continue
            await sock.send_multipart(self._backlog[0])
            self._backlog.popleft()  # only after the send: a cancelled send loses nothing
            self.stats.steps_published += 1
            self._wake()

    async def run_tap(self, sock: TrioSocket) -> None:
        async for frames in self._tap_rx:
            await sock.send_multipart(frames)  # PUB never blocks; it drops at its HWM

    async def drain(self, grace_s: float) -> bool:
        """Stop admitting requests (new submits get ``unavailable``), let the running ones
        finish for up to ``grace_s`` seconds, abort the rest with reason ``shutdown`` and
        wait for the runtime to publish those aborts, then wait (as long again at most)
        for the output backlog to reach the consumer. Returns True when every request
        finished on its own and everything was sent; cancel :func:`serve` afterwards."""
        self._closing = True
        with trio.move_on_after(grace_s):
            while self._active:
                await self._finished.wait()
        cut = sorted(self._active)
        for request_id in cut:
            await self.runtime.abort(request_id, "shutdown")
        with trio.move_on_after(grace_s):
            await self.runtime.wait_idle()  # the abort step carries -9 for each of them
            while self._active:
                await self._finished.wait()
        with trio.move_on_after(grace_s):
            while self._backlog:
                await self._backlog_changed.wait()
        clean = not cut and not self._active and not self._backlog
        log.info("drained" if clean else "drained with aborts", aborted=len(cut),
                 running=len(self._active), backlog=len(self._backlog))
        return clean

    # ---- request side ---------------------------------------------------------------

    def _error(self, code: ErrorCode, reason: str, request_id: str | None) -> Error:
        self.stats.errors[code.value] = self.stats.errors.get(code.value, 0) + 1
        return Error(code=code, reason=reason, request_id=request_id)

    async def run_requests(self, sock: TrioSocket, nursery: trio.Nursery) -> None:
        while True:
            frames = await sock.recv_multipart()
            self.stats.requests += 1
            # Admission control: hold this request (and read no more) while backlogged.
            while len(self._backlog) > self._high_water:
                await self._backlog_changed.wait()
            envelope, reply = await self._handle(frames, nursery)
            if envelope is None:
                self.stats.dropped_frames += 1
                continue
            if isinstance(reply, Ack):
                self.stats.acks += 1
            await self._reply(sock, envelope, reply)

    async def _reply(self, sock: TrioSocket, envelope: Sequence[bytes], reply: Ack | Error) -> None:
        with trio.move_on_after(self._reply_timeout_s) as scope:
            try:
                await sock.send_multipart([*envelope, encode(reply)])
            except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the peer is gone
                self.stats.unreplied += 1
                log.debug("reply undeliverable", error=str(exc))
        if scope.cancelled_caught:
            self.stats.unreplied += 1
            log.warning("reply timed out; the client is not reading replies")

    async def _handle(
        self, frames: list[bytes], nursery: trio.Nursery
    ) -> tuple[list[bytes] | None, Ack | Error]:
        """Split the routing envelope from the body and answer the request."""
        if len(frames) < 2 or not frames[0]:
            return None, self._error(ErrorCode.BAD_FRAME, "no routing identity", None)
        # A DEALER sends [body]; a REQ sends ["", body]. Keep the delimiter for the reply.
        split = 2 if len(frames) >= 3 and frames[1] == b"" else 1
        envelope, body = frames[:split], frames[split:]
        if not self._admit(frames[0]):
            return envelope, self._error(
                ErrorCode.RATE_LIMITED, f"over {self._rate} requests/s; retry later", None
            )
        if len(body) != 1:
            return envelope, self._error(
                ErrorCode.BAD_FRAME, f"a request is one frame, got {len(body)}", None
            )
        try:
            msg = decode_request(body[0], self._max_request_bytes)
            if isinstance(msg, Ping):
                return envelope, Ack(of="ping")
            if self._closing:
                raise WireError(
                    ErrorCode.UNAVAILABLE, "the server is shutting down", msg.request_id
                )
            if isinstance(msg, Submit):
                self._submit(msg, nursery)
                return envelope, Ack(of="submit", request_id=msg.request_id)
            assert isinstance(msg, Abort)
            await self._abort(msg)
            return envelope, Ack(of="abort", request_id=msg.request_id)
        except WireError as exc:
            return envelope, self._error(exc.code, exc.reason, exc.request_id)

    def _admit(self, identity: bytes) -> bool:
        """Token bucket per client identity: ``rate`` requests/s, bursts of ``burst``."""
        if self._rate is None:
            return True
        now = trio.current_time()
        tokens, then = self._buckets.get(identity, (self._burst, now))
        tokens = min(self._burst, tokens + (now - then) * self._rate)
        if len(self._buckets) > 10_000:  # forget idle clients (their buckets are full)
            self._buckets = {
                k: v for k, v in self._buckets.items() if (now - v[1]) * self._rate < self._burst
            }
        if tokens < 1.0:
            self._buckets[identity] = (tokens, now)
            return False
        self._buckets[identity] = (tokens - 1.0, now)
        return True

    def _submit(self, msg: Submit, nursery: trio.Nursery) -> None:
        rid = msg.request_id
        rt = self.runtime
        if rid in self._active:
            raise WireError(
                ErrorCode.DUPLICATE_REQUEST, f"request_id {rid!r} is still running", rid
            )
        prompt_ids = check_submit(
            msg,
            vocab_size=rt.loaded.config.vocab_size,
            max_model_len=rt.config.max_model_len,
            tokenize=rt.tokenizer.encode,
        )
        self._active.add(rid)
        nursery.start_soon(self._run_request, rid, prompt_ids, msg)

    async def _run_request(self, rid: str, prompt_ids: list[int], msg: Submit) -> None:
        try:
            async for _ in self.runtime.generate(prompt_ids, msg.params, request_id=rid):
                pass  # the output travels through the record observer
        except InvalidRequest as exc:
            self.stats.request_failures += 1
            log.warning("accepted request failed in the runtime", request_id=rid, reason=str(exc))
        finally:
            self._active.discard(rid)
            self._finished.set()
            self._finished = trio.Event()

    async def _abort(self, msg: Abort) -> None:
        rid = msg.request_id
        if rid not in self._active:
            raise WireError(ErrorCode.UNKNOWN_REQUEST, f"request_id {rid!r} is not running", rid)
        # The request task may not have entered ``generate`` yet: give it a few turns.
        with trio.move_on_after(1.0):
            while rid in self._active:
                if await self.runtime.abort(rid, "aborted by client"):
                    return
                await trio.sleep(0.001)
        if rid in self._active:
            log.warning("abort could not reach the request", request_id=rid)
        # Otherwise it finished meanwhile; its finish reason is already on the stream.


async def serve(
    runtime: Runtime,
    requests_endpoint: str,
    outputs_endpoint: str,
    tap_endpoint: str | None = None,
    *,
    rank: int = 0,
    allow_public: bool = False,
    context: Context | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_message_bytes: int | None = None,
    output_high_water: int = 256,
    tap_buffer: int = 1024,
    reply_timeout_s: float = 5.0,
    max_requests_per_s: float | None = None,
    request_burst: int = 64,
    curve: CurveServerKeys | None = None,
    task_status: trio.TaskStatus[WireServer | None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``runtime`` over ZeroMQ until cancelled. Use with ``nursery.start`` to get
    the running :class:`WireServer` (its ``endpoints`` and ``stats``); None on a rank other
    than 0, which binds nothing.

    ``max_request_bytes`` is the request size that still gets a ``too_large`` reply;
    libzmq disconnects a peer whose message exceeds ``max_message_bytes`` (``zmq.MAXMSGSIZE``,
    default 4x ``max_request_bytes``) before the server ever sees it. Endpoints must be
    ``ipc://`` or loopback ``tcp://`` unless ``allow_public`` (:func:`check_endpoint`).

    ``max_requests_per_s`` caps each client (by ROUTER identity) with a token bucket of
    ``request_burst``; a request over the cap gets ``rate_limited``.

    On cancellation, running requests are aborted (the runtime ends their streams with
    ``finish_reason="abort"``) and the sockets close with zero linger.
    """
    if rank != 0:
        log.info("not rank 0: no sockets bound", rank=rank)
        task_status.started(None)
        await trio.sleep_forever()
    for endpoint in (requests_endpoint, outputs_endpoint, tap_endpoint):
        if endpoint is not None:
            check_endpoint(endpoint, allow_public=allow_public)
    cap = max_message_bytes if max_message_bytes is not None else 4 * max_request_bytes
    server = WireServer(
        runtime,
        max_request_bytes=max_request_bytes,
        output_high_water=output_high_water,
        tap_buffer=tap_buffer,
        reply_timeout_s=reply_timeout_s,
        rate=max_requests_per_s,
        burst=request_burst,
    )
    ctx = context if context is not None else zmq.Context.instance()
    socks: list[TrioSocket] = []
    try:
        configure = curve.apply if curve is not None else None  # encrypts every socket
        req = open_socket(ctx, zmq.ROUTER, bind=requests_endpoint, max_msg_size=cap, configure=configure)
        socks.append(req)
        out = open_socket(ctx, zmq.PUSH, bind=outputs_endpoint, max_msg_size=None, configure=configure)
        socks.append(out)
        tap: TrioSocket | None = None
        if tap_endpoint is not None:
            tap = open_socket(ctx, zmq.PUB, bind=tap_endpoint, max_msg_size=None, configure=configure)
            socks.append(tap)
            server._tap_enabled = True
        bound = ServerEndpoints(
            requests=req.socket.getsockopt_string(zmq.LAST_ENDPOINT),
            outputs=out.socket.getsockopt_string(zmq.LAST_ENDPOINT),
            tap=tap.socket.getsockopt_string(zmq.LAST_ENDPOINT) if tap is not None else None,
        )
        server.endpoints = bound
        remove = runtime.add_record_sink(server.on_step)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(server.run_outputs, out)
                if tap is not None:
                    nursery.start_soon(server.run_tap, tap)
                nursery.start_soon(server.run_requests, req, nursery)
                log.info("serving", requests=bound.requests, outputs=bound.outputs,
                         tap=bound.tap, max_request_bytes=max_request_bytes)
                task_status.started(server)
        finally:
            server._closing = True
            remove()
            server._wake()  # a publisher held by on_step returns now
            log.info("server stopped", **msgspec.structs.asdict(server.stats))
    finally:
        for sock in socks:
            sock.close(linger=0)
