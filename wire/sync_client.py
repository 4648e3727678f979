"""The synchronous wire client (:class:`Client`) over blocking pyzmq calls: socket
timeouts bound every wait. On a stream connection (schema 1.7) it reads its replies and
its requests' step messages from one socket, keeping steps read while it waits for a
reply and dropping late replies; otherwise a call that timed out reconnects the request
socket, so a late reply is never read as the reply of a later call."""

from __future__ import annotations

import collections
import time
import uuid
from collections.abc import Iterator

import msgspec
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
from spectrio.wire.stream_connection import is_step_message, new_routing_id, reply_matches

__all__ = ["Client"]


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
        return expect_reply(self._request(frame, kind, request_id), Ack, "an ack")

    def info(self, *, tokenizer: bool = False) -> ModelInfo:
        """The server's model description (see :meth:`AsyncClient.info`)."""
        frame = encode(Info(v=SCHEMA_VERSION, tokenizer=tokenizer))
        return expect_reply(self._request(frame, "info"), ModelInfo, "model info")

    def server_tokenizer(self) -> TextTokenizer:
        """The server's tokenizer (see :meth:`AsyncClient.server_tokenizer`)."""
        try:
            info = self.info()
        except RequestRefused as exc:
            if older_server(exc):
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
            submit_frame(prompt, params, rid, messages, cache_salt, stream=self._stream),
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
