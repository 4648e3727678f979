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

Binding is subject to one endpoint policy (:func:`check_bind`), applied by
:func:`open_socket` to every ``bind=``: loopback ``tcp://``, ``inproc://`` and ``ipc://``
paths in a private directory are allowed; an endpoint another host or user can reach (a
non-loopback address, any spelling of a wildcard, an abstract ``ipc://@name``) needs
``allow_public=True``. Addresses are classified with :mod:`ipaddress`, never by string
matching.
"""

from __future__ import annotations

import enum
import ipaddress
import os
import socket
import stat
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Final, Self

import trio
import zmq

__all__ = [
    "DEFAULT_MAX_MSG_SIZE",
    "EndpointRefused",
    "Reach",
    "TrioSocket",
    "check_bind",
    "check_private_dir",
    "check_socket_path",
    "endpoint_reach",
    "ipc_path",
    "open_socket",
]

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

    async def send_multipart(
        self, frames: Sequence[Frame], *, copy: bool = True, track: bool = False
    ) -> zmq.MessageTracker | None:
        """Send one multipart message, waiting while the socket is at its high-water mark.
        With ``copy=False`` a caller must not reuse a frame's buffer before the send
        is done (pyzmq copies frames under 64 KiB anyway); ``track=True`` returns the
        tracker whose ``done`` says so (a pinned record buffer's release condition)."""
        with self._owned():
            await trio.lowlevel.checkpoint_if_cancelled()
            retried = False
            while True:
                try:
                    tracker = self._sock.send_multipart(
                        frames, zmq.NOBLOCK, copy=copy, track=track and not copy
                    )
                except zmq.Again:
                    retried = await self._wait(zmq.POLLOUT, retried)
                else:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    return tracker if track and isinstance(tracker, zmq.MessageTracker) else None

    def try_send_multipart(self, frames: Sequence[Frame]) -> bool:
        """Send one multipart message now or not at all: False when the socket (for a
        ROUTER, the addressed peer's queue) is at its high-water mark. Never waits. Other
        errors (a ROUTER_MANDATORY peer that is gone: ``EHOSTUNREACH``) raise
        ``zmq.ZMQError``. For the owner task only, between its awaits."""
        with self._owned():
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                return False
            return True

    async def recv_multipart(self) -> list[bytes]:
        """Receive one multipart message (all frames arrive together or none do)."""
        frames = await self._recv(copy=True)
        return frames  # type: ignore[return-value]

    async def recv_frames(self) -> list[zmq.Frame]:
        """Like :meth:`recv_multipart`, as ``zmq.Frame`` objects without a copy. A frame
        carries the message's properties, such as the ``User-Id`` a ZAP handler gave
        the peer (:mod:`spectrio.wire.curve`)."""
        frames = await self._recv(copy=False)
        return frames  # type: ignore[return-value]

    async def _recv(self, *, copy: bool) -> list[bytes] | list[zmq.Frame]:
        with self._owned():
            await trio.lowlevel.checkpoint_if_cancelled()
            retried = False
            while True:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=copy)
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
        try:
            trio.lowlevel.notify_closing(self._fd)
        except RuntimeError:  # not in Trio: no task can be waiting on it
            pass
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


class EndpointRefused(ValueError):
    """A bind the endpoint policy refuses; the message says why and what to do."""


class Reach(enum.Enum):
    """Who can connect to a bound endpoint."""

    LOCAL = "local"  # this machine only: loopback tcp, inproc, ipc in a private directory
    PUBLIC = "public"  # other hosts (a non-loopback address) or other users (abstract ipc)
    WILDCARD = "wildcard"  # every interface of this machine


_WORST = (Reach.LOCAL, Reach.PUBLIC, Reach.WILDCARD)


def _ip_reach(host: str) -> Reach | None:
    """The reach of a numeric host, or None when ``host`` is not numeric.

    ``getaddrinfo(AI_NUMERICHOST)`` reads every numeric spelling the C library (and so
    libzmq) accepts: ``0``, ``127.1``, ``0x7f.1``, ``2130706433``, ``::``, ``0:0::0``; its
    canonical result is classified by :mod:`ipaddress`. An IPv4-mapped IPv6 address
    (``::ffff:0.0.0.0``) counts as the IPv4 address it maps."""
    try:
        infos = socket.getaddrinfo(host, None, flags=socket.AI_NUMERICHOST)
    except (socket.gaierror, UnicodeError, ValueError):
        return None
    reach = Reach.LOCAL
    for info in infos:
        addr = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        this = (
            Reach.WILDCARD
            if addr.is_unspecified
            else Reach.LOCAL
            if addr.is_loopback
            else Reach.PUBLIC
        )
        reach = max(reach, this, key=_WORST.index)
    return reach


def _tcp_host(endpoint: str) -> str:
    host, sep, _port = endpoint[len("tcp://") :].rpartition(":")
    if not sep or not host:
        raise EndpointRefused(f"{endpoint!r}: a tcp:// endpoint is tcp://HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host


def _probe_host(host: str) -> Reach:
    """The reach of a host name (``localhost``, an interface name such as ``eth0``): let
    libzmq resolve it exactly as a bind would, on a throwaway socket and an ephemeral
    port, and classify the address it bound."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        probe = ctx.socket(zmq.PULL)
        try:
            probe.setsockopt(zmq.LINGER, 0)
            probe.bind(f"tcp://{host}:*")
            bound = probe.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            raise EndpointRefused(f"cannot bind host {host!r}: {exc}") from None
        finally:
            probe.close(linger=0)
    finally:
        ctx.term()
    reach = _ip_reach(_tcp_host(bound))
    assert reach is not None, bound
    return reach


def endpoint_reach(endpoint: str) -> Reach:
    """Who could connect if ``endpoint`` were bound. Raises :class:`EndpointRefused` for a
    transport other than ``tcp``, ``ipc`` and ``inproc``, or a malformed endpoint."""
    if endpoint.startswith("inproc://"):
        return Reach.LOCAL
    if endpoint.startswith("ipc://"):
        return Reach.PUBLIC if endpoint[len("ipc://") :].startswith("@") else Reach.LOCAL
    if not endpoint.startswith("tcp://"):
        raise EndpointRefused(f"unsupported endpoint {endpoint!r}: use ipc:// or tcp://")
    host = _tcp_host(endpoint)
    if host == "*":  # libzmq's own wildcard token
        return Reach.WILDCARD
    reach = _ip_reach(host)
    return reach if reach is not None else _probe_host(host)


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of an ``ipc://`` endpoint, made absolute; None for any other
    endpoint and for an abstract name (``ipc://@name``, which has no file)."""
    if not endpoint.startswith("ipc://"):
        return None
    rest = endpoint[len("ipc://") :]
    if rest.startswith("@"):
        return None
    if rest in ("", "*"):
        raise EndpointRefused(f"{endpoint!r}: name the socket file (ipc:///run/dir/name)")
    return Path(os.path.abspath(rest))


def check_private_dir(directory: Path) -> None:
    """Refuse a directory that another user could use to reach or replace our sockets: it
    must exist, be a directory owned by this user, and grant no group or other access."""
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        raise EndpointRefused(f"run directory {directory} does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise EndpointRefused(f"run directory {directory} is not a directory")
    if st.st_uid != os.geteuid():
        raise EndpointRefused(
            f"run directory {directory} is owned by uid {st.st_uid}, not by this user "
            f"(uid {os.geteuid()}); refusing to serve from it"
        )
    if st.st_mode & 0o077:
        raise EndpointRefused(
            f"run directory {directory} has mode {stat.S_IMODE(st.st_mode):04o}: group or "
            f"other users have access; run `chmod 700 {directory}` or choose another one"
        )


def check_bind(endpoint: str, *, allow_public: bool = False) -> Reach:
    """The endpoint policy; returns the endpoint's reach or raises :class:`EndpointRefused`.

    Allowed by default: loopback ``tcp://`` (``127.0.0.0/8``, ``::1``, names that resolve
    there), ``inproc://``, and ``ipc://`` files in a private directory
    (:func:`check_private_dir`; refused otherwise, whatever ``allow_public``). Needs
    ``allow_public``: any other address, a wildcard in any spelling (``*``, ``0``,
    ``0.0.0.0``, ``::``, ``[::]``, ``::ffff:0.0.0.0``, ...), which then binds every
    interface, and an abstract ``ipc://@name``, which any local user can connect to."""
    reach = endpoint_reach(endpoint)
    path = ipc_path(endpoint)
    if path is not None:
        check_private_dir(path.parent)
    if reach is Reach.LOCAL or allow_public:
        return reach
    if reach is Reach.WILDCARD:
        why = "a wildcard address binds every interface"
    elif endpoint.startswith("ipc://"):
        why = "any local user can connect to an abstract ipc name"
    else:
        why = "the address is not loopback"
    raise EndpointRefused(
        f"refusing to bind {endpoint!r}: {why} (pass allow_public / --allow-public, and "
        "use CURVE, to serve beyond this machine)"
    )


def _listening(path: Path) -> bool:
    """Whether a process accepts connections on the unix socket at ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def check_socket_path(path: Path) -> None:
    """Refuse to bind over ``path`` when it is not a socket (libzmq would delete it) or
    when a live process listens on it (libzmq would take its address over). A stale
    socket file passes (libzmq replaces it)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise EndpointRefused(f"{path} exists and is not a socket; refusing to replace it")
    if _listening(path):
        raise EndpointRefused(f"{path} is in use: another process listens on it")


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
    allow_public: bool = False,
) -> TrioSocket:
    """Create a socket of ``socket_type`` with its options set before ``bind``/``connect``.

    ``max_msg_size`` sets ``zmq.MAXMSGSIZE`` in bytes (None leaves libzmq's unlimited
    default). A ROUTER gets ``ROUTER_MANDATORY``, so a reply to a peer that is gone
    raises instead of vanishing silently. A ``bind`` must pass :func:`check_bind` (with
    ``allow_public``) before it is made, and the address libzmq actually bound must pass
    again after it; an ``ipc://`` bind never replaces a file that is not a socket or a
    socket another process listens on (:func:`check_socket_path`).
    """
    if (bind is None) == (connect is None):
        raise ValueError("give exactly one of bind= and connect=")
    endpoint = bind if bind is not None else connect
    assert endpoint is not None
    if bind is not None:
        check_bind(bind, allow_public=allow_public)
        path = ipc_path(bind)
        if path is not None:
            check_socket_path(path)
    sock = ctx.socket(socket_type)
    try:
        sock.setsockopt(zmq.LINGER, linger)
        if endpoint.startswith("tcp://") and ":" in _tcp_host(endpoint):
            sock.setsockopt(zmq.IPV6, 1)  # an IPv6 literal binds only with IPv6 on
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
            if endpoint.startswith("tcp://"):
                # What libzmq resolved a name to is what counts.
                check_bind(sock.getsockopt_string(zmq.LAST_ENDPOINT), allow_public=allow_public)
        else:
            sock.connect(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return TrioSocket(sock)
