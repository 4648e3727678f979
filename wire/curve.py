"""CURVE encryption and server authentication for endpoints beyond loopback.

Keys are pyzmq's ZPL certificate files (``zmq.auth.create_certificates``): the server
keeps ``NAME.key_secret``; clients get ``NAME.key`` (public only). A client proves it
knows the server's public key; its own key pair is made per connection. Sockets are
configured before they bind or connect (``open_socket(configure=...)``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import zmq
import zmq.auth


class CurveError(ValueError):
    """Key files that cannot be used, or a libzmq built without CURVE."""


@dataclasses.dataclass(frozen=True)
class CurveServerKeys:
    public: bytes
    secret: bytes

    def apply(self, sock: zmq.Socket[bytes]) -> None:
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.curve_server = True


@dataclasses.dataclass(frozen=True)
class CurveClientKeys:
    server_public: bytes
    public: bytes
    secret: bytes

    def apply(self, sock: zmq.Socket[bytes]) -> None:
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


def _require_curve() -> None:
    if not zmq.has("curve"):
        raise CurveError("this libzmq was built without CURVE support")


def create_keys(directory: str | Path, name: str = "server") -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` into ``directory``."""
    _require_curve()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


def _read_certificate(path: str | Path) -> tuple[bytes, bytes | None]:
    _require_curve()
    try:
        return zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise CurveError(f"{path}: cannot read CURVE certificate ({exc})") from exc


def load_server_keys(secret_file: str | Path) -> CurveServerKeys:
    public, secret = _read_certificate(secret_file)
    if secret is None:
        raise CurveError(f"{secret_file}: holds no secret key (pass NAME.key_secret)")
    return CurveServerKeys(public=public, secret=secret)


def client_keys(server_public_file: str | Path) -> CurveClientKeys:
    server_public, _ = _read_certificate(server_public_file)
    public, secret = zmq.curve_keypair()
    return CurveClientKeys(server_public=server_public, public=public, secret=secret)
