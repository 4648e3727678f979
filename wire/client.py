"""Consumer library for a ``spectrio serve`` endpoint (wire schema v1, ``docs/wire.md``).

Two halves, usable separately:

* **requests:** ``submit``/``abort``/``ping`` over a DEALER socket; each call waits for
  its ``Ack`` and raises :class:`RequestRefused` on an ``Error``.
* **outputs:** step messages from the server's PUSH (lossless, one primary consumer) or
  PUB tap (observers; may drop). :class:`StreamAssembler` turns them into per-request
  :class:`Chunk` s, checks every request's sequence numbers (raising
  :class:`SequenceGap` on a missing or repeated token) and detokenises incrementally.

:class:`AsyncClient` is the Trio API (each socket is owned by one task at a time, enforced
by a lock); :class:`Client` is the synchronous API over blocking pyzmq calls. Both bound
every wait, for a reply and for the next step message, by ``timeout_s`` (60 s by default)
and raise :class:`ClientTimeout` when it passes: a server that died (even by SIGKILL) or
stopped answering never hangs a client. A call that timed out, or was cancelled, while
waiting for its reply reconnects the request socket, so its late reply can never be
taken for the reply of a later call.

Note that a PUSH socket deals messages round-robin over its connected PULL peers, so one
process should read the outputs; other clients may submit requests only.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Final

import msgspec
import trio
import zmq

from spectrio.core.params import SamplingParams
from spectrio.models import BUNDLED_DIR, TextTokenizer
from spectrio.models.tokenizer import IncrementalDetokenizer
from spectrio.wire.codec import decode_reply, decode_step, encode
from spectrio.wire.curve import CurveClientKeys
from spectrio.wire.schema import SCHEMA_VERSION, Abort, Ack, Error, Ping, Submit
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
]

Context = zmq.Context[zmq.Socket[bytes]]
Prompt = str | Sequence[int]

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
    # On the final chunk of a request that finished normally (server schema 1.1 and
    # later; None from an older server, or after an abort): drafts proposed and accepted
    # over the request's whole life, like the embedding API's final ``Delta``.
    total_drafts: int | None = None
    total_accepted: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def bundled_tokenizer() -> TextTokenizer:
    """The tokenizer of the bundled model."""
    return TextTokenizer.from_file(Path(BUNDLED_DIR) / "tokenizer.json")


class StreamAssembler:
    """Reassembles per-request streams from step messages.

    ``track`` limits the requests followed to a set given up front (further ids can be
    added with :meth:`follow`); with ``track=None`` every request is followed and must be
    seen from its first token. A request is forgotten after its finishing chunk.
    """

    def __init__(
        self, tokenizer: TextTokenizer | None = None, *, track: Sequence[str] | None = None
    ) -> None:
        self._tok = tokenizer if tokenizer is not None else bundled_tokenizer()
        self._follow_all = track is None
        self._followed: set[str] = set(track or ())
        self._received: dict[str, int] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}

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
            if not token_ids and reason is None:
                continue  # a slot still in prefill, or preempted: no chunk
            detok = self._detok.get(rid)
            if detok is None:
                detok = self._detok[rid] = self._tok.stream()
            text = detok.push(token_ids) if token_ids else ""
            if reason is not None:
                text += detok.flush()
                self._received.pop(rid, None)
                self._detok.pop(rid, None)
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
                )
            )
        return chunks


def _submit_frame(prompt: Prompt, params: SamplingParams | None, request_id: str) -> bytes:
    body: str | list[int] = prompt if isinstance(prompt, str) else [int(t) for t in prompt]
    return encode(
        Submit(
            v=SCHEMA_VERSION, request_id=request_id, prompt=body, params=params or SamplingParams()
        )
    )


def _check(frame: bytes) -> Ack:
    reply = decode_reply(frame)
    if isinstance(reply, Error):
        raise RequestRefused(reply)
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
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s!r}")
        self._requests = requests
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

    async def _call(self, frame: bytes) -> Ack:
        return _check(await self._roundtrip(frame))

    async def submit(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> str:
        """Submit a request and return its id once acknowledged. Raises
        :class:`RequestRefused` or :class:`ClientTimeout`. The request is followed by this
        client's assembler."""
        rid = request_id or uuid.uuid4().hex
        self.assembler.follow(rid)
        await self._call(_submit_frame(prompt, params, rid))
        return rid

    async def send_raw(self, frame: bytes) -> Ack | Error:
        """Send any frame as a request and return the reply without raising on an
        ``Error`` (for tests and diagnostics). Raises :class:`ClientTimeout`."""
        return decode_reply(await self._roundtrip(frame))

    async def abort(self, request_id: str) -> None:
        await self._call(encode(Abort(v=SCHEMA_VERSION, request_id=request_id)))

    async def ping(self) -> None:
        await self._call(encode(Ping(v=SCHEMA_VERSION)))

    async def next_chunks(self) -> list[Chunk]:
        """Wait for the next step message and return its chunks (possibly empty). Raises
        :class:`ClientTimeout` if none comes within ``timeout_s``."""
        if self._outputs is None:
            raise RuntimeError("this client has no outputs endpoint")
        async with self._out_lock:
            try:
                with trio.fail_after(self.timeout_s):
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
) -> AsyncIterator[AsyncClient]:
    """Connect a Trio client. ``outputs`` is the server's PUSH endpoint, or its PUB tap
    endpoint with ``tap=True``. Without ``outputs`` the client only submits.
    ``timeout_s`` bounds every wait (:class:`ClientTimeout`)."""
    ctx = context if context is not None else zmq.Context.instance()
    configure = curve.apply if curve is not None else None

    def connect_requests() -> TrioSocket:
        assert requests is not None
        return open_socket(
            ctx, zmq.DEALER, connect=requests, max_msg_size=None, configure=configure
        )

    out: TrioSocket | None = None
    client: AsyncClient | None = None
    req = connect_requests() if requests else None
    try:
        if outputs is not None:
            kind = zmq.SUB if tap else zmq.PULL
            out = open_socket(ctx, kind, connect=outputs, max_msg_size=None, configure=configure)
            if tap:
                out.socket.setsockopt(zmq.SUBSCRIBE, b"")
        client = AsyncClient(
            req,
            out,
            StreamAssembler(tokenizer, track=() if requests else None),
            timeout_s=timeout_s,
            reconnect=connect_requests if requests else None,
        )
        yield client
    finally:
        if client is not None:
            client.close()
        for sock in (req, out):
            if sock is not None:
                sock.close()


class Client:
    """Synchronous client over blocking pyzmq calls. ``timeout_s`` bounds every wait
    (:class:`ClientTimeout`, which is also a ``zmq.Again``).

    Use as a context manager. Without ``requests`` it follows every request on the
    outputs; with it, only the requests it submitted.
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
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s!r}")
        ctx = context if context is not None else zmq.Context.instance()
        timeout_ms = max(1, int(timeout_s * 1000))
        self.timeout_s = timeout_s
        self._ctx, self._curve, self._requests_ep = ctx, curve, requests
        self._req: zmq.Socket[bytes] | None = None
        self._out: zmq.Socket[bytes] | None = None
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
        if self._curve is not None:
            self._curve.apply(sock)
        sock.connect(self._requests_ep)
        return sock

    def _call(self, frame: bytes) -> Ack:
        if self._req is None:
            raise RuntimeError("this client has no requests endpoint")
        try:
            self._req.send(frame)
            reply = self._req.recv()
        except zmq.Again:
            # Reconnect, so a late reply is never read as the reply of a later call.
            self._req.close(linger=0)
            self._req = self._connect_requests()
            raise ClientTimeout(f"no reply from the server within {self.timeout_s:g} s") from None
        return _check(reply)

    def submit(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> str:
        rid = request_id or uuid.uuid4().hex
        self.assembler.follow(rid)
        self._call(_submit_frame(prompt, params, rid))
        return rid

    def abort(self, request_id: str) -> None:
        self._call(encode(Abort(v=SCHEMA_VERSION, request_id=request_id)))

    def ping(self) -> None:
        self._call(encode(Ping(v=SCHEMA_VERSION)))

    def next_chunks(self) -> list[Chunk]:
        """Block for the next step message (:class:`ClientTimeout` after ``timeout_s``)."""
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
