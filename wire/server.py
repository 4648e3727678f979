"""ZeroMQ endpoints for a running :class:`~spectrio.runtime.api.Runtime` (wire schema v1,
``docs/wire.md``).

Three sockets, each driven by exactly one owner task (and a supervisor task that ends
the requests of destinations that stopped reading):

* **requests** (ROUTER): every frame is untrusted. It is decoded with
  :func:`spectrio.wire.codec.decode_request` (the size cap comes first) and checked with
  :func:`~spectrio.wire.codec.check_submit`; every request gets an ``Ack`` or an
  ``Error`` with a specific code. A valid ``Submit`` runs ``runtime.generate`` in a task of
  its own; its output reaches consumers only through the step stream.
* **streams** (on the requests socket, schema 1.7): a ``Submit`` with ``stream`` gets
  the request's step messages back on the connection that sent it, after its ``Ack``:
  each client reads its own, sliced from the step to its requests
  (:func:`spectrio.wire.codec.slice_step`), in order and complete, and any number of
  clients share one server.
* **outputs** (PUSH): one ``[envelope, record]`` message per step for the requests
  submitted without ``stream``, with per-request sequence numbers
  (:class:`~spectrio.wire.codec.SequenceCounter`). PUSH deals messages round-robin, so it
  serves one consumer process. A step with none of these requests is not sent there.
* **tap** (PUB, optional): every step, whole, for observers. It drops when a subscriber
  is slow or when its bounded buffer is full; sequence numbers make the gap visible.

Nothing a client does makes the request task wait on that client:

* Replies are queued on the client's connection, behind its step messages, and sent
  without waiting. A client that does not read fills its own queue; once that holds
  ``output_high_water`` messages its replies are dropped and counted
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

No consumer holds another. The server is a record sink of the runtime
(``add_record_sink``) that never waits: it slices each step to the destinations that
have requests in it and queues one message for each in that destination's
:class:`~spectrio.wire.outbox.Outbox` (a client connection, or the PUSH socket). HTTP and
in-process requests never reach a wire socket. A destination that does not read falls
behind alone: once its oldest queued message has waited ``output_stall_s`` seconds (or
``output_high_water`` messages are queued), the server aborts its running requests
(their final step carries an ``output_stalled`` error, and their KV blocks are freed);
once nothing of it runs and it has still read nothing for 3 times ``output_stall_s``
more, its messages are dropped and counted. A connection found closed (a send to its
routing id fails) is ended at once when libzmq chose the id, after
:data:`~spectrio.wire.outbox.RECONNECT_S` when its client did. Every other client, the
HTTP front and the embedding API go on as before.

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
import itertools
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, TypeVar

import msgspec
import numpy as np
import structlog
import trio
import zmq

from spectrio.core.messages import PublishedStep
from spectrio.core.notifier import Notifier
from spectrio.core.params import InvalidRequest, SamplingParams
from spectrio.core.record import unpack
from spectrio.cuda_kernels.reference import pack_step_record
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
    slice_step,
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
from spectrio.wire.outbox import RECONNECT_S, Outbox
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
    "PUSH",
    "EndpointClaim",
    "EndpointRefused",
    "PromptTokenizer",
    "ServerEndpoints",
    "ServerRunning",
    "ServerStats",
    "WireServer",
    "check_endpoint",
    "check_output_bounds",
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
            draft_model=spec.draft_model,
            draft_layers=spec.draft_layers,
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
    steps_published: int = 0  # step messages handed to a socket (PUSH or a client's connection)
    steps_dropped: int = 0  # step messages dropped with an abandoned destination
    tap_dropped: int = 0  # step messages the tap dropped
    request_failures: int = 0  # accepted requests that failed inside the runtime
    requests_stalled: int = 0  # requests ended because their outputs were not read
    clients_gone: int = 0  # connections that closed with requests or messages of theirs left
    max_backlog: int = 0  # most messages one destination had queued at once


PUSH: Final = b""
"""The destination key of the shared PUSH outputs socket (a ROUTER routing id is never
empty, so it cannot collide with a client's)."""

RETRY_S: Final = 0.01
"""How often a destination whose socket refused a message (its queue is full, or the
PUSH socket has no reader) is tried again: libzmq says when a socket may send, not when
one ROUTER peer may."""

STALL_REASON: Final = "outputs not read"
"""The runtime's abort reason for a request ended because its outputs stalled (logs)."""

MAX_ENDED: Final = 4096
"""Requests ended for stalled outputs that an ``Abort`` from their owner can still ask
about (the oldest are forgotten first)."""


class WireServer:
    """The state shared by the owner tasks. Create it through :func:`serve`."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        max_request_bytes: int,
        output_high_water: int,
        tap_buffer: int,
        output_stall_s: float = 10.0,
        rate: float | None = None,
        burst: int = 64,
        curve: bool = False,
        tap: bool = False,
    ) -> None:
        check_output_bounds(output_high_water, output_stall_s)
        self.runtime = runtime
        self._limits = RateLimiter(rate, burst)
        self._curve = curve
        self.stats = ServerStats()
        self._max_request_bytes = max_request_bytes
        self._high_water = output_high_water
        self._stall_s = output_stall_s
        self._counter = SequenceCounter()
        # Destination (a client's routing id, or PUSH) -> its undelivered messages.
        self._outboxes: dict[bytes, Outbox] = {PUSH: self._new_outbox()}
        self._dest: dict[str, bytes] = {}  # wire request id -> its destination, to its final slot
        self._owners: dict[bytes, bytes] = {}  # routing id -> the owner that last used it
        self._closed_ids = itertools.count(1)
        self._stalled: dict[str, Error] = {}  # request ended for stalled outputs -> its error
        self._ended: collections.OrderedDict[str, tuple[bytes, Error]] = (
            collections.OrderedDict()
        )  # request ended for stalled outputs -> (its owner, the error), for Abort replies
        self._changed = Notifier()  # on every queue, send or drop
        self._supervise = trio.Event()  # wakes the supervisor early (a connection closed)
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
        self._finished = Notifier()  # each time a request task ends
        self._router_waiter: trio.CancelScope | None = None
        self._closing = False
        self._linger_s = 0.0  # how long the sockets may keep unsent messages on close
        self.endpoints: ServerEndpoints | None = None  # set once bound
        self._last_step = 0  # the step number of the last step queued
        # Requests whose stream ended with the engine's death, before their final step:
        # the death step (:meth:`publish_engine_death`) ends them for the consumer.
        self._lost: dict[str, None] = {}
        self._dead: EngineDead | None = None
        #: set once the engine's death has been published (or there was nothing to say)
        self.death_published = trio.Event()

    def _new_outbox(self) -> Outbox:
        return Outbox(limit=self._high_water, stall_s=self._stall_s)

    def _outbox(self, dest: bytes) -> Outbox:
        box = self._outboxes.get(dest)
        if box is None:
            box = self._outboxes[dest] = self._new_outbox()
        return box

    @property
    def closing(self) -> bool:
        """Whether the server has stopped taking requests (:meth:`close`, :meth:`drain`)."""
        return self._closing

    @property
    def linger_s(self) -> float:
        """Seconds the sockets may keep unsent messages when they close: what
        :meth:`drain` left of its finish budget (0 before a drain)."""
        return self._linger_s

    def close(self) -> None:
        """Stop taking requests (``unavailable`` from now on). Called by :func:`serve` on
        exit; safe to call twice."""
        self._closing = True
        self._wake()

    # ---- output side ----------------------------------------------------------------

    async def on_step(self, published: PublishedStep) -> None:
        """Record sink: queue the step for every destination with a request in it. Never
        waits (module docstring: no consumer holds another)."""
        self._route_step(published)

    def _route_step(self, published: PublishedStep, errors: Sequence[Error] = ()) -> None:
        """Slice ``published`` to each destination's requests and queue one message for
        each; the whole step goes to the tap. ``errors`` name requests the step ends with
        an error (the engine's death); requests ended for stalled outputs get theirs."""
        record = unpack(published.record)  # once, for the counter and every slice
        seqnos = self._counter.advance(published, record)
        self._last_step = max(self._last_step, published.step)
        errs = {e.request_id: e for e in errors}
        slots: dict[bytes, list[int]] = {}
        for i, (rid, reason) in enumerate(
            zip(published.request_ids, published.finish_reasons, strict=True)
        ):
            dest = self._dest.get(rid)
            if dest is None:
                continue  # not a wire request: HTTP or in-process
            slots.setdefault(dest, []).append(i)
            if reason is not None or rid in errs:  # its final slot
                del self._dest[rid]
                stalled = self._stalled.pop(rid, None)
                if stalled is not None:
                    errs.setdefault(rid, stalled)
        now = trio.current_time()
        for dest, mine in slots.items():
            part = slice_step(published, mine, record)
            frames = encode_step(
                part,
                [seqnos[i] for i in mine],
                [errs[r] for r in part.request_ids if r in errs],
            )
            box = self._outbox(dest)
            box.push(frames, now)
            self.stats.max_backlog = max(self.stats.max_backlog, len(box))
        if self._tap_enabled:
            try:
                self._tap_tx.send_nowait(encode_step(published, seqnos, list(errs.values())))
            except trio.WouldBlock:
                self.stats.tap_dropped += 1
        if slots:
            self._wake()

    def _wake(self) -> None:
        """Something was queued, sent or dropped: wake the socket owners and waiters."""
        self._changed.notify()
        if self._router_waiter is not None:
            self._router_waiter.cancel()

    @property
    def backlog(self) -> int:
        """Messages queued for any destination and not yet handed to its socket."""
        return sum(len(box) for box in self._outboxes.values())

    def outbox(self, dest: bytes = PUSH) -> Outbox | None:
        """The outbox of a destination (a client's routing id; PUSH by default), for tests
        and diagnostics."""
        return self._outboxes.get(dest)

    async def run_outputs(self, sock: TrioSocket) -> None:
        """The PUSH socket's owner task: hand its outbox's messages over, oldest first."""
        box = self._outboxes[PUSH]
        while True:
            frames = box.head()
            if frames is None:
                await self._changed.wait()
                continue
            if sock.try_send_multipart(frames):
                box.sent()
                self.stats.steps_published += 1
                self._wake()
                await trio.lowlevel.checkpoint()
                continue
            with trio.move_on_after(RETRY_S):  # no reader, or its queue is full
                await self._changed.wait()

    async def run_tap(self, sock: TrioSocket) -> None:
        async for frames in self._tap_rx:
            await sock.send_multipart(frames)  # PUB never blocks; it drops at its HWM

    def _flush_router(self, sock: TrioSocket) -> bool:
        """Hand every client's queued messages (replies and step messages, in order) to
        the ROUTER without waiting. Returns whether a client's queue was full, so the owner
        task tries again after :data:`RETRY_S`. A connection that closed, under a routing id
        libzmq assigned (which no later connection can have), is gone: its messages are
        dropped and the supervisor ends its requests."""
        blocked = False
        for dest, box in list(self._outboxes.items()):
            if dest == PUSH or box.gone:
                continue
            while (frames := box.head()) is not None:
                try:
                    if not sock.try_send_multipart([dest, *frames]):
                        blocked = True
                        break
                except zmq.ZMQError:  # EHOSTUNREACH: no connection with this routing id
                    if dest[:1] == b"\x00":
                        self._gone(dest, box)
                    else:  # a client-chosen routing id: it may reconnect
                        box.unreachable(trio.current_time())
                        blocked = True
                    break
                if _is_step(frames):
                    self.stats.steps_published += 1
                box.sent()
        return blocked

    def _gone(self, dest: bytes, box: Outbox) -> None:
        box.gone = True
        dropped = box.drop_all()
        self.stats.steps_dropped += dropped
        self.stats.clients_gone += 1
        running = sum(1 for d in self._dest.values() if d == dest)
        log.info("wire client gone", messages_dropped=dropped, requests=running)
        self._supervise.set()
        self._wake()

    async def run_supervisor(self) -> None:
        """End the requests of destinations that stopped reading, and forget destinations
        with nothing left (the bounds of :class:`~spectrio.wire.outbox.Outbox`)."""
        tick = min(0.25, self._stall_s / 4)
        while True:
            with trio.move_on_after(tick):
                await self._supervise.wait()
            self._supervise = trio.Event()
            await self._supervise_once(trio.current_time())

    async def _supervise_once(self, now: float) -> None:
        running: collections.Counter[bytes] = collections.Counter(self._dest.values())
        for dest, box in list(self._outboxes.items()):
            if box.stalled(now):
                ended = [
                    r
                    for r, d in self._dest.items()
                    if d == dest and r in self._running and r not in self._stalled
                ]
                if box.stalled_at is None or ended:
                    await self._end_stalled(dest, box, ended, now)
            if box.abandoned(now, running[dest]):
                dropped = box.drop_all()
                self.stats.steps_dropped += dropped
                log.warning(
                    "wire outputs dropped: nobody read them",
                    destination=_label(dest),
                    messages=dropped,
                )
                self._wake()
            if dest != PUSH and running[dest] == 0 and (box.gone or not box):
                del self._outboxes[dest]
                self._owners.pop(dest, None)

    async def _end_stalled(self, dest: bytes, box: Outbox, ended: list[str], now: float) -> None:
        """Abort the running requests of a destination that stopped reading; each one's
        final step carries an ``output_stalled`` error, and its owner can read the error
        by aborting it later (:meth:`_abort`)."""
        if box.stalled_at is None:
            box.stalled_at = now
        if box.gone:
            reason = "the connection that submitted it closed"
        elif box.unreachable_since is not None:
            reason = f"its connection closed and did not come back for {RECONNECT_S:g} s"
        elif box.full():
            reason = f"{len(box)} of its step messages were not read"
        else:
            reason = f"its step messages were not read for {box.waited(now):.1f} s"
        if ended:
            log.warning(
                "wire outputs stalled: ending their requests",
                destination=_label(dest),
                requests=len(ended),
                reason=reason,
            )
        for rid in ended:
            error = self._error(ErrorCode.OUTPUT_STALLED, f"ended: {reason}", rid)
            self._stalled[rid] = error
            self._ended[rid] = (self._running[rid], error)
            while len(self._ended) > MAX_ENDED:
                self._ended.popitem(last=False)
            self.stats.requests_stalled += 1
            await self.runtime.abort(rid, STALL_REASON)

    async def _all_handed_over(self) -> None:
        """Wait until every destination that reads has an empty queue (sent, or dropped):
        one that stalled, closed or is gone would hold the wait, and the sockets' linger
        that the readers' last messages need, until the deadline."""
        while True:
            now = trio.current_time()
            if not any(len(box) and not box.stalled(now) for box in self._outboxes.values()):
                return
            with trio.move_on_after(0.1):  # a queue may stall without any event
                await self._changed.wait()

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
        every queued message to its socket (the PUSH socket, or the client's connection),
        which keeps unsent messages for what remains of ``finish_s`` when it closes.
        Returns True when every request finished on its own and everything was handed
        over; cancel :func:`serve` afterwards."""
        self.close()
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
            await self._all_handed_over()
        self._linger_s = max(0.0, deadline - trio.current_time())
        clean = not cut_ids and not self._running and not self.backlog
        log.info(
            "drained" if clean else "drained with aborts",
            aborted=len(cut_ids),
            running=len(self._running),
            backlog=self.backlog,
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
        step is handed to every destination's socket, or after ``finish_s`` seconds; the
        sockets then keep it for what remains of them when they close."""
        self._dead = exc
        deadline = trio.current_time() + finish_s
        self._prompts.cancel_all()  # prompts being tokenized get unavailable
        with trio.move_on_at(deadline):
            while self._running:  # every stream has the death; wait for them to see it
                await self._finished.wait()
            # Streams that saw the death, and requests whose abort step never went out.
            ids = sorted(set(self._lost) | set(self._dest))
            if ids:
                reason = engine_dead_reason(exc)
                errors = [
                    Error(code=ErrorCode.UNAVAILABLE, reason=reason, request_id=r) for r in ids
                ]
                self._route_step(death_step(self._last_step + 1, ids), errors)
                self.stats.errors[ErrorCode.UNAVAILABLE.value] = self.stats.errors.get(
                    ErrorCode.UNAVAILABLE.value, 0
                ) + len(ids)
            log.error("engine dead: open requests aborted", requests=len(ids), cause=str(exc))
            await self._all_handed_over()
        self._closing = True
        self._wake()
        self._linger_s = max(0.0, deadline - trio.current_time())
        self.death_published.set()

    # ---- request side ---------------------------------------------------------------

    def _error(self, code: ErrorCode, reason: str, request_id: str | None) -> Error:
        self.stats.errors[code.value] = self.stats.errors.get(code.value, 0) + 1
        return Error(code=code, reason=reason, request_id=request_id)

    def _reply(self, envelope: Sequence[bytes], reply: Ack | Error | ModelInfo) -> None:
        """Queue a reply on its client's connection, behind the step messages queued for
        it; from any task, never waits. A client whose queue is full (it reads nothing)
        loses the reply, and nobody else waits for it."""
        if isinstance(reply, Ack):
            self.stats.acks += 1
        elif isinstance(reply, ModelInfo):
            self.stats.infos += 1
        box = self._outbox(envelope[0])
        if box.gone:
            self.stats.unreplied += 1
            return
        if box.full():
            self.stats.replies_dropped += 1
            log.debug("reply dropped: the client is not reading its replies")
            return
        box.push([*envelope[1:], encode(reply)], trio.current_time())
        self._wake()

    async def _unless_woken(self, wait: Callable[[], Awaitable[T]], retry_s: float) -> T | None:
        """Await ``wait()``, or return None once something is queued for a client (or
        after ``retry_s`` seconds). ``wait`` must be cancel-safe (a socket receive is: it
        consumes nothing)."""
        with trio.move_on_after(retry_s), trio.CancelScope() as scope:
            self._router_waiter = scope
            try:
                return await wait()
            finally:
                self._router_waiter = None
        return None

    async def run_requests(self, sock: TrioSocket, nursery: trio.Nursery) -> None:
        """The ROUTER's owner task: hand the clients their replies and step messages, read
        one request, answer it."""
        while True:
            blocked = self._flush_router(sock)
            frames = await self._unless_woken(sock.recv_frames, RETRY_S if blocked else math.inf)
            if frames is None:
                continue
            self.stats.requests += 1
            await self._dispatch(frames, nursery)

    def _claim(self, dest: bytes, owner: bytes) -> None:
        """A routing id serves one owner. When a connection of another owner (another
        CURVE key) takes an id over (``ROUTER_HANDOVER``), nothing of the first owner's
        reaches it: the first owner's destination is closed (its requests are ended, its
        queue dropped) and the newcomer starts with an empty one."""
        before = self._owners.get(dest)
        self._owners[dest] = owner
        if before is None or before == owner:
            return
        closed = b"\x00closed:%d" % next(self._closed_ids)  # no routing id looks like it
        box = self._outboxes[closed] = self._new_outbox()
        box.gone = True
        for rid, d in self._dest.items():
            if d == dest:
                self._dest[rid] = closed
        old = self._outboxes.pop(dest, None)
        if old is not None:
            self.stats.steps_dropped += old.drop_all()
        self.stats.clients_gone += 1
        log.warning("a routing id was taken over by another client; the first one's requests end")
        self._supervise.set()

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
        self._claim(envelope[0], owner)
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
            await self._submit(msg, owner, envelope, nursery)
            return None  # the Ack is queued once the runtime has the request
        assert isinstance(msg, Abort)
        self._abort(msg, owner, envelope, nursery)
        return None  # the Ack follows once the runtime has aborted the request

    def _info_reply(self, msg: Info) -> ModelInfo:
        health = self.runtime.health()
        info = msgspec.structs.replace(
            self._info,
            healthy=health.ok,
            health=health.reason,
            output_stall_s=self._stall_s,
        )
        if not msg.tokenizer:
            return info
        return msgspec.structs.replace(info, tokenizer_json=self._prompts.tokenizer.json)

    def _destination(self, msg: Submit, envelope: list[bytes]) -> bytes:
        """Where a request's step messages go: back on its connection (``stream``), or to
        the PUSH socket. A destination that is not reading takes no new request."""
        rid = msg.request_id
        if msg.stream and len(envelope) != 1:
            raise WireError(
                ErrorCode.INVALID_FIELD,
                "stream: needs a DEALER socket; a REQ socket takes one reply per request",
                rid,
            )
        dest = envelope[0] if msg.stream else PUSH
        box = self._outboxes.get(dest)
        if box is not None and box.stalled(trio.current_time()):
            where = "this connection" if msg.stream else "the outputs socket"
            raise WireError(
                ErrorCode.RATE_LIMITED,
                f"the step messages queued for {where} are not being read; read them first",
                rid,
            )
        return dest

    async def _submit(
        self, msg: Submit, owner: bytes, envelope: list[bytes], nursery: trio.Nursery
    ) -> None:
        rid = msg.request_id
        check_length(
            msg,
            max_model_len=self.runtime.config.max_model_len,
            max_token_bytes=self._prompts.tokenizer.max_token_bytes,
        )
        self._check_unique(rid)
        if rid in self._prompts:
            raise WireError(
                ErrorCode.DUPLICATE_REQUEST, f"request_id {rid!r} is still running", rid
            )
        dest = self._destination(msg, envelope)
        if isinstance(msg.prompt, str) or msg.messages is not None:
            pending = self._prompts.reserve(msg, owner)
            nursery.start_soon(self._tokenize_then_start, msg, pending, envelope, dest, nursery)
            return  # the reply follows once the prompt is tokenized
        await self._start(msg, owner, envelope, dest, *self._prompts.check(msg), nursery)

    async def _tokenize_then_start(
        self,
        msg: Submit,
        pending: PendingPrompt,
        envelope: list[bytes],
        dest: bytes,
        nursery: trio.Nursery,
    ) -> None:
        rid = msg.request_id
        started = False
        try:
            self.stats.prompts_tokenized += 1
            prepared = await self._prompts.tokenize(msg, pending)
            if prepared is None or self._closing:
                raise WireError(ErrorCode.UNAVAILABLE, "the server is shutting down", rid)
            await self._start(msg, pending.owner, envelope, dest, *prepared, nursery)
            started = True
        except WireError as exc:
            self._reply(envelope, self._error(exc.code, exc.reason, exc.request_id))
        finally:
            self._prompts.done(rid)
        aborted = started and bool(pending.aborts) and await self.runtime.abort(rid, ABORT_REASON)
        if aborted:
            await self._handed_over(dest)
        for abort_envelope in pending.aborts:
            self._reply(abort_envelope, self._abort_reply(rid, aborted))

    def _check_unique(self, rid: str) -> None:
        """Refuse an id whose request runs, or whose final step message has not been
        routed yet (an aborted request's ``-9`` slot comes with the next step): its steps
        would go to the new request's destination."""
        if rid in self._running or rid in self._dest:
            raise WireError(
                ErrorCode.DUPLICATE_REQUEST, f"request_id {rid!r} is still running", rid
            )

    async def _start(
        self,
        msg: Submit,
        owner: bytes,
        envelope: list[bytes],
        dest: bytes,
        prompt_ids: list[int],
        params: SamplingParams,
        nursery: trio.Nursery,
    ) -> None:
        """Hand the request to the runtime and queue its ``Ack``, so that once this
        returns it is running there (``runtime.abort`` finds it) and its step messages go
        to ``dest``, behind the ``Ack``; then follow its stream in a task of its own.
        ``params`` are the request's, with a chat's end-of-turn tokens added. A refusal by
        the runtime is the ``Error`` reply (raised), never a failure after an ``Ack``."""
        rid = msg.request_id
        self._check_unique(rid)  # again: tokenizing may have spanned another's final step
        try:
            stream = self.runtime.generate(
                prompt_ids, params, request_id=rid, cache_salt=msg.cache_salt
            )
        except InvalidRequest as exc:
            self.stats.request_failures += 1
            raise WireError(ErrorCode(exc.code), str(exc), rid) from None
        except (EngineDead, RuntimeError) as exc:  # died before watch_engine noticed
            raise WireError(ErrorCode.UNAVAILABLE, engine_dead_reason(exc), rid) from None
        # Submitted: no step of it can be published before the next checkpoint, so the
        # Ack is queued ahead of its first step message.
        self._running[rid] = owner
        self._dest[rid] = dest
        self._reply(envelope, Ack(of="submit", request_id=rid))
        try:
            await stream.__aenter__()
        except BaseException:  # cancelled (shutdown): the stream aborted the request
            self._running.pop(rid, None)
            self._dest.pop(rid, None)
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
            self._finished.notify()

    def _abort(
        self, msg: Abort, owner: bytes, envelope: list[bytes], nursery: trio.Nursery
    ) -> None:
        """Abort a request of this client's; the ``Ack`` is sent once the runtime has
        aborted it, so no token of it is published after the ``Ack``. A request of
        another client's is reported exactly like one that does not exist, so ids of
        others are not revealed. A request the server ended because its outputs were not
        read gets that ``output_stalled`` error, to its owner only."""
        rid = msg.request_id
        pending = self._prompts.get(rid)
        if pending is not None and pending.owner == owner:
            pending.aborts.append(envelope)
            return
        if self._running.get(rid) != owner or rid in self._stalled:
            ended = self._ended.get(rid)
            if ended is not None and ended[0] == owner:
                error = ended[1]
                raise WireError(error.code, error.reason, rid)
            raise WireError(ErrorCode.UNKNOWN_REQUEST, f"request_id {rid!r} is not running", rid)
        nursery.start_soon(self._abort_then_reply, rid, envelope, self._dest.get(rid, PUSH))

    async def _abort_then_reply(self, rid: str, envelope: list[bytes], dest: bytes) -> None:
        aborted = await self.runtime.abort(rid, ABORT_REASON)
        await self._handed_over(dest)
        self._reply(envelope, self._abort_reply(rid, aborted))

    async def _handed_over(self, dest: bytes) -> None:
        """For a request whose steps go to the PUSH socket, wait until every step queued
        for it so far is handed over (or dropped), so that the step messages with a
        request's last tokens leave before the reply that says there are no more. A
        stream's reply is queued behind its steps on the same connection already."""
        if dest != PUSH:
            return
        box = self._outboxes[PUSH]
        target = box.handed_over + len(box)
        while box.handed_over < target and not self._closing:
            await self._changed.wait()

    def _abort_reply(self, rid: str, aborted: bool) -> Ack | Error:
        if aborted:
            return Ack(of="abort", request_id=rid)
        # It finished (or was refused) first: its last step has its own finish reason.
        return self._error(
            ErrorCode.UNKNOWN_REQUEST, f"request_id {rid!r} finished before the abort", rid
        )


def check_output_bounds(high_water: int, stall_s: float) -> None:
    """Refuse output bounds that cannot work (``ValueError`` naming the flag)."""
    if high_water < 1:
        raise ValueError(f"--output-high-water: must be >= 1, got {high_water}")
    if not (math.isfinite(stall_s) and stall_s > 0):
        raise ValueError(f"--output-stall-s: must be a finite number > 0, got {stall_s}")


def _label(dest: bytes) -> str:
    """A destination as the logs name it."""
    return "outputs socket" if dest == PUSH else "client"


def _is_step(frames: list[bytes]) -> bool:
    """Whether a queued message is a step message (``[envelope, record]``) rather than a
    reply (``[reply]``, or ``["", reply]`` to a REQ socket)."""
    return len(frames) == 2 and frames[0] != b""


def engine_dead_reason(exc: Exception) -> str:
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


def _router_handover(
    configure: Callable[[zmq.Socket[bytes]], None] | None,
) -> Callable[[zmq.Socket[bytes]], None]:
    def apply(sock: zmq.Socket[bytes]) -> None:
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if configure is not None:
            configure(sock)

    return apply


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
    output_high_water: int = 1024,
    output_stall_s: float = 10.0,
    output_sndhwm: int = 1000,
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

    Outputs (module docstring): each destination, a client's connection or the PUSH
    socket, queues at most ``output_high_water`` messages before its requests are ended,
    and the requests of one whose oldest message has waited ``output_stall_s`` seconds
    are ended (``output_stalled``). ``output_sndhwm`` is the libzmq queue of each
    connection (``SNDHWM``: messages handed over but not yet read), below the server's.

    ``max_requests_per_s`` caps each client (by CURVE key or ROUTER identity) with a
    token bucket of ``request_burst``; a request over the cap gets ``rate_limited``.

    On cancellation, running requests are aborted (the runtime ends their streams with
    ``finish_reason="abort"``) and the sockets close; after :meth:`WireServer.drain`, the
    sockets keep unsent messages for what remains of the drain's finish budget.
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
    req: TrioSocket | None = None
    server: WireServer | None = None
    try:
        server = WireServer(
            runtime,
            max_request_bytes=max_request_bytes,
            output_high_water=output_high_water,
            output_stall_s=output_stall_s,
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
        req = opened(
            zmq.ROUTER,
            bind=requests_endpoint,
            max_msg_size=cap,
            sndhwm=output_sndhwm,
            # A client that chose its routing id keeps its streams across a reconnect.
            configure=_router_handover(configure),
        )
        socks.append(req)
        out = opened(zmq.PUSH, bind=outputs_endpoint, max_msg_size=None, sndhwm=output_sndhwm)
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
        remove = runtime.add_record_sink(server.on_step, name="wire")
        try:
            async with trio.open_nursery() as nursery:
                if zap is not None:
                    nursery.start_soon(run_zap_handler, zap)
                nursery.start_soon(server.run_outputs, out)
                if tap is not None:
                    nursery.start_soon(server.run_tap, tap)
                nursery.start_soon(server.run_requests, req, nursery)
                nursery.start_soon(server.run_supervisor)
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
            server.close()
            remove()
            log.info("server stopped", **msgspec.structs.asdict(server.stats))
    finally:
        linger_ms = int(server.linger_s * 1000) if server is not None else 0
        for sock in socks:
            sock.close(linger=linger_ms if sock is out or sock is req else 0)
        if own_claim:
            claim.release()
