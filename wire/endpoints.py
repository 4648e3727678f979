"""Where a server listens, and the one server per run directory.

Guarantees:

* **The endpoint policy.** An endpoint passes :func:`check_endpoint` (the transport's
  :func:`~spectrio.wire.zmq_transport.check_bind`): loopback ``tcp://`` and ``ipc://`` in
  a private directory pass; anything another host or user could reach needs
  ``allow_public``. Otherwise :class:`EndpointRefused` says why.
* **One server per run directory.** :func:`claim_endpoints` holds an ``fcntl.flock`` on
  ``spectrio.lock`` (:data:`LOCK_FILE`) in every directory with an ``ipc://`` socket,
  without waiting, and writes its pid there: a second server is refused with
  :class:`ServerRunning`, naming the first one's pid. The lock goes with the process, so a
  server killed by SIGKILL leaves nothing that blocks the next one.
* **Stale sockets only.** Holding the lock, the claim removes the socket files a dead
  server left; anything at a socket path that is not a socket, or a live listener that
  is not a spectrio server, is refused and never deleted.
* **A server cleans up after itself.** :meth:`EndpointClaim.release` removes its own
  socket files (sockets only), then drops the locks.

The claim is cheap and runs before anything expensive (the CLI claims before it loads the
model), so a refused server fails at once.
"""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Final

import msgspec
import structlog

from spectrio.wire.zmq_transport import (
    EndpointRefused,
    Reach,
    check_bind,
    check_private_dir,
    check_socket_path,
    ipc_path,
)

__all__ = [
    "LOCK_FILE",
    "EndpointClaim",
    "EndpointRefused",
    "ServerEndpoints",
    "ServerRunning",
    "check_endpoint",
    "claim_endpoints",
    "default_endpoints",
]

log = structlog.get_logger("spectrio.server")

LOCK_FILE: Final = "spectrio.lock"
"""The lock file a server holds in each directory with its ``ipc://`` sockets."""


def check_endpoint(endpoint: str, *, allow_public: bool = False) -> Reach:
    """The server's endpoint policy (:func:`spectrio.wire.zmq_transport.check_bind`):
    loopback ``tcp://`` and ``ipc://`` in a private directory pass; anything another host
    or user could reach needs ``allow_public``; raises :class:`EndpointRefused`."""
    return check_bind(endpoint, allow_public=allow_public)


def default_endpoints(run_dir: str | os.PathLike[str] | None = None) -> ServerEndpoints:
    """``ipc://`` endpoints under ``run_dir`` (default ``$XDG_RUNTIME_DIR/spectrio``, else
    ``<tmp>/spectrio-<uid>``). A missing directory is created with mode 0700; an existing
    one must be private (owned by this user, no group or other access), otherwise
    :class:`EndpointRefused` says why."""
    if run_dir is None:
        base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        name = "spectrio" if os.environ.get("XDG_RUNTIME_DIR") else f"spectrio-{os.getuid()}"
        run_dir = Path(base) / name
    path = Path(os.path.abspath(run_dir))
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    check_private_dir(path)
    return ServerEndpoints(
        requests=f"ipc://{path}/requests", outputs=f"ipc://{path}/outputs", tap=f"ipc://{path}/tap"
    )


class ServerRunning(RuntimeError):
    """Another server holds the run directory."""

    def __init__(self, directory: Path, pid: int | None) -> None:
        who = f"pid {pid}" if pid is not None else "a process whose pid is not recorded"
        super().__init__(
            f"run directory {directory} is in use by a running spectrio server ({who}); "
            "stop it first, or serve from another run directory"
        )
        self.directory = directory
        self.pid = pid


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def _lock_dir(directory: Path) -> int:
    """Hold ``directory/spectrio.lock`` (``flock``, not waiting) and write our pid in it."""
    fd = os.open(
        directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _read_pid(fd)
        os.close(fd)
        raise ServerRunning(directory, pid) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _remove_stale(path: Path) -> None:
    """Delete a socket file a dead server left at ``path`` (we hold its directory's lock,
    so no live spectrio server owns it). Anything else at the path is refused, never
    deleted."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise EndpointRefused(f"{path} exists and is not a socket; refusing to replace it")
    check_socket_path(path)  # a live listener that is not a spectrio server: refuse
    os.unlink(path)
    log.info("removed a stale socket file", path=str(path))


class EndpointClaim:
    """The endpoints of one server, checked against the endpoint policy, with every
    directory holding an ``ipc://`` socket locked. Create it with :func:`claim_endpoints`;
    :meth:`release` (or leaving the ``with`` block) removes this server's socket files and
    drops the locks."""

    def __init__(
        self,
        endpoints: Sequence[str],
        reaches: Sequence[Reach],
        paths: Sequence[Path],
        fds: Sequence[int],
    ) -> None:
        self.endpoints = tuple(endpoints)
        self.reaches = tuple(reaches)
        self.paths = tuple(paths)
        self._fds = list(fds)

    @property
    def public(self) -> bool:
        """Whether another host or user can reach any of the endpoints."""
        return any(r is not Reach.LOCAL for r in self.reaches)

    def release(self) -> None:
        """Remove the socket files (only sockets: never anything else), then unlock. Safe
        to call twice."""
        if not self._fds:
            return
        for path in self.paths:
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)
            except FileNotFoundError:
                pass
        for fd in self._fds:
            try:
                os.ftruncate(fd, 0)
            finally:
                os.close(fd)  # closing the last descriptor drops the flock
        self._fds = []

    def __enter__(self) -> EndpointClaim:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def claim_endpoints(*endpoints: str | None, allow_public: bool = False) -> EndpointClaim:
    """Check ``endpoints`` (None entries are skipped) against the policy, lock the
    directory of every ``ipc://`` socket, and remove the socket files a dead server left.
    Cheap and done before anything expensive, so a refused server fails at once.

    Raises :class:`EndpointRefused` (the policy, a private-directory violation, a path that
    is not a socket) or :class:`ServerRunning` (another server holds a run directory,
    named with its pid)."""
    given = [ep for ep in endpoints if ep is not None]
    reaches = [check_endpoint(ep, allow_public=allow_public) for ep in given]
    paths = [p for p in (ipc_path(ep) for ep in given) if p is not None]
    fds: list[int] = []
    try:
        for directory in sorted({p.parent for p in paths}):
            fds.append(_lock_dir(directory))
        for path in paths:
            _remove_stale(path)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return EndpointClaim(given, reaches, paths, fds)


class ServerEndpoints(msgspec.Struct, frozen=True, kw_only=True):
    """The endpoints actually bound (``tcp://127.0.0.1:*`` resolved to its port)."""

    requests: str
    outputs: str
    tap: str | None = None
