"""The endpoint policy (issue 9, item 8): one policy, addresses classified with
``ipaddress``, every spelling of an address treated alike, real binds over real sockets.

Loopback and ipc in a private run directory pass by default. Any non-loopback address,
every spelling of a wildcard and an abstract ipc name need ``allow_public``; with it, a
wildcard binds every interface (every spelling alike). A run directory that is not
owned by the user, or that group or others can enter, is refused whatever the flag."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from spectrio.wire.server import check_endpoint, claim_endpoints, default_endpoints
from spectrio.wire.zmq_transport import EndpointRefused, Reach, check_bind, open_socket

Context = zmq.Context[zmq.Socket[bytes]]

LOOPBACK = [
    "tcp://127.0.0.1:*",
    "tcp://127.1:*",  # inet_aton shorthand
    "tcp://0177.0.0.1:*",  # octal
    "tcp://0x7f.1:*",  # hex
    "tcp://2130706433:*",  # one 32-bit number
    "tcp://127.255.255.254:*",  # anywhere in 127.0.0.0/8
    "tcp://[::1]:*",
    "tcp://[0:0:0:0:0:0:0:1]:*",
    "tcp://[::ffff:127.0.0.1]:*",  # IPv4-mapped loopback
    "tcp://[::ffff:7f00:1]:*",
    "tcp://localhost:*",  # a name: decided by what libzmq binds
    "tcp://lo:*",  # an interface name, likewise
]

WILDCARDS = [
    "tcp://*:*",
    "tcp://0:*",
    "tcp://00:*",
    "tcp://0x0:*",
    "tcp://0.0:*",
    "tcp://0.0.0:*",
    "tcp://0.0.0.0:*",
    "tcp://000.000.000.000:*",
    "tcp://[::]:*",
    "tcp://:::*",  # host "::", port "*" (unbracketed)
    "tcp://[0:0::0]:*",
    "tcp://[0:0:0:0:0:0:0:0]:*",
    "tcp://[::ffff:0.0.0.0]:*",
    "tcp://[::ffff:0:0]:*",
]

PUBLIC = [
    "tcp://10.1.2.3:5555",
    "tcp://192.168.0.1:5555",
    "tcp://8.8.8.8:5555",
    "tcp://169.254.1.1:5555",
    "tcp://[fe80::1]:5555",
    "tcp://[2001:db8::1]:5555",
    "tcp://[::ffff:10.0.0.1]:5555",
    "ipc://@spectrio-abstract",
]


@pytest.fixture
def ctx() -> Iterator[Context]:
    context: Context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def private(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    return run


@pytest.mark.parametrize("endpoint", LOOPBACK)
def test_loopback_spellings_pass_by_default_and_bind_loopback(endpoint: str, ctx: Context) -> None:
    assert check_endpoint(endpoint) is Reach.LOCAL
    sock = open_socket(ctx, zmq.PULL, bind=endpoint)
    try:
        assert check_bind(sock.socket.getsockopt_string(zmq.LAST_ENDPOINT)) is Reach.LOCAL
    finally:
        sock.close()


@pytest.mark.parametrize("endpoint", WILDCARDS)
def test_every_wildcard_spelling_needs_the_flag_and_then_binds_every_interface(
    endpoint: str, ctx: Context
) -> None:
    with pytest.raises(EndpointRefused, match="wildcard"):
        check_endpoint(endpoint)
    with pytest.raises(EndpointRefused, match="wildcard"):
        open_socket(ctx, zmq.PULL, bind=endpoint)
    with pytest.raises(EndpointRefused, match="wildcard"):
        claim_endpoints(endpoint)
    assert check_endpoint(endpoint, allow_public=True) is Reach.WILDCARD
    sock = open_socket(ctx, zmq.PULL, bind=endpoint, allow_public=True)
    try:
        bound = sock.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        assert check_bind(bound, allow_public=True) is Reach.WILDCARD, bound
    finally:
        sock.close()


@pytest.mark.parametrize("endpoint", PUBLIC)
def test_public_endpoints_need_the_flag(endpoint: str) -> None:
    with pytest.raises(EndpointRefused, match="allow.public"):
        check_endpoint(endpoint)
    assert check_endpoint(endpoint, allow_public=True) is Reach.PUBLIC


def test_abstract_ipc_binds_only_with_the_flag(ctx: Context) -> None:
    with pytest.raises(EndpointRefused, match="abstract"):
        open_socket(ctx, zmq.PULL, bind="ipc://@spectrio-test-abstract")
    sock = open_socket(ctx, zmq.PULL, bind="ipc://@spectrio-test-abstract", allow_public=True)
    sock.close()


def test_an_interface_name_is_judged_by_the_address_libzmq_binds(ctx: Context) -> None:
    for _, name in socket.if_nameindex():
        try:
            reach = check_endpoint(f"tcp://{name}:*", allow_public=True)
        except EndpointRefused:
            continue  # an interface without an address
        if reach is Reach.PUBLIC:
            break
    else:
        pytest.skip("no interface with a non-loopback address")
    with pytest.raises(EndpointRefused, match="not loopback"):
        check_endpoint(f"tcp://{name}:*")
    with pytest.raises(EndpointRefused, match="not loopback"):
        open_socket(ctx, zmq.PULL, bind=f"tcp://{name}:*")


@pytest.mark.parametrize(
    ("endpoint", "match"),
    [
        ("udp://127.0.0.1:1", "unsupported"),
        ("pgm://eth0;239.192.1.1:5555", "unsupported"),
        ("tcp://127.0.0.1", "tcp://HOST:PORT"),
        ("ipc://*", "name the socket file"),
        ("ipc://", "name the socket file"),
        ("ipc:///tmp/spectrio-policy-test", "mode 1777"),  # /tmp: everyone can enter
        ("ipc:///nonexistent-dir/x", "does not exist"),
    ],
)
def test_refused_whatever_the_flag(endpoint: str, match: str) -> None:
    for allow_public in (False, True):
        with pytest.raises(EndpointRefused, match=match):
            check_endpoint(endpoint, allow_public=allow_public)


def test_ipc_in_a_private_directory_passes(private: Path, ctx: Context) -> None:
    assert check_endpoint(f"ipc://{private}/sock") is Reach.LOCAL
    open_socket(ctx, zmq.PULL, bind=f"ipc://{private}/sock").close()


@pytest.mark.parametrize("mode", [0o750, 0o705, 0o770, 0o777, 0o701])
def test_a_run_directory_others_can_enter_is_refused(tmp_path: Path, mode: int) -> None:
    run = tmp_path / "shared"
    run.mkdir()
    run.chmod(mode)
    for allow_public in (False, True):
        with pytest.raises(EndpointRefused, match=f"mode {mode:04o}"):
            check_endpoint(f"ipc://{run}/requests", allow_public=allow_public)
    with pytest.raises(EndpointRefused, match="chmod 700"):
        default_endpoints(run)
    run.chmod(0o700)
    assert default_endpoints(run).requests == f"ipc://{run}/requests"


def test_a_run_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a directory owned by another user needs root")
    run = tmp_path / "theirs"
    run.mkdir(mode=0o700)
    os.chown(run, 4242, 4242)
    with pytest.raises(EndpointRefused, match="owned by uid 4242"):
        default_endpoints(run)
    with pytest.raises(EndpointRefused, match="owned by uid 4242"):
        check_endpoint(f"ipc://{run}/requests", allow_public=True)


def test_default_run_directory_is_created_private(tmp_path: Path) -> None:
    eps = default_endpoints(tmp_path / "a" / "rt")
    assert eps.requests == f"ipc://{tmp_path}/a/rt/requests"
    assert (tmp_path / "a" / "rt").stat().st_mode & 0o777 == 0o700


def test_relative_ipc_paths_are_judged_by_their_real_directory(
    tmp_path: Path, private: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(private)
    assert check_endpoint("ipc://sock") is Reach.LOCAL
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    monkeypatch.chdir(shared)
    with pytest.raises(EndpointRefused, match="mode 0755"):
        check_endpoint("ipc://sock")
