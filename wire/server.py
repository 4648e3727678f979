"""ZeroMQ endpoints for a running :class:`~spectrio.runtime.api.Runtime` (wire schema v1,
``docs/wire.md``).

Three sockets, each driven by exactly one owner task:

* **requests** (ROUTER): every frame is untrusted. It is decoded with
  :func:`spectrio.wire.codec.decode_request` (the size cap comes first) and checked with
  :func:`~spectrio.wire.codec.check_submit`; every request gets an ``Ack`` or an
  ``Error`` with a specific code. A valid ``Submit`` runs ``runtime.generate`` in a task of
  its own; its output reaches consumers only through the step stream.
* **outputs** (PUSH, lossless): one ``[envelope, record]`` message per published step,
  with per-request sequence numbers (:class:`~spectrio.wire.codec.SequenceCounter`).
  A PUSH with no connected consumer holds messages rather than dropping them.
* **tap** (PUB, optional): the same messages for observers. It drops when a subscriber
  is slow or when its bounded buffer is full; sequence numbers make the gap visible.

Nothing a client does makes the request task wait on that client:

* Replies are sent without waiting. A client that does not read its replies fills its
  own queue at the ROUTER (``SNDHWM``); from then on its replies are dropped and counted
  (``stats.replies_dropped``), and every other client is served as before.
* Admission (:mod:`spectrio.wire.admission`) comes before any cost: per-client rate
  limits, the size caps, and a text prompt bounded before it is tokenized (one whose
  UTF-8 length already proves it has ``max_model_len`` tokens or more gets
  ``prompt_too_long`` at once). The rest, and chats (``messages``, rendered by the
  model's chat template), are tokenized in a worker thread (one at a time, with the GIL
  released) while the event loop keeps running; the ``Ack`` or ``Error`` follows when
  the tokenizer is done.
* ``Abort`` is scoped to the client that submitted the request: its CURVE public key when
  CURVE is on, else its ROUTER identity. Anyone else gets ``unknown_request``, the same
  reply as for an id that does not exist.

Backpressure. The server is a record sink of the runtime (``add_record_sink``): the
publisher stage awaits it for every step. The sink appends the encoded step to the
output backlog and, while the backlog holds more than ``output_high_water`` steps, waits
for the PUSH owner task to hand steps to the consumer. A slow consumer therefore holds
the publisher, and through it the whole pipeline, and the backlog stays bounded at
``output_high_water + 1`` steps. Meanwhile the request task stops reading new requests,
so the runtime's request queue does not grow either.

``ipc://`` endpoints live in a run directory that one server at a time holds
(:func:`~spectrio.wire.endpoints.claim_endpoints`, in :mod:`spectrio.wire.endpoints`
with the endpoint policy): a second server is refused with the first one's pid, socket
files of a dead server are removed, and a server removes its own on exit. The names of
both modules stay importable from here.

Only rank 0 serves: on any other rank :func:`serve` binds nothing.
"""

from __future__ import annotations

import collections
import errno
import functools
import hashlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, TypeVar

import msgspec
import numpy as np
import structlog
import trio
import zmq

from spectrio.core.messages import PublishedStep
from spectrio.core.params import InvalidRequest, SamplingParams
from spectrio.core.record import pack_step_record
from spectrio.errors import EngineDead
from spectrio.runtime.api import RequestStream, Runtime
from spectrio.wire.admission import (
    MAX_TOKENIZING,
    MAX_TOKENIZING_PER_CLIENT,
    MIN_MESSAGE_BYTES,
    PendingPrompt,
    PromptQueue,
    PromptTokenizer,
    RateLimiter,
    check_length,
    message_cap,
)
from spectrio.wire.codec import (
    DEFAULT_MAX_REQUEST_BYTES,
    SequenceCounter,
    WireError,
    decode_request,
    encode,
    encode_step,
)
from spectrio.wire.curve import ZAP_ENDPOINT, CurveServerKeys, run_zap_handler
from spectrio.wire.endpoints import (
    LOCK_FILE,
    EndpointClaim,
    EndpointRefused,
    ServerEndpoints,
    ServerRunning,
    check_endpoint,
    claim_endpoints,
    default_endpoints,
)
from spectrio.wire.schema import (
    Abort,
    Ack,
    Error,
    ErrorCode,
    Info,
    ModelInfo,
    Ping,
    SpeculativeInfo,
    Submit,
)
from spectrio.wire.zmq_transport import TrioSocket, open_socket

__all__ = [
    "DEFAULT_FINISH_S",
    "LOCK_FILE",
    "MAX_TOKENIZING",
    "MAX_TOKENIZING_PER_CLIENT",
    "MIN_MESSAGE_BYTES",
    "EndpointClaim",
    "EndpointRefused",
    "PromptTokenizer",
    "ServerEndpoints",
    "ServerRunning",
    "ServerStats",
    "WireServer",
    "check_endpoint",
    "claim_endpoints",
    "default_endpoints",
    "message_cap",
    "model_info",
    "serve",
]

log = structlog.get_logger("spectrio.server")

T = TypeVar("T")

Context = zmq.Context[zmq.Socket[bytes]]

DEFAULT_FINISH_S: Final = 3.0
"""Seconds :meth:`WireServer.drain` spends, after the grace period, on aborting what still
runs, publishing the abort step and handing the last messages to the consumer."""

ABORT_REASON: Final = "aborted by client"
"""The runtime's abort reason for an ``Abort`` request (logs; the wire says ``"abort"``)."""


# ---- serving ------------------------------------------------------------------------------


def model_info(runtime: Runtime, tokenizer_json: str) -> ModelInfo:
    """The ``Info`` reply for ``runtime`` (without the tokenizer's JSON)."""
    spec = runtime.config.speculative
    data = tokenizer_json.encode("utf-8")
    return ModelInfo(
        model=runtime.config.model,
        vocab_size=runtime.loaded.config.vocab_size,
        max_model_len=runtime.config.max_model_len,
        eos_token_id=runtime.tokenizer.eos_token_id,
        speculative=SpeculativeInfo(
            method=spec.method,
            num_speculative_tokens=spec.num_speculative_tokens,
            num_model_steps=spec.num_model_steps,
            adaptive=spec.adaptive,
            prompt_lookup_max=spec.prompt_lookup_max,
            prompt_lookup_min=spec.prompt_lookup_min,
        ),
        tokenizer_sha256=hashlib.sha256(data).hexdigest(),
        tokenizer_bytes=len(data),
        chat_template=runtime.chat_template is not None,
    )


class ServerStats(msgspec.Struct, kw_only=True):
    """Counters, for logs and tests."""

    requests: int = 0  # frames received on the request socket
    acks: int = 0
    errors: dict[str, int] = msgspec.field(default_factory=dict)  # ErrorCode value -> count
    dropped_frames: int = 0  # messages with no usable reply address
    replies_dropped: int = 0  # replies dropped because their client's queue was full (not reading)
    unreplied: int = 0  # replies that could not be delivered: the client was gone
    infos: int = 0  # Info requests answered
    prompts_tokenized: int = 0  # text prompts handed to the tokenizer
    steps_published: int = 0  # step messages handed to the PUSH socket
    tap_dropped: int = 0  # step messages the tap dropped
    request_failures: int = 0  # accepted requests that failed inside the runtime
    max_backlog: int = 0  # largest output backlog seen, in steps


class WireServer:
    """The state shared by the owner tasks. Create it through :func:`serve`."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        max_request_bytes: int,
        output_high_water: int,
        tap_buffer: int,
        rate: float | None = None,
        burst: int = 64,
        curve: bool = False,
        tap: bool = False,
    ) -> None:
        self.runtime = runtime
        self._limits = RateLimiter(rate, burst)
        self._curve = curve
        self.stats = ServerStats()
        self._max_request_bytes = max_request_bytes
        self._high_water = output_high_water
        self._counter = SequenceCounter()
        self._backlog: collections.deque[list[bytes]] = collections.deque()
        self._backlog_changed = trio.Event()
        self._steps_queued = 0  # steps appended to the backlog, ever
        self._tap_tx, self._tap_rx = trio.open_memory_channel[list[bytes]](tap_buffer)
        self._tap_enabled = tap
        tokenizer = PromptTokenizer(runtime)
        self._info = model_info(runtime, tokenizer.json)
        self._prompts = PromptQueue(
            tokenizer,
            vocab_size=runtime.loaded.config.vocab_size,
            max_model_len=runtime.config.max_model_len,
            chat=runtime.chat_prompt,
        )
        self._running: dict[str, bytes] = {}  # acknowledged request id -> its owner
        self._finished = trio.Event()  # replaced each time a request task ends
        self._replies: collections.deque[list[bytes]] = collections.deque()
        self._reply_waiter: trio.CancelScope | None = None
        self._closing = False
        self._linger_s = 0.0  # how long the PUSH socket may keep unsent steps on close
        self.endpoints: ServerEndpoints | None = None  # set once bound
        self._last_step = 0  # the step number of the last step queued
        # Requests whose stream ended with the engine's death, before their final step:
        # the death step (:meth:`publish_engine_death`) ends them for the consumer.
        self._lost: dict[str, None] = {}
        self._dead: EngineDead | None = None
        #: set once the engine's death has been published (or there was nothing to say)
        self.death_published = trio.Event()

    @property
    def closing(self) -> bool:
        """Whether the server has stopped taking requests (:meth:`close`, :meth:`drain`)."""
        return self._closing

    @property
    def linger_s(self) -> float:
        """Seconds the PUSH socket may keep unsent step messages when it closes: what
        :meth:`drain` left of its finish budget (0 before a drain)."""
        return self._linger_s

    def close(self) -> None:
        """Stop taking requests (``unavailable`` from now on) and release a publisher held
        by :meth:`on_step`. Called by :func:`serve` on exit; safe to call twice."""
        self._closing = True
        self._wake()

    # ---- output side ----------------------------------------------------------------

    async def on_step(self, published: PublishedStep) -> None:
        """Record sink: encode the step, queue it for the output owner task, then hold the
        publisher (and with it the pipeline) while more than ``output_high_water`` steps
        wait for the consumer. Returns at once after the server starts closing."""
        self._queue_step(published)
        while len(self._backlog) > self._high_water and not self._closing:
            await self._backlog_changed.wait()

    def _queue_step(self, published: PublishedStep, errors: Sequence[Error] = ()) -> None:
        seqnos = self._counter.advance(published)
        frames = encode_step(published, seqnos, errors)
        self._last_step = max(self._last_step, published.step)
        self._backlog.append(frames)
        self._steps_queued += 1
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

    async def drain(
        self,
        grace_s: float,
        *,
        cut: trio.Event | None = None,
        finish_s: float = DEFAULT_FINISH_S,
    ) -> bool:
        """Shut down without losing an accepted request. Stop admitting requests (new
        submits, and prompts still being tokenized, get ``unavailable``); let the running
        ones finish for up to ``grace_s`` seconds, or until ``cut`` is set (a second
        signal); then, within ``finish_s`` more seconds whatever happens, abort the rest
        with reason ``shutdown``, wait for the runtime to publish their abort step and hand
        every queued step to the PUSH socket, which keeps unsent messages for what remains
        of ``finish_s`` when it closes. Returns True when every request finished on its
        own and everything was handed over; cancel :func:`serve` afterwards."""
        self.close()  # a publisher held by on_step returns now
        self._prompts.cancel_all()
        with trio.move_on_after(grace_s):
            async with trio.open_nursery() as grace:
                if cut is not None:
                    grace.start_soon(_cancel_when_set, cut, grace.cancel_scope)
                while self._running:
                    await self._finished.wait()
                grace.cancel_scope.cancel()
        deadline = trio.current_time() + finish_s
        cut_ids = sorted(self._running)
        with trio.move_on_at(deadline):
            for rid in cut_ids:
                await self.runtime.abort(rid, "shutdown")
            await self.runtime.wait_idle()  # the abort step carries -9 for each of them
            while self._running:
                await self._finished.wait()
            while self._backlog:
                await self._backlog_changed.wait()
        self._linger_s = max(0.0, deadline - trio.current_time())
        clean = not cut_ids and not self._running and not self._backlog
        log.info(
            "drained" if clean else "drained with aborts",
            aborted=len(cut_ids),
            running=len(self._running),
            backlog=len(self._backlog),
        )
        return clean

    async def watch_engine(self, finish_s: float = DEFAULT_FINISH_S) -> None:
        """When the engine dies, tell every consumer: :meth:`publish_engine_death`."""
        await self.publish_engine_death(await self.runtime.wait_dead(), finish_s)

    async def publish_engine_death(
        self, exc: EngineDead, finish_s: float = DEFAULT_FINISH_S
    ) -> None:
        """The engine is dead: stop taking requests (``unavailable``, the reason naming the
        stage), and publish one last step in which every request still open ends with
        ``finish_reason="abort"`` (a ``-9`` slot) and an ``unavailable`` error in the
        envelope's ``errors``, whose reason starts with ``engine_dead``. Returns once that
        step is handed to the PUSH socket, or after ``finish_s`` seconds; the socket then
        keeps it for what remains of them when it closes."""
        self._dead = exc
        deadline = trio.current_time() + finish_s
        self._prompts.cancel_all()  # prompts being tokenized get unavailable
        with trio.move_on_at(deadline):
            while self._running:  # every stream has the death; wait for them to see it
                await self._finished.wait()
            ids = sorted(self._lost)
            if ids:
                reason = engine_dead_reason(exc)
                errors = [
                    Error(code=ErrorCode.UNAVAILABLE, reason=reason, request_id=r) for r in ids
                ]
                self._queue_step(death_step(self._last_step + 1, ids), errors)
                self.stats.errors[ErrorCode.UNAVAILABLE.value] = self.stats.errors.get(
                    ErrorCode.UNAVAILABLE.value, 0
                ) + len(ids)
            log.error("engine dead: open requests aborted", requests=len(ids), cause=str(exc))
            while self._backlog:
                await self._backlog_changed.wait()
        self._closing = True
        self._wake()
        self._linger_s = max(0.0, deadline - trio.current_time())
        self.death_published.set()

    # ---- request side ---------------------------------------------------------------

    def _error(self, code: ErrorCode, reason: str, request_id: str | None) -> Error:
        self.stats.errors[code.value] = self.stats.errors.get(code.value, 0) + 1
        return Error(code=code, reason=reason, request_id=request_id)

    def _reply(self, envelope: Sequence[bytes], reply: Ack | Error | ModelInfo) -> None:
        """Queue a reply for the request owner task, from any task; never waits."""
        if isinstance(reply, Ack):
            self.stats.acks += 1
        elif isinstance(reply, ModelInfo):
            self.stats.infos += 1
        self._replies.append([*envelope, encode(reply)])
        if self._reply_waiter is not None:
            self._reply_waiter.cancel()

    def _flush_replies(self, sock: TrioSocket) -> None:
        """Send the queued replies without waiting: a client whose queue is full (it does
        not read) loses this reply, and nobody else waits for it."""
        while self._replies:
            frames = self._replies.popleft()
            try:
                if not sock.try_send_multipart(frames):
                    self.stats.replies_dropped += 1
                    log.debug("reply dropped: the client is not reading its replies")
            except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the client is gone
                self.stats.unreplied += 1
                log.debug("reply undeliverable", error=str(exc))

    async def _unless_reply(self, wait: Callable[[], Awaitable[T]]) -> T | None:
        """Await ``wait()``, or return None as soon as a reply is queued to be sent.
        ``wait`` must be cancel-safe (a socket receive is: it consumes nothing)."""
        with trio.CancelScope() as scope:
            self._reply_waiter = scope
            if self._replies:
                scope.cancel()
            try:
                return await wait()
            finally:
                self._reply_waiter = None
        return None

    async def run_requests(self, sock: TrioSocket, nursery: trio.Nursery) -> None:
        """The ROUTER's owner task: send queued replies, read one request, answer it."""
        while True:
            self._flush_replies(sock)
            frames = await self._unless_reply(sock.recv_frames)
            if frames is None:
                continue
            self.stats.requests += 1
            # Admission control: hold this request (and read no more) while the consumer
            # lags; replies already queued still go out.
            while len(self._backlog) > self._high_water and not self._closing:
                self._flush_replies(sock)
                await self._unless_reply(self._backlog_changed.wait)
            await self._dispatch(frames, nursery)

    def _owner(self, frames: list[zmq.Frame]) -> bytes:
        """Who sent a request: its CURVE public key when a ZAP handler named it, else its
        ROUTER identity (a new one per connection, which a client cannot choose to be
        another's: libzmq's own identities start with a zero byte, which it refuses from
        clients)."""
        if self._curve:
            try:
                user = frames[-1].get("User-Id")
            except zmq.ZMQError:  # no ZAP handler answered for this connection
                user = None
            if user:
                return b"key:" + str(user).encode()
        return b"peer:" + frames[0].bytes

    async def _dispatch(self, frames: list[zmq.Frame], nursery: trio.Nursery) -> None:
        """Split the routing envelope from the body and answer (now, or once a text
        prompt is tokenized or an abort is done).

        Framings (``docs/wire.md``, *Framing*): ``[body]`` from a DEALER, ``["", body]``
        from a REQ (an empty delimiter frame first). The reply repeats the delimiter when
        the request had one, so a REQ socket reads it as its reply. Anything else after
        the delimiter, or more than one frame, gets ``bad_frame``."""
        if len(frames) < 2 or not frames[0].bytes:
            self._error(ErrorCode.BAD_FRAME, "no routing identity", None)
            self.stats.dropped_frames += 1
            return
        split = 2 if len(frames) >= 3 and frames[1].bytes == b"" else 1
        envelope = [f.bytes for f in frames[:split]]
        body = frames[split:]
        owner = self._owner(frames)
        if not self._limits.admit(owner, trio.current_time()):
            self._reply(
                envelope,
                self._error(
                    ErrorCode.RATE_LIMITED,
                    f"over {self._limits.rate} requests/s; retry later",
                    None,
                ),
            )
            return
        if len(body) != 1:
            self._reply(
                envelope,
                self._error(ErrorCode.BAD_FRAME, f"a request is one frame, got {len(body)}", None),
            )
            return
        try:
            reply = await self._handle(body[0].buffer, owner, envelope, nursery)
        except WireError as exc:
            reply = self._error(exc.code, exc.reason, exc.request_id)
        if reply is not None:
            self._reply(envelope, reply)

    async def _handle(
        self, body: memoryview, owner: bytes, envelope: list[bytes], nursery: trio.Nursery
    ) -> Ack | Error | ModelInfo | None:
        msg = decode_request(body, self._max_request_bytes)  # the size cap comes first
        if isinstance(msg, Ping):
            return Ack(of="ping")
        if isinstance(msg, Info):  # answered while shutting down too, like a ping
            return self._info_reply(msg)
        if self._dead is not None:
            raise WireError(ErrorCode.UNAVAILABLE, engine_dead_reason(self._dead), msg.request_id)
        if self._closing:
            raise WireError(ErrorCode.UNAVAILABLE, "the server is shutting down", msg.request_id)
        if isinstance(msg, Submit):
            return await self._submit(msg, owner, envelope, nursery)
        assert isinstance(msg, Abort)
        self._abort(msg, owner, envelope, nursery)
        return None  # the Ack follows once the runtime has aborted the request

    def _info_reply(self, msg: Info) -> ModelInfo:
        if not msg.tokenizer:
            return self._info
        return msgspec.structs.replace(self._info, tokenizer_json=self._prompts.tokenizer.json)

    async def _submit(
        self, msg: Submit, owner: bytes, envelope: list[bytes], nursery: trio.Nursery
    ) -> Ack | None:
        rid = msg.request_id
        check_length(
            msg,
            max_model_len=self.runtime.config.max_model_len,
            max_token_bytes=self._prompts.tokenizer.max_token_bytes,
        )
        if rid in self._running or rid in self._prompts:
            raise WireError(
                ErrorCode.DUPLICATE_REQUEST, f"request_id {rid!r} is still running", rid
            )
        if isinstance(msg.prompt, str) or msg.messages is not None:
            pending = self._prompts.reserve(msg, owner)
            nursery.start_soon(self._tokenize_then_start, msg, pending, envelope, nursery)
            return None  # the reply follows once the prompt is tokenized
        await self._start(msg, owner, *self._prompts.check(msg), nursery)
        return Ack(of="submit", request_id=rid)

    async def _tokenize_then_start(
        self, msg: Submit, pending: PendingPrompt, envelope: list[bytes], nursery: trio.Nursery
    ) -> None:
        rid = msg.request_id
        reply: Ack | Error
        started = False
        try:
            self.stats.prompts_tokenized += 1
            prepared = await self._prompts.tokenize(msg, pending)
            if prepared is None or self._closing:
                reply = self._error(ErrorCode.UNAVAILABLE, "the server is shutting down", rid)
            else:
                await self._start(msg, pending.owner, *prepared, nursery)
                started = True
                reply = Ack(of="submit", request_id=rid)
        except WireError as exc:
            reply = self._error(exc.code, exc.reason, exc.request_id)
        finally:
            self._prompts.done(rid)
        aborted = started and bool(pending.aborts) and await self.runtime.abort(rid, ABORT_REASON)
        if aborted:
            await self._handed_over()
        self._reply(envelope, reply)
        for abort_envelope in pending.aborts:
            self._reply(abort_envelope, self._abort_reply(rid, aborted))

    async def _start(
        self,
        msg: Submit,
        owner: bytes,
        prompt_ids: list[int],
        params: SamplingParams,
        nursery: trio.Nursery,
    ) -> None:
        """Hand the request to the runtime, so that once this returns it is running
        there (``runtime.abort`` finds it), and follow its stream in a task of its own.
        ``params`` are the request's, with a chat's end-of-turn tokens added. A refusal
        by the runtime is the ``Error`` reply, never a failure after an ``Ack``."""
        rid = msg.request_id
        self._running[rid] = owner
        try:
            stream = self.runtime.generate(
                prompt_ids, params, request_id=rid, cache_salt=msg.cache_salt
            )
            await stream.__aenter__()  # submits it, for a runtime that submits on entry
        except InvalidRequest as exc:
            self._running.pop(rid, None)
            self.stats.request_failures += 1
            raise WireError(ErrorCode(exc.code), str(exc), rid) from None
        except BaseException:
            self._running.pop(rid, None)
            raise
        nursery.start_soon(self._follow, rid, stream)

    async def _follow(self, rid: str, stream: RequestStream) -> None:
        """Read a request's stream to its end; its output reaches consumers through the
        record sink, not through here."""
        try:
            async for _ in stream:
                pass
        except EngineDead:
            self._lost[rid] = None  # no final step reached the consumer: the death step
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()
            self._running.pop(rid, None)
            self._finished.set()
            self._finished = trio.Event()

    def _abort(
        self, msg: Abort, owner: bytes, envelope: list[bytes], nursery: trio.Nursery
    ) -> None:
        """Abort a request of this client's; the ``Ack`` is sent once the runtime has
        aborted it, so no token of it is published after the ``Ack``. A request of
        another client's is reported exactly like one that does not exist, so ids of
        others are not revealed."""
        rid = msg.request_id
        pending = self._prompts.get(rid)
        if pending is not None and pending.owner == owner:
            pending.aborts.append(envelope)
            return
        if self._running.get(rid) != owner:
            raise WireError(ErrorCode.UNKNOWN_REQUEST, f"request_id {rid!r} is not running", rid)
        nursery.start_soon(self._abort_then_reply, rid, envelope)

    async def _abort_then_reply(self, rid: str, envelope: list[bytes]) -> None:
        aborted = await self.runtime.abort(rid, ABORT_REASON)
        await self._handed_over()
        self._reply(envelope, self._abort_reply(rid, aborted))

    async def _handed_over(self) -> None:
        """Wait until every step queued so far is handed to the PUSH socket, so that
        the step messages with a request's last tokens leave before the reply that says
        there are no more (with a consumer that does not read, the reply waits too)."""
        target = self._steps_queued
        while self.stats.steps_published < target and not self._closing:
            await self._backlog_changed.wait()

    def _abort_reply(self, rid: str, aborted: bool) -> Ack | Error:
        if aborted:
            return Ack(of="abort", request_id=rid)
        # It finished (or was refused) first: its last step has its own finish reason.
        return self._error(
            ErrorCode.UNKNOWN_REQUEST, f"request_id {rid!r} finished before the abort", rid
        )


def engine_dead_reason(exc: EngineDead) -> str:
    """The reason every open request's error carries when the engine dies."""
    return f"engine_dead: {exc}"


def death_step(step: int, request_ids: Sequence[str]) -> PublishedStep:
    """The step that ends ``request_ids`` because the engine died: each an aborted (``-9``)
    slot with no tokens and ``finish_reason="abort"``. No drafts totals: the counts died
    with the engine."""
    n = len(request_ids)
    zeros = np.zeros(n, dtype=np.int64)
    record = pack_step_record(
        np.zeros((n, 1), dtype=np.int64), zeros, np.ones(n, dtype=bool), zeros, zeros
    )
    return PublishedStep(
        step=step, request_ids=list(request_ids), finish_reasons=["abort"] * n, record=record
    )


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def serve(
    runtime: Runtime,
    requests_endpoint: str,
    outputs_endpoint: str,
    tap_endpoint: str | None = None,
    *,
    rank: int = 0,
    allow_public: bool = False,
    context: Context | None = None,
    claim: EndpointClaim | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_message_bytes: int | None = None,
    output_high_water: int = 256,
    tap_buffer: int = 1024,
    max_requests_per_s: float | None = None,
    request_burst: int = 64,
    curve: CurveServerKeys | None = None,
    task_status: trio.TaskStatus[WireServer | None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``runtime`` over ZeroMQ until cancelled. Use with ``nursery.start`` to get
    the running :class:`WireServer` (its ``endpoints`` and ``stats``); None on a rank other
    than 0, which binds nothing.

    Endpoints must pass the endpoint policy (:func:`check_endpoint`; ``allow_public`` for
    anything beyond this machine, with a warning when CURVE is off). ``ipc://`` run
    directories are locked (:func:`claim_endpoints`); pass ``claim`` when the caller
    claimed the endpoints already (the CLI does, before loading the model), else serve
    claims them and releases them on exit.

    ``max_request_bytes`` is the largest request frame the server reads; a larger one
    gets ``too_large``. ``max_message_bytes`` (``zmq.MAXMSGSIZE``; default
    :func:`message_cap`, at least 16 MiB) is the transport's limit: libzmq disconnects a
    peer whose message is larger, without a reply, before the server sees it. It must be
    larger than ``max_request_bytes``.

    ``max_requests_per_s`` caps each client (by CURVE key or ROUTER identity) with a
    token bucket of ``request_burst``; a request over the cap gets ``rate_limited``.

    On cancellation, running requests are aborted (the runtime ends their streams with
    ``finish_reason="abort"``) and the sockets close; after :meth:`WireServer.drain`, the
    PUSH socket keeps unsent steps for what remains of the drain's finish budget.
    """
    if rank != 0:
        log.info("not rank 0: no sockets bound", rank=rank)
        task_status.started(None)
        await trio.sleep_forever()
    own_claim = claim is None
    if claim is None:
        claim = claim_endpoints(
            requests_endpoint, outputs_endpoint, tap_endpoint, allow_public=allow_public
        )
    cap = message_cap(max_request_bytes, max_message_bytes)
    ctx = context if context is not None else zmq.Context.instance()
    socks: list[TrioSocket] = []
    out: TrioSocket | None = None
    server: WireServer | None = None
    try:
        server = WireServer(
            runtime,
            max_request_bytes=max_request_bytes,
            output_high_water=output_high_water,
            tap_buffer=tap_buffer,
            rate=max_requests_per_s,
            burst=request_burst,
            curve=curve is not None,
            tap=tap_endpoint is not None,
        )
        zap: TrioSocket | None = None
        if curve is not None:
            try:
                zap = open_socket(ctx, zmq.REP, bind=ZAP_ENDPOINT, max_msg_size=None)
                socks.append(zap)
            except zmq.ZMQError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                log.warning(
                    "this context has a ZAP handler already; aborts are scoped to "
                    "the User-Id it sets, else to the connection"
                )
        configure = curve.apply if curve is not None else None  # encrypts every socket
        opened = functools.partial(open_socket, ctx, configure=configure, allow_public=allow_public)
        req = opened(zmq.ROUTER, bind=requests_endpoint, max_msg_size=cap)
        socks.append(req)
        out = opened(zmq.PUSH, bind=outputs_endpoint, max_msg_size=None)
        socks.append(out)
        tap: TrioSocket | None = None
        if tap_endpoint is not None:
            tap = opened(zmq.PUB, bind=tap_endpoint, max_msg_size=None)
            socks.append(tap)
        bound = ServerEndpoints(
            requests=req.socket.getsockopt_string(zmq.LAST_ENDPOINT),
            outputs=out.socket.getsockopt_string(zmq.LAST_ENDPOINT),
            tap=tap.socket.getsockopt_string(zmq.LAST_ENDPOINT) if tap is not None else None,
        )
        server.endpoints = bound
        if claim.public and curve is None:
            log.warning(
                "serving beyond this machine without CURVE: anyone who can connect "
                "can submit requests and read every output (see `spectrio keys`)",
                requests=bound.requests,
                outputs=bound.outputs,
                tap=bound.tap,
            )
        remove = runtime.add_record_sink(server.on_step)
        try:
            async with trio.open_nursery() as nursery:
                if zap is not None:
                    nursery.start_soon(run_zap_handler, zap)
                nursery.start_soon(server.run_outputs, out)
                if tap is not None:
                    nursery.start_soon(server.run_tap, tap)
                nursery.start_soon(server.run_requests, req, nursery)
                nursery.start_soon(server.watch_engine)
                log.info(
                    "serving",
                    requests=bound.requests,
                    outputs=bound.outputs,
                    tap=bound.tap,
                    max_request_bytes=max_request_bytes,
                )
                task_status.started(server)
        finally:
            server.close()  # a publisher held by on_step returns now
            remove()
            log.info("server stopped", **msgspec.structs.asdict(server.stats))
    finally:
        linger_ms = int(server.linger_s * 1000) if server is not None else 0
        for sock in socks:
            sock.close(linger=linger_ms if sock is out else 0)
        if own_claim:
            claim.release()
