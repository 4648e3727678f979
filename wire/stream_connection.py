"""One DEALER connection that carries a client's requests, their replies and (schema 1.7,
``Submit.stream``) the step messages of its requests, driven from Trio.

Replies and step messages share the connection, so one task owns the socket (a pump):
it sends the frames callers queue and sorts what arrives into replies and step messages
by the message's ``"type"`` (``docs/wire.md``: a reader dispatches on it). Callers never
touch the socket. A reply is matched to the call waiting for it by its kind and request
id (:func:`reply_matches`), so a late reply to a call that timed out is dropped rather
than taken for the reply of a later call; the connection is never torn down for it, and
the streams of running requests continue.

The routing id is chosen here (random, 17 bytes, first byte not zero): libzmq keeps it
across a reconnect of the underlying transport, and the server hands a reconnecting
connection the messages still queued for that id.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable

import msgspec
import trio
import zmq

from spectrio.wire.codec import decode_reply
from spectrio.wire.schema import Ack, Error, ModelInfo

__all__ = ["ReplyMatch", "StreamConnection", "is_step_message", "new_routing_id", "reply_matches"]

ReplyMatch = Callable[[Ack | Error | ModelInfo], bool]
"""Whether a reply answers the call waiting for it."""

_TYPE = msgspec.msgpack.Decoder(dict[str, object])


def new_routing_id() -> bytes:
    """A random routing id a client sets on its DEALER (libzmq refuses ids that start
    with a zero byte from clients; those are its own)."""
    return b"c" + os.urandom(16)


def is_step_message(frames: list[bytes]) -> bool:
    """Whether a message read on a client's connection is a step message (its first
    frame's ``"type"`` is ``"step"``) rather than a reply."""
    if len(frames) < 2:
        return False
    try:
        head = _TYPE.decode(frames[0])
    except msgspec.DecodeError:
        return False
    return head.get("type") == "step"


def reply_matches(kind: str, request_id: str | None) -> ReplyMatch:
    """The rule for the reply to a ``kind`` request (``submit``, ``abort``, ``ping``,
    ``info``; ``raw`` takes any reply) about ``request_id``: an ``Ack`` of that kind and
    id, a ``ModelInfo`` for ``info``, or an ``Error`` naming the id (or none: the frame
    could not be read, or the client is over its rate)."""

    def match(reply: Ack | Error | ModelInfo) -> bool:
        if kind == "raw":
            return True
        if isinstance(reply, Error):
            return reply.request_id is None or reply.request_id == request_id
        if isinstance(reply, ModelInfo):
            return kind == "info"
        return reply.of == kind and reply.request_id == request_id

    return match


class StreamConnection:
    """The pump of one DEALER socket (module docstring). Run :meth:`run` in a nursery;
    :meth:`call` and :meth:`next_step` from any task."""

    def __init__(self, sock: zmq.Socket[bytes], *, step_buffer: int = 1024) -> None:
        self._sock = sock
        fd = sock.getsockopt(zmq.FD)
        assert isinstance(fd, int)
        self._fd = fd
        self._outgoing: collections.deque[bytes] = collections.deque()
        self._wake: trio.CancelScope | None = None
        self._steps_tx, self._steps_rx = trio.open_memory_channel[list[bytes]](step_buffer)
        self._waiting: ReplyMatch | None = None
        self._reply_tx, self._reply_rx = trio.open_memory_channel[Ack | Error | ModelInfo](1)
        self._call_lock = trio.Lock()
        self._closed = False
        self.late_replies = 0  # replies no call was waiting for (dropped)

    @property
    def socket(self) -> zmq.Socket[bytes]:
        return self._sock

    async def run(self) -> None:
        """Own the socket until cancelled: send queued frames, dispatch what arrives."""
        sock = self._sock
        while True:
            busy = False
            while self._outgoing:
                try:
                    sock.send(self._outgoing[0], zmq.NOBLOCK)
                except zmq.Again:  # not connected yet, or the server's queue is full
                    break
                self._outgoing.popleft()
                busy = True
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                await self._dispatch(frames)
                busy = True
            if busy:
                await trio.lowlevel.checkpoint()
                continue
            events = sock.getsockopt(zmq.EVENTS)
            assert isinstance(events, int)
            if events & zmq.POLLIN or (self._outgoing and events & zmq.POLLOUT):
                await trio.lowlevel.checkpoint()
                continue
            # Nothing to do now: wait for the socket's events to change (the FD is
            # edge-triggered, and it also signals POLLOUT) or for a frame to send.
            with trio.CancelScope() as scope:
                self._wake = scope
                await trio.lowlevel.wait_readable(self._fd)
            self._wake = None

    async def _dispatch(self, frames: list[bytes]) -> None:
        if is_step_message(frames):
            # With ``step_buffer`` steps unread, the pump stops reading: the server sees a
            # connection that does not read, which its bounds handle.
            await self._steps_tx.send(frames)
            return
        try:
            reply = decode_reply(frames[-1])
        except msgspec.DecodeError:
            self.late_replies += 1
            return
        if self._waiting is not None and self._waiting(reply):
            self._waiting = None
            self._reply_tx.send_nowait(reply)
        else:
            self.late_replies += 1

    def send(self, frame: bytes) -> None:
        """Queue one request frame; the pump sends it."""
        self._outgoing.append(frame)
        if self._wake is not None:
            self._wake.cancel()

    async def call(self, frame: bytes, match: ReplyMatch) -> Ack | Error | ModelInfo:
        """Send ``frame`` and wait for the reply ``match`` accepts. On cancellation (a
        timeout) the reply, if it comes, is dropped."""
        async with self._call_lock:
            self._waiting = match
            try:
                self.send(frame)
                return await self._reply_rx.receive()
            finally:
                self._waiting = None
                if frame in self._outgoing:  # never sent (no server): never to be sent late
                    self._outgoing.remove(frame)
                try:  # a reply that came as the wait was cancelled is nobody's now
                    self._reply_rx.receive_nowait()
                    self.late_replies += 1
                except trio.WouldBlock:
                    pass

    async def next_step(self) -> list[bytes]:
        """The next step message read on this connection."""
        return await self._steps_rx.receive()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close(linger=0)
