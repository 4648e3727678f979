"""The wire server's request side: the requests socket's owner task, admission, and each
request's task from its ``Ack`` to its final step, ``Info`` and ``Abort`` (``docs/wire.md``,
*Requests*)."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence

import msgspec
import trio
import zmq

from spectrio.core.params import InvalidRequest, SamplingParams
from spectrio.errors import EngineDead
from spectrio.runtime.api import RequestStream
from spectrio.wire.admission import (
    PendingPrompt,
    check_length,
)
from spectrio.wire.codec import (
    WireError,
    decode_request,
    encode,
)
from spectrio.wire.schema import (
    Abort,
    Ack,
    Error,
    ErrorCode,
    Info,
    ModelInfo,
    Ping,
    Submit,
)
from spectrio.wire.server_state import (
    ABORT_REASON,
    PUSH,
    RETRY_S,
    ServerState,
    T,
    engine_dead_reason,
    log,
)
from spectrio.wire.zmq_transport import TrioSocket


class RequestSide(ServerState):
    """Requests in from the clients (module docstring)."""

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
        """Wait for a request's end; its output reaches consumers through the record sink,
        so its stream is never read (nor detokenized) here."""
        try:
            await stream.wait_finished()
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
