"""CURVE encryption and server authentication for endpoints beyond loopback.

Keys are pyzmq's ZPL certificate files (``zmq.auth.create_certificates``): the server
keeps ``NAME.key_secret``; clients get ``NAME.key`` (public only). A client proves it
knows the server's public key; its own key pair is made per client (:func:`client_keys`).
Sockets are configured before they bind or connect (``open_socket(configure=...)``).

Client identity. A CURVE server socket consults the ZAP handler of its context
(RFC 27, ``inproc://zeromq.zap.01``). :func:`run_zap_handler` accepts every CURVE client
(the server does not keep an allow list) and names it by its public key: every message
from that client then carries the key, Z85-encoded, as its ``User-Id`` property, so
the server can scope what a client may do (abort) to the key that submitted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import zmq
import zmq.auth
import zmq.utils.z85

from spectrio.wire.zmq_transport import TrioSocket

ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"
"""Where libzmq looks for the ZAP handler of a context (fixed by RFC 27)."""

ZAP_DOMAIN: Final = b"spectrio"


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
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)


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


def zap_reply(request: Sequence[bytes]) -> list[bytes]:
    """The ZAP reply (RFC 27) to one request: CURVE clients are accepted with their public
    key (Z85) as user id; NULL peers are accepted without one (they carry no credentials
    to check); any other mechanism, such as PLAIN with its password, is refused."""
    request_id = request[1] if len(request) > 1 else b""
    if len(request) < 6 or request[0] != b"1.0":
        return [b"1.0", request_id, b"400", b"malformed ZAP request", b"", b""]
    mechanism, credentials = request[5], request[6:]
    if mechanism == b"CURVE" and len(credentials) == 1 and len(credentials[0]) == 32:
        return [b"1.0", request_id, b"200", b"OK", zmq.utils.z85.encode(credentials[0]), b""]
    if mechanism == b"NULL":
        return [b"1.0", request_id, b"200", b"OK", b"", b""]
    return [b"1.0", request_id, b"400", b"mechanism not accepted", b"", b""]


async def run_zap_handler(sock: TrioSocket) -> None:
    """Answer ZAP requests on ``sock`` (a REP socket bound to :data:`ZAP_ENDPOINT` in the
    server's context) until cancelled."""
    while True:
        request = await sock.recv_multipart()
        await sock.send_multipart(zap_reply(request))
