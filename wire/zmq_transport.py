"""Trio adapter for pyzmq sockets.

Trio has no ZeroMQ integration, and a zmq socket's file descriptor is edge-triggered:
it signals when ``zmq.EVENTS`` *may* have changed, and almost any zmq call can consume
that edge. So each :class:`TrioSocket` has exactly one owner task, and every operation
follows this sequence:

1. try the operation with ``zmq.NOBLOCK``;
2. on ``zmq.Again``, re-read ``zmq.EVENTS``; if the socket is ready now, go back to 1;
3. otherwise ``await trio.lowlevel.wait_readable(fd)`` (zmq's FD only ever signals
   *readable*, for sends too) and go back to 1.

Other tasks talk to the owner over Trio memory channels. Two tasks that use one
socket at the same time get :class:`trio.BusyResourceError`. The one exception is
:meth:`TrioSocket.close`, which any task may call: it wakes a waiting owner with
:class:`trio.ClosedResourceError`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Final, Self

import trio
import zmq

__all__ = ["DEFAULT_MAX_MSG_SIZE", "TrioSocket", "open_socket"]

DEFAULT_MAX_MSG_SIZE: Final = 1 << 20
"""Default ``zmq.MAXMSGSIZE`` for sockets that receive from untrusted peers (1 MiB). A
peer that sends a bigger message is disconnected by libzmq."""

Frame = bytes | bytearray | memoryview

_SPURIOUS_BACKOFF_S: Final = 0.001


def _int_option(sock: zmq.Socket[bytes], option: int) -> int:
    value = sock.getsockopt(option)
    assert isinstance(value, int)
    return value


class TrioSocket:
    """One pyzmq socket driven from Trio. Cancellation is safe. A cancelled send has
    sent nothing, and a cancelled receive has consumed nothing."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self._sock = sock
        self._fd = _int_option(sock, zmq.FD)
        self._busy = False
        self._closed = False

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The wrapped socket, for options and bind/connect. Do not send or receive on it
        directly."""
        return self._sock

    @property
    def closed(self) -> bool:
        return self._closed

    @contextmanager
    def _owned(self) -> Iterator[None]:
        if self._closed:
            raise trio.ClosedResourceError("the socket is closed")
        if self._busy:
            raise trio.BusyResourceError("another task is using this zmq socket")
        self._busy = True
        try:
            yield
        finally:
            self._busy = False

    async def _wait(self, flag: int, retried: bool) -> bool:
        """Wait after ``zmq.Again`` until ``flag`` (POLLIN or POLLOUT) may be set in
        ``zmq.EVENTS``.

        If ``EVENTS`` reports the flag, the operation is retried at once (the state
        changed after the failed attempt). If that retry fails too (``retried``), this
        sleeps for :data:`_SPURIOUS_BACKOFF_S`. That happens on a ROUTER whose addressed
        peer is full while another peer has room; without the backoff the loop would spin.
        Returns whether ``EVENTS`` reported the flag (the next ``retried``)."""
        ready = bool(_int_option(self._sock, zmq.EVENTS) & flag)
        if ready:
            await trio.sleep(_SPURIOUS_BACKOFF_S if retried else 0)
        else:
            await trio.lowlevel.wait_readable(self._fd)
        if self._closed:
            raise trio.ClosedResourceError("the socket was closed")
        return ready

    async def send_multipart(self, frames: Sequence[Frame], *, copy: bool = True) -> None:
        """Send one multipart message, waiting while the socket is at its high-water mark.
        With ``copy=False`` a caller must not reuse a frame's buffer before the send
        is done (pyzmq copies frames under 64 KiB anyway)."""
        with self._owned():
            await trio.lowlevel.checkpoint_if_cancelled()
            retried = False
            while True:
                try:
                    self._sock.send_multipart(frames, zmq.NOBLOCK, copy=copy)
                except zmq.Again:
                    retried = await self._wait(zmq.POLLOUT, retried)
                else:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    return

    async def recv_multipart(self) -> list[bytes]:
        """Receive one multipart message (all frames arrive together or none do)."""
        with self._owned():
            await trio.lowlevel.checkpoint_if_cancelled()
            retried = False
            while True:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    retried = await self._wait(zmq.POLLIN, retried)
                else:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    return frames

    async def send(self, frame: Frame) -> None:
        """Send a one-frame message."""
        await self.send_multipart([frame])

    async def recv(self) -> bytes:
        """Receive a message that must have exactly one frame. Raises ``ValueError``
        otherwise; the message is consumed."""
        frames = await self.recv_multipart()
        if len(frames) != 1:
            raise ValueError(f"expected a one-frame message, got {len(frames)} frames")
        return frames[0]

    def close(self, linger: int = 0) -> None:
        """Close the socket. A task waiting in a send or receive gets
        :class:`trio.ClosedResourceError`. ``linger`` (ms) bounds how long unsent messages
        are kept. Closing twice does nothing."""
        if self._closed:
            return
        self._closed = True
        trio.lowlevel.notify_closing(self._fd)
        self._sock.close(linger=linger)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def open_socket(
    ctx: zmq.Context[zmq.Socket[bytes]],
    socket_type: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    max_msg_size: int | None = DEFAULT_MAX_MSG_SIZE,
    sndhwm: int | None = None,
    rcvhwm: int | None = None,
    linger: int = 0,
    configure: Callable[[zmq.Socket[bytes]], None] | None = None,
) -> TrioSocket:
    """Create a socket of ``socket_type`` with its options set before ``bind``/``connect``.

    ``max_msg_size`` sets ``zmq.MAXMSGSIZE`` in bytes (None leaves libzmq's unlimited
    default). A ROUTER gets ``ROUTER_MANDATORY``, so a reply to a peer that is gone
    raises instead of vanishing silently. ``tcp://`` endpoints must name an explicit
    host; binding a wildcard (``*`` or ``0.0.0.0``) is refused here. Exposing a socket
    beyond the machine is a server decision made elsewhere.
    """
    if (bind is None) == (connect is None):
        raise ValueError("give exactly one of bind= and connect=")
    endpoint = bind if bind is not None else connect
    assert endpoint is not None
    if (
        bind is not None
        and bind.startswith("tcp://")
        and bind[6:].split(":")[0] in ("*", "0.0.0.0", "[::]", "::")
    ):
        raise ValueError(f"refusing to bind a wildcard address: {bind}")
    sock = ctx.socket(socket_type)
    try:
        sock.setsockopt(zmq.LINGER, linger)
        if max_msg_size is not None:
            sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
        if sndhwm is not None:
            sock.setsockopt(zmq.SNDHWM, sndhwm)
        if rcvhwm is not None:
            sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if socket_type == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if configure is not None:  # e.g. CURVE keys, which must precede bind/connect
            configure(sock)
        if bind is not None:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return TrioSocket(sock)
