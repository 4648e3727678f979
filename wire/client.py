"""Consumer library for a ``spectrio serve`` endpoint (wire schema v1, ``docs/wire.md``).

Two halves, usable separately:

* **requests:** ``submit``/``abort``/``ping``/``info`` over a DEALER socket; each call
  waits for its reply and raises :class:`RequestRefused` on an ``Error``.
* **outputs:** since schema 1.7, by default, the step messages of the client's own
  requests on that same connection (``Submit.stream``; any number of clients share a
  server); or, with an ``outputs`` endpoint, the server's PUSH socket (one consumer
  process) or PUB tap (observers; may drop). :class:`StreamAssembler` turns them into
  per-request :class:`Chunk` s, checks every request's sequence numbers (raising
  :class:`SequenceGap` on a missing or repeated token) and detokenises incrementally.

:class:`AsyncClient` is the Trio API (on a stream connection one pump task owns the
socket, :mod:`spectrio.wire.stream_connection`; otherwise each socket is owned by one
task at a time, enforced by a lock); :class:`Client` is the synchronous API over
blocking pyzmq calls. Both bound every wait, for a reply and for the next step message,
by ``timeout_s`` (60 s by default) and raise :class:`ClientTimeout` when it passes: a
server that died (even by SIGKILL) or stopped answering never hangs a client. A late
reply is never taken for the reply of a later call: on a stream connection replies are
matched to their call, and otherwise a call that timed out, or was cancelled, while
waiting for its reply reconnects the request socket.

Text is detokenised with the **server's** tokenizer: a client with a requests endpoint
and no ``tokenizer`` argument asks the server for it (``Info``, schema 1.2) before its
first submit, and fetches the tokenizer's JSON only when its hash is not one the process
already has (the bundled model's, or one fetched before). A server older than 1.2
answers ``unknown_type``; the client then uses the bundled tokenizer, as before. A client
without a requests endpoint (an observer of the outputs or the tap) cannot ask, and uses
the bundled tokenizer unless given one.

Note that a PUSH socket deals messages round-robin over its connected PULL peers, so one
process should read the outputs socket; stream connections have no such limit.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Final, TypeVar

import msgspec
import trio
import zmq
from tokenizers import Tokenizer

from spectrio.core.messages import TokenLogprob
from spectrio.core.params import ChatMessage, SamplingParams
from spectrio.models import BUNDLED_DIR, TextTokenizer
from spectrio.stages.output.output_processor import RequestText
from spectrio.wire.codec import decode_reply, decode_step, encode, step_logprobs
from spectrio.wire.curve import CurveClientKeys
from spectrio.wire.schema import (
    SCHEMA_VERSION,
    Abort,
    Ack,
    Error,
    ErrorCode,
    Info,
    ModelInfo,
    Ping,
    Submit,
)
from spectrio.wire.stream_connection import (
    StreamConnection,
    is_step_message,
    new_routing_id,
    reply_matches,
)
from spectrio.wire.zmq_transport import TrioSocket, open_socket

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "AsyncClient",
    "Chunk",
    "Client",
    "ClientTimeout",
    "RequestRefused",
    "SequenceGap",
    "StreamAssembler",
    "bundled_tokenizer",
    "open_client",
    "tokenizer_for",
]

Context = zmq.Context[zmq.Socket[bytes]]
Prompt = str | Sequence[int]
Messages = Sequence[Mapping[str, str] | ChatMessage]
"""A chat for ``submit(messages=...)`` (schema 1.5): each message a ``role`` and a
``content``, as dicts or :class:`~spectrio.core.params.ChatMessage` s."""

DEFAULT_TIMEOUT_S: Final = 60.0
"""Default bound on every wait of a client, for a reply or for the next step message."""


class ClientTimeout(TimeoutError, zmq.Again):  # type: ignore[misc]  # stubs differ on strerror
    """No reply, or no step message, within the client's ``timeout_s``: the server is
    gone, stuck, or not reachable. A ``TimeoutError``; also a ``zmq.Again``, which the
    synchronous client raised before it had this type."""

    def __init__(self, message: str) -> None:
        TimeoutError.__init__(self, message)


class RequestRefused(Exception):
    """The server answered a request with an ``Error``."""

    def __init__(self, error: Error) -> None:
        super().__init__(f"{error.code.value}: {error.reason}")
        self.error = error


class SequenceGap(Exception):
    """A step's sequence number for a request is not the count of tokens received so far:
    tokens were lost (a dropping tap, a reconnect) or delivered twice."""

    def __init__(self, request_id: str, expected: int, got: int, step: int) -> None:
        super().__init__(
            f"request {request_id!r}: step {step} starts at token {got}, expected {expected}"
        )
        self.request_id = request_id
        self.expected = expected
        self.got = got
        self.step = step


class Chunk(msgspec.Struct, frozen=True, kw_only=True):
    """One request's output from one step."""

    request_id: str
    step: int
    seqno: int  # tokens of this request before this chunk
    token_ids: list[int]
    text: str  # complete characters only
    finish_reason: str | None = None  # "stop" | "length" | "abort" when the request ended
    # On a request's final chunk (server schema 1.1 and later; aborted requests since
    # 1.3; None from an older server): drafts proposed and accepted over the request's
    # whole life, like the embedding API's final ``Delta``.
    total_drafts: int | None = None
    total_accepted: int | None = None
    # On a request's final chunk (server schema 1.6 and later; None before, and for an
    # aborted request): prompt tokens whose KV came from the server's prefix cache.
    cached_tokens: int | None = None
    # One entry per token when the request asked for logprobs (``params.logprobs``).
    logprobs: list[TokenLogprob] | None = None
    # On a request's first chunk, when it asked for ``params.prompt_logprobs`` (server
    # schema 1.8): prompt tokens 1 .. P-1's logprobs, gathered from the steps that
    # scored them (the embedding API's ``Delta.prompt_logprobs``).
    prompt_logprobs: list[TokenLogprob] | None = None
    # The step envelope's error for this request, as ``"code: reason"`` (a request that
    # failed: ``"unavailable: engine_dead: ..."`` when the engine died).
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


_tokenizers: dict[str, TextTokenizer] = {}  # SHA-256 of a tokenizer's JSON -> tokenizer
_tokenizers_lock = threading.Lock()


@functools.cache
def _bundled_json() -> str:
    return (Path(BUNDLED_DIR) / "tokenizer.json").read_text(encoding="utf-8")


def _from_json(text: str, eos_token_id: int | None = None) -> TextTokenizer:
    """The tokenizer for a tokenizer JSON, built once per process and per content."""
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    with _tokenizers_lock:
        tok = _tokenizers.get(digest)
        if tok is None:
            tok = _tokenizers[digest] = TextTokenizer(Tokenizer.from_str(text), eos_token_id)
        return tok


def bundled_tokenizer() -> TextTokenizer:
    """The tokenizer of the bundled model."""
    return _from_json(_bundled_json())


def tokenizer_for(info: ModelInfo) -> TextTokenizer | None:
    """The tokenizer an ``Info`` reply names: from its ``tokenizer_json`` when it has
    one (checked against its hash), else one this process already has with that hash
    (the bundled model's, or one fetched before); None when it must be fetched. Raises
    ``ValueError`` when the JSON does not match the hash."""
    if info.tokenizer_json is not None:
        digest = hashlib.sha256(info.tokenizer_json.encode("utf-8")).hexdigest()
        if digest != info.tokenizer_sha256:
            raise ValueError("the server's tokenizer JSON does not match its SHA-256")
        return _from_json(info.tokenizer_json, info.eos_token_id)
    bundled_json = _bundled_json()
    if hashlib.sha256(bundled_json.encode("utf-8")).hexdigest() == info.tokenizer_sha256:
        return bundled_tokenizer()
    with _tokenizers_lock:
        return _tokenizers.get(info.tokenizer_sha256)


_R = TypeVar("_R", ModelInfo, Ack)


def _older_server(exc: RequestRefused) -> bool:
    """An ``Info`` refused by a server older than schema 1.2."""
    return exc.error.code is ErrorCode.UNKNOWN_TYPE


class StreamAssembler:
    """Reassembles per-request streams from step messages.

    ``track`` limits the requests followed to a set given up front (further ids can be
    added with :meth:`follow`); with ``track=None`` every request is followed and must be
    seen from its first token. A request is forgotten after its finishing chunk.
    """

    def __init__(
        self, tokenizer: TextTokenizer | None = None, *, track: Sequence[str] | None = None
    ) -> None:
        self._tok = tokenizer  # None: the bundled one, once first needed
        self._follow_all = track is None
        self._followed: set[str] = set(track or ())
        self._received: dict[str, int] = {}
        self._texts: dict[str, RequestText] = {}
        # prompt logprobs of followed requests, gathered until their first chunk
        self._prompt_lps: dict[str, list[TokenLogprob]] = {}

    @property
    def tokenizer(self) -> TextTokenizer:
        """The tokenizer that detokenises new streams (the bundled one unless set)."""
        if self._tok is None:
            self._tok = bundled_tokenizer()
        return self._tok

    def set_tokenizer(self, tokenizer: TextTokenizer) -> None:
        """Detokenise streams that start from now on with ``tokenizer`` (the clients set
        the server's before their first submit)."""
        self._tok = tokenizer

    def follow(self, request_id: str) -> None:
        self._followed.add(request_id)

    def received(self, request_id: str) -> int:
        """Tokens received so far for a request still running."""
        return self._received.get(request_id, 0)

    def feed(self, frames: Sequence[bytes | memoryview]) -> list[Chunk]:
        """Decode one step message. Raises ``ValueError`` for a malformed message and
        :class:`SequenceGap` when a slot of a followed request has a sequence number other
        than the count of its tokens received so far: the one gap rule of
        ``docs/wire.md`` (*Reassembling a request's stream*), applied to every slot, those
        without tokens included. A chunk is returned for slots with tokens or a finish."""
        env, tokens = decode_step(frames)
        logprobs = step_logprobs(frames, env.request_ids)
        errors = {e.request_id: f"{e.code.value}: {e.reason}" for e in env.errors}
        chunks: list[Chunk] = []
        for rid, seqno, reason in zip(env.request_ids, env.seqnos, env.finish_reasons, strict=True):
            if not (self._follow_all or rid in self._followed):
                continue
            # The gap rule of docs/wire.md, for every slot (with or without tokens).
            expected = self._received.get(rid, 0)
            if seqno != expected:
                raise SequenceGap(rid, expected, seqno, env.step)
            ids = tokens.get(rid)
            token_ids = [] if ids is None else [int(t) for t in ids]
            scored = env.prompt_logprobs.get(rid)
            if scored:
                self._prompt_lps.setdefault(rid, []).extend(scored)
            if not token_ids and reason is None:
                continue  # a slot still in prefill, or preempted: no chunk
            prompt_lps = self._prompt_lps.pop(rid, None)
            # The output processor's text; the wire does not carry the request's stop
            # strings or its stop cut, so nothing is held back here.
            texts = self._texts.get(rid)
            if texts is None:
                texts = self._texts[rid] = RequestText(self.tokenizer)
            text = texts.push(token_ids, finished=reason is not None)
            if reason is not None:
                self._received.pop(rid, None)
                self._texts.pop(rid, None)
                self._followed.discard(rid)
            else:
                self._received[rid] = expected + len(token_ids)
            totals = env.drafts.get(rid) if reason is not None else None
            chunks.append(
                Chunk(
                    request_id=rid,
                    step=env.step,
                    seqno=seqno,
                    token_ids=token_ids,
                    text=text,
                    finish_reason=reason,
                    total_drafts=None if totals is None else totals[0],
                    total_accepted=None if totals is None else totals[1],
                    cached_tokens=env.cached_tokens.get(rid) if reason is not None else None,
                    logprobs=logprobs.get(rid) if token_ids else None,
                    prompt_logprobs=prompt_lps,
                    error=errors.get(rid),
                )
            )
        return chunks


def _submit_frame(
    prompt: Prompt | None,
    params: SamplingParams | None,
    request_id: str,
    messages: Messages | None = None,
    cache_salt: str = "",
    stream: bool = False,
) -> bytes:
    """A ``Submit`` with a prompt, or with messages (the server checks that there is
    exactly one of them, and each message's fields); ``stream`` asks for the request's
    step messages on the connection that sends it (schema 1.7)."""
    body: str | list[int] | None = None
    if prompt is not None:
        body = prompt if isinstance(prompt, str) else [int(t) for t in prompt]
    chat = None
    if messages is not None:
        chat = [
            m if isinstance(m, ChatMessage) else ChatMessage(role=m["role"], content=m["content"])
            for m in messages
        ]
    submit = Submit(
        v=SCHEMA_VERSION,
        request_id=request_id,
        prompt=body,
        params=params or SamplingParams(),
        messages=chat,
        cache_salt=cache_salt,
        stream=stream,
    )
    if submit.params.prompt_logprobs is not None:
        return encode(submit)
    # Schema 1.8 added params.prompt_logprobs; sent only when set, so a server older than
    # 1.8 (which refuses the key as unknown_field) reads every other request as before.
    body_map = msgspec.to_builtins(submit)
    del body_map["params"]["prompt_logprobs"]
    return msgspec.msgpack.encode(body_map)


def _expect_reply(reply: Ack | Error | ModelInfo, kind: type[_R], what: str) -> _R:
    """``reply`` as ``kind``; an ``Error`` reply raises RequestRefused."""
    if isinstance(reply, Error):
        raise RequestRefused(reply)
    if not isinstance(reply, kind):
        raise ValueError(f"expected {what}, got {type(reply).__name__}")
    return reply


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
        return _expect_reply(await self._request(frame, kind, request_id), Ack, "an ack")

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
        frame = _submit_frame(
            prompt, params, rid, messages, cache_salt, stream=self._conn is not None
        )
        await self._call(frame, "submit", rid)
        return rid

    async def info(self, *, tokenizer: bool = False) -> ModelInfo:
        """The server's model description (``Info``, schema 1.2); with ``tokenizer=True``
        also the tokenizer's JSON. Raises :class:`RequestRefused` (``unknown_type`` from a
        server older than 1.2) or :class:`ClientTimeout`."""
        frame = encode(Info(v=SCHEMA_VERSION, tokenizer=tokenizer))
        return _expect_reply(await self._request(frame, "info"), ModelInfo, "model info")

    async def server_tokenizer(self) -> TextTokenizer:
        """The server's tokenizer, fetched only when this process does not have it; the
        bundled one from a server older than schema 1.2."""
        try:
            info = await self.info()
        except RequestRefused as exc:
            if _older_server(exc):
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


class Client:
    """Synchronous client over blocking pyzmq calls. ``timeout_s`` bounds every wait
    (:class:`ClientTimeout`, which is also a ``zmq.Again``).

    Use as a context manager. Without ``requests`` it follows every request on the
    outputs; with it, only the requests it submitted: with ``requests`` alone, their
    step messages come back on its own connection (schema 1.7, as :func:`open_client`),
    with ``outputs`` too, from the server's PUSH socket or tap (``stream`` as in
    :func:`open_client`).
    """

    def __init__(
        self,
        requests: str | None = None,
        outputs: str | None = None,
        *,
        tap: bool = False,
        tokenizer: TextTokenizer | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        context: Context | None = None,
        curve: CurveClientKeys | None = None,
        stream: bool | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s!r}")
        ctx = context if context is not None else zmq.Context.instance()
        timeout_ms = max(1, int(timeout_s * 1000))
        self.timeout_s = timeout_s
        self._ctx, self._curve, self._requests_ep = ctx, curve, requests
        self._req: zmq.Socket[bytes] | None = None
        self._out: zmq.Socket[bytes] | None = None
        if stream is None:
            stream = requests is not None and outputs is None
        if stream and (requests is None or outputs is not None):
            raise ValueError("stream=True needs requests and no outputs: steps come on requests")
        self._stream = stream
        self._routing_id = new_routing_id()
        self._steps: collections.deque[list[bytes]] = collections.deque()  # read early
        if requests is not None:
            self._req = self._connect_requests()
        if outputs is not None:
            self._out = ctx.socket(zmq.SUB if tap else zmq.PULL)
            self._out.setsockopt(zmq.LINGER, 0)
            self._out.setsockopt(zmq.RCVTIMEO, timeout_ms)
            if tap:
                self._out.setsockopt(zmq.SUBSCRIBE, b"")
            if curve is not None:
                curve.apply(self._out)
            self._out.connect(outputs)
        self.assembler = StreamAssembler(tokenizer, track=() if requests else None)
        self._want_tokenizer = tokenizer is None and requests is not None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for sock in (self._req, self._out):
            if sock is not None:
                sock.close(linger=0)

    def _connect_requests(self) -> zmq.Socket[bytes]:
        assert self._requests_ep is not None
        timeout_ms = max(1, int(self.timeout_s * 1000))
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
        if self._stream:  # kept across reconnects: the server routes steps by it
            sock.setsockopt(zmq.ROUTING_ID, self._routing_id)
        if self._curve is not None:
            self._curve.apply(sock)
        sock.connect(self._requests_ep)
        return sock

    def _request(
        self, frame: bytes, kind: str, request_id: str | None = None
    ) -> Ack | Error | ModelInfo:
        """Send one request and return its reply, decoded. On a stream connection, step
        messages read meanwhile are kept for :meth:`next_chunks`, and replies no call
        waits for (late ones) are dropped."""
        if not self._stream:
            return decode_reply(self._roundtrip(frame))
        assert self._req is not None
        match = reply_matches(kind, request_id)
        try:
            self._req.send(frame)
        except zmq.Again:
            raise ClientTimeout(
                f"could not send to the server within {self.timeout_s:g} s"
            ) from None
        deadline = time.monotonic() + self.timeout_s
        while True:
            frames = self._recv_before(deadline, "reply")
            if is_step_message(frames):
                self._steps.append(frames)
                continue
            try:
                reply = decode_reply(frames[-1])
            except msgspec.DecodeError:
                continue
            if match(reply):
                return reply

    def _recv_before(self, deadline: float, what: str) -> list[bytes]:
        assert self._req is not None
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not self._req.poll(max(1, int(remaining * 1000))):
            raise ClientTimeout(f"no {what} from the server within {self.timeout_s:g} s")
        return self._req.recv_multipart()

    def _roundtrip(self, frame: bytes) -> bytes:
        if self._req is None:
            raise RuntimeError("this client has no requests endpoint")
        try:
            self._req.send(frame)
            return self._req.recv()
        except zmq.Again:
            # Reconnect, so a late reply is never read as the reply of a later call.
            self._req.close(linger=0)
            self._req = self._connect_requests()
            raise ClientTimeout(f"no reply from the server within {self.timeout_s:g} s") from None

    def _call(self, frame: bytes, kind: str, request_id: str | None = None) -> Ack:
        return _expect_reply(self._request(frame, kind, request_id), Ack, "an ack")

    def info(self, *, tokenizer: bool = False) -> ModelInfo:
        """The server's model description (see :meth:`AsyncClient.info`)."""
        frame = encode(Info(v=SCHEMA_VERSION, tokenizer=tokenizer))
        return _expect_reply(self._request(frame, "info"), ModelInfo, "model info")

    def server_tokenizer(self) -> TextTokenizer:
        """The server's tokenizer (see :meth:`AsyncClient.server_tokenizer`)."""
        try:
            info = self.info()
        except RequestRefused as exc:
            if _older_server(exc):
                return bundled_tokenizer()
            raise
        tok = tokenizer_for(info)
        if tok is None:
            tok = tokenizer_for(self.info(tokenizer=True))
            assert tok is not None
        return tok

    def submit(
        self,
        prompt: Prompt | None = None,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        messages: Messages | None = None,
        cache_salt: str = "",
    ) -> str:
        """Submit a request (see :meth:`AsyncClient.submit`)."""
        rid = request_id or uuid.uuid4().hex
        if self._want_tokenizer:
            self.assembler.set_tokenizer(self.server_tokenizer())
            self._want_tokenizer = False
        self.assembler.follow(rid)
        self._call(
            _submit_frame(prompt, params, rid, messages, cache_salt, stream=self._stream),
            "submit",
            rid,
        )
        return rid

    def abort(self, request_id: str) -> None:
        self._call(encode(Abort(v=SCHEMA_VERSION, request_id=request_id)), "abort", request_id)

    def ping(self) -> None:
        self._call(encode(Ping(v=SCHEMA_VERSION)), "ping")

    def next_chunks(self) -> list[Chunk]:
        """Block for the next step message (:class:`ClientTimeout` after ``timeout_s``)."""
        if self._stream:
            if self._steps:
                return self.assembler.feed(self._steps.popleft())
            deadline = time.monotonic() + self.timeout_s
            while True:
                frames = self._recv_before(deadline, "step message")
                if is_step_message(frames):
                    return self.assembler.feed(frames)
                # a late reply to a call that timed out: nobody waits for it
        if self._out is None:
            raise RuntimeError("this client has no outputs endpoint")
        try:
            frames = self._out.recv_multipart()
        except zmq.Again:
            raise ClientTimeout(
                f"no step message from the server within {self.timeout_s:g} s"
            ) from None
        return self.assembler.feed(frames)

    def stream(self, request_id: str) -> Iterator[Chunk]:
        """Yield one request's chunks until it finishes (chunks of other followed requests
        read meanwhile are dropped; use :meth:`next_chunks` to multiplex)."""
        while True:
            for chunk in self.next_chunks():
                if chunk.request_id == request_id:
                    yield chunk
                    if chunk.finished:
                        return

    def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[Chunk]:
        """Submit one request and stream its chunks."""
        rid = self.submit(prompt, params)
        yield from self.stream(rid)

    def chat(self, messages: Messages, params: SamplingParams | None = None) -> Iterator[Chunk]:
        """Submit one chat (schema 1.5) and stream the answer's chunks. The server adds
        its template's end-of-turn tokens to the stop tokens: the last chunk ends with
        one (``finish_reason="stop"``), and its text is not in the chunks' text."""
        rid = self.submit(params=params, messages=messages)
        yield from self.stream(rid)
