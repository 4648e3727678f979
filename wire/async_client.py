"""The Trio wire client (:class:`AsyncClient`, made by :func:`open_client`). On a stream
connection (schema 1.7) one pump task owns the socket
(:mod:`spectrio.wire.stream_connection`) and matches each reply to its call; otherwise
each socket is owned by one task at a time, enforced by a lock, and a call that timed
out or was cancelled while waiting for its reply reconnects the request socket, so a
late reply is never taken for the reply of a later call."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import trio
import zmq

from spectrio.core.params import SamplingParams
from spectrio.models import TextTokenizer
from spectrio.wire.client_requests import (
    DEFAULT_TIMEOUT_S,
    ClientTimeout,
    Context,
    Messages,
    Prompt,
    RequestRefused,
    expect_reply,
    older_server,
    submit_frame,
)
from spectrio.wire.client_tokenizers import bundled_tokenizer, tokenizer_for
from spectrio.wire.codec import decode_reply, encode
from spectrio.wire.curve import CurveClientKeys
from spectrio.wire.schema import SCHEMA_VERSION, Abort, Ack, Error, Info, ModelInfo, Ping
from spectrio.wire.stream_assembler import Chunk, StreamAssembler
from spectrio.wire.stream_connection import StreamConnection, new_routing_id, reply_matches
from spectrio.wire.zmq_transport import TrioSocket, open_socket

__all__ = ["AsyncClient", "open_client"]


class AsyncClient:
    """Trio client. Create it with :func:`open_client`.

    ``timeout_s`` bounds every wait: for the reply to ``submit``/``abort``/``ping``/
    ``send_raw`` and for each step message in ``next_chunks``/``chunks``/``collect``.
    Passing it raises :class:`ClientTimeout`."""

    def __init__(
        self,
        requests: TrioSocket | None,
        outputs: TrioSocket | None,
        assembler: StreamAssembler,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        reconnect: Callable[[], TrioSocket] | None = None,
        server_tokenizer: bool = False,
        connection: StreamConnection | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s!r}")
        self._conn = connection  # schema 1.7 streams: requests and their steps, one socket
        self._requests = requests
        self._want_tokenizer = server_tokenizer and (requests is not None or connection is not None)
        self._outputs = outputs
        self.assembler = assembler
        self.timeout_s = timeout_s
        self._reconnect = reconnect
        self._closed = False
        self._req_lock = trio.Lock()
        self._out_lock = trio.Lock()

    async def _roundtrip(self, frame: bytes) -> bytes:
        """Send one request frame and wait for its reply frame, within the timeout."""
        if self._requests is None:
            raise RuntimeError("this client has no requests endpoint")
        async with self._req_lock:  # one request in flight: replies come back in order
            sock = self._requests
            try:
                with trio.fail_after(self.timeout_s):
                    await sock.send(frame)
                    return await sock.recv()
            except trio.TooSlowError:
                self._reset_requests(sock)
                raise ClientTimeout(
                    f"no reply from the server within {self.timeout_s:g} s"
                ) from None
            except BaseException:
                # Cancelled (or failed) between the send and the reply: a late reply
                # must not become the reply of the next call.
                self._reset_requests(sock)
                raise

    def _reset_requests(self, sock: TrioSocket) -> None:
        sock.close()
        if self._reconnect is not None and not self._closed:
            self._requests = self._reconnect()

    async def _request(
        self, frame: bytes, kind: str, request_id: str | None = None
    ) -> Ack | Error | ModelInfo:
        """Send one request and return its reply, decoded, within the timeout."""
        if self._conn is None:
            return decode_reply(await self._roundtrip(frame))
        try:
            with trio.fail_after(self.timeout_s):
                return await self._conn.call(frame, reply_matches(kind, request_id))
        except trio.TooSlowError:
            raise ClientTimeout(f"no reply from the server within {self.timeout_s:g} s") from None

    async def _call(self, frame: bytes, kind: str, request_id: str | None = None) -> Ack:
        return expect_reply(await self._request(frame, kind, request_id), Ack, "an ack")

    async def submit(
        self,
        prompt: Prompt | None = None,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        messages: Messages | None = None,
        cache_salt: str = "",
    ) -> str:
        """Submit a request and return its id once acknowledged. Raises
        :class:`RequestRefused` or :class:`ClientTimeout`. The request is followed by this
        client's assembler. Give a ``prompt``, or ``messages`` for a chat the server
        renders with its model's template (schema 1.5; ``no_chat_template`` from a server
        whose model has none, ``unknown_field`` from a server older than 1.5).
        ``cache_salt`` (schema 1.6) keeps the request's prefix-cache blocks apart from
        other salts' (``unknown_field`` from an older server; not sent when empty)."""
        rid = request_id or uuid.uuid4().hex
        if self._want_tokenizer:
            self.assembler.set_tokenizer(await self.server_tokenizer())
            self._want_tokenizer = False
        self.assembler.follow(rid)
        frame = submit_frame(
            prompt, params, rid, messages, cache_salt, stream=self._conn is not None
        )
        await self._call(frame, "submit", rid)
        return rid

    async def info(self, *, tokenizer: bool = False) -> ModelInfo:
        """The server's model description (``Info``, schema 1.2); with ``tokenizer=True``
        also the tokenizer's JSON. Raises :class:`RequestRefused` (``unknown_type`` from a
        server older than 1.2) or :class:`ClientTimeout`."""
        frame = encode(Info(v=SCHEMA_VERSION, tokenizer=tokenizer))
        return expect_reply(await self._request(frame, "info"), ModelInfo, "model info")

    async def server_tokenizer(self) -> TextTokenizer:
        """The server's tokenizer, fetched only when this process does not have it; the
        bundled one from a server older than schema 1.2."""
        try:
            info = await self.info()
        except RequestRefused as exc:
            if older_server(exc):
                return bundled_tokenizer()
            raise
        tok = tokenizer_for(info)
        if tok is None:
            tok = tokenizer_for(await self.info(tokenizer=True))
            assert tok is not None
        return tok

    async def send_raw(self, frame: bytes) -> Ack | Error | ModelInfo:
        """Send any frame as a request and return the reply without raising on an
        ``Error`` (for tests and diagnostics). Raises :class:`ClientTimeout`."""
        return await self._request(frame, "raw")

    async def abort(self, request_id: str) -> None:
        await self._call(
            encode(Abort(v=SCHEMA_VERSION, request_id=request_id)), "abort", request_id
        )

    async def ping(self) -> None:
        await self._call(encode(Ping(v=SCHEMA_VERSION)), "ping")

    async def next_chunks(self) -> list[Chunk]:
        """Wait for the next step message and return its chunks (possibly empty). Raises
        :class:`ClientTimeout` if none comes within ``timeout_s``."""
        if self._outputs is None and self._conn is None:
            raise RuntimeError("this client has no outputs endpoint")
        async with self._out_lock:
            try:
                with trio.fail_after(self.timeout_s):
                    if self._conn is not None:
                        frames = await self._conn.next_step()
                    else:
                        assert self._outputs is not None
                        frames = await self._outputs.recv_multipart()
            except trio.TooSlowError:
                raise ClientTimeout(
                    f"no step message from the server within {self.timeout_s:g} s"
                ) from None
            return self.assembler.feed(frames)

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Every chunk of the followed requests, until a wait times out."""
        while True:
            for chunk in await self.next_chunks():
                yield chunk

    async def collect(self, request_ids: Sequence[str]) -> dict[str, list[Chunk]]:
        """Read until every request in ``request_ids`` has finished (each wait for a step
        message is bounded by ``timeout_s``)."""
        pending = set(request_ids)
        out: dict[str, list[Chunk]] = {rid: [] for rid in request_ids}
        while pending:
            for chunk in await self.next_chunks():
                if chunk.request_id in out:
                    out[chunk.request_id].append(chunk)
                    if chunk.finished:
                        pending.discard(chunk.request_id)
        return out

    def close(self) -> None:
        self._closed = True
        for sock in (self._requests, self._outputs):
            if sock is not None:
                sock.close()
        if self._conn is not None:
            self._conn.close()


@asynccontextmanager
async def open_client(
    requests: str | None = None,
    outputs: str | None = None,
    *,
    tap: bool = False,
    tokenizer: TextTokenizer | None = None,
    context: Context | None = None,
    curve: CurveClientKeys | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    stream: bool | None = None,
) -> AsyncIterator[AsyncClient]:
    """Connect a Trio client.

    With ``requests`` alone (schema 1.7), the client's requests ask for their step
    messages back on its own connection (``Submit.stream``): any number of such clients
    share a server, each reading only its own requests. With ``outputs`` too, its
    requests go to the server's shared PUSH socket (one consumer process) or, with
    ``tap=True``, it observes them on the PUB tap, as before 1.7. With ``outputs`` alone
    it only reads. ``stream=False`` with ``requests`` alone makes a client that only
    submits, for a consumer elsewhere on the PUSH socket (the pre-1.7 default).
    ``timeout_s`` bounds every wait (:class:`ClientTimeout`). Without ``tokenizer``, a
    client with ``requests`` uses the server's tokenizer (asked for before its first
    submit); one without uses the bundled model's."""
    ctx = context if context is not None else zmq.Context.instance()
    configure = curve.apply if curve is not None else None
    if stream is None:
        stream = requests is not None and outputs is None
    if stream and (requests is None or outputs is not None):
        raise ValueError("stream=True needs requests and no outputs: steps come on requests")
    if stream:
        assert requests is not None
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, new_routing_id())
            if configure is not None:
                configure(sock)
            sock.connect(requests)
        except BaseException:
            sock.close(linger=0)
            raise
        conn = StreamConnection(sock)
        client = AsyncClient(
            None,
            None,
            StreamAssembler(tokenizer, track=()),
            timeout_s=timeout_s,
            server_tokenizer=tokenizer is None,
            connection=conn,
        )
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(conn.run)
                try:
                    yield client
                finally:
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # The caller's own error (RequestRefused, ClientTimeout, ...) leaves the block
            # as itself, as from a client without streams, not wrapped by the pump's nursery.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
        finally:
            client.close()
        return

    def connect_requests() -> TrioSocket:
        assert requests is not None
        return open_socket(
            ctx, zmq.DEALER, connect=requests, max_msg_size=None, configure=configure
        )

    out: TrioSocket | None = None
    legacy: AsyncClient | None = None
    req = connect_requests() if requests else None
    try:
        if outputs is not None:
            kind = zmq.SUB if tap else zmq.PULL
            out = open_socket(ctx, kind, connect=outputs, max_msg_size=None, configure=configure)
            if tap:
                out.socket.setsockopt(zmq.SUBSCRIBE, b"")
        legacy = AsyncClient(
            req,
            out,
            StreamAssembler(tokenizer, track=() if requests else None),
            timeout_s=timeout_s,
            reconnect=connect_requests if requests else None,
            server_tokenizer=tokenizer is None,
        )
        yield legacy
    finally:
        if legacy is not None:
            legacy.close()
        for trio_sock in (req, out):
            if trio_sock is not None:
                trio_sock.close()
