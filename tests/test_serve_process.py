"""``spectrio serve`` as a process, the way an operator runs it (issue 9): its run
directory lock (item 7), its signal handling while serving (item 9) and during start-up
(item 12). Every subprocess runs under a timeout and is killed if a test fails."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from spectrio.core.params import SamplingParams
from spectrio.wire.stream_assembler import StreamAssembler
from spectrio.wire.sync_client import Client

SERVE = [sys.executable, "-m", "spectrio.tools.cli"]
START_TIMEOUT = 120.0


class Server:
    """A ``spectrio serve`` subprocess; stderr goes to a file so it never blocks."""

    def __init__(self, tmp_path: Path, *args: str, name: str = "serve") -> None:
        self.stderr_path = tmp_path / f"{name}-{time.monotonic_ns()}.err"
        self._err = self.stderr_path.open("w")
        self.proc = subprocess.Popen(
            [*SERVE, *args],
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
        )
        self.endpoints: dict[str, str] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        if not self._err.closed:
            self._err.flush()
        return self.stderr_path.read_text()

    def wait_endpoints(self, timeout: float = START_TIMEOUT) -> dict[str, str]:
        """The JSON line ``serve`` prints once its sockets are bound."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"no endpoints within {timeout}s:\n{self.stderr()}"
        line = self.proc.stdout.readline()
        assert line, f"serve exited with {self.proc.wait(5)}:\n{self.stderr()}"
        self.endpoints = json.loads(line)
        return self.endpoints

    def wait_stderr(self, text: str, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.stderr():
            assert self.proc.poll() is None, f"exited before {text!r}:\n{self.stderr()}"
            assert time.monotonic() < deadline, f"no {text!r} within {timeout}s:\n{self.stderr()}"
            time.sleep(0.01)

    def stdout_rest(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._err.close()


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for server in started:
        running = server.proc.poll() is None
        try:
            server.stop()
        finally:
            # Captured, so pytest shows it with a failing test only: the server's side (a
            # client timeout alone says nothing of whether it hung, died or lost output).
            state = "killed at teardown" if running else f"exited {server.proc.returncode}"
            err = server.stderr_path.read_text(errors="replace")[-8000:]
            sys.stderr.write(f"--- serve pid {server.pid}, {state}; its stderr:\n{err}\n")


def private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True)
    return path


def ping(requests: str) -> None:
    with Client(requests, None, timeout_s=30) as client:
        client.ping()


def short_generation(eps: dict[str, str]) -> list[int]:
    with Client(eps["requests"], eps["outputs"], timeout_s=60) as client:
        return [
            t
            for c in client.generate("def f(x):", SamplingParams(max_tokens=4))
            for t in c.token_ids
        ]


# ---- item 7: the run directory ------------------------------------------------------------


def test_second_server_exits_at_once_naming_the_first_which_keeps_serving(
    tmp_path: Path, servers: list[Server]
) -> None:
    run = tmp_path / "run"
    first = Server(tmp_path, "serve", "--run-dir", str(run), "--max-model-len", "128")
    servers.append(first)
    eps = first.wait_endpoints()
    assert eps["requests"] == f"ipc://{run}/requests"
    t0 = time.monotonic()
    second = subprocess.run(
        [*SERVE, "serve", "--run-dir", str(run)], capture_output=True, text=True, timeout=120
    )
    took = time.monotonic() - t0
    assert second.returncode == 2, second.stderr
    assert f"pid {first.pid}" in second.stderr and str(run) in second.stderr
    assert "model loaded" not in second.stderr  # refused before loading anything
    assert took < 30
    # The first one still owns its sockets and serves.
    assert len(short_generation(eps)) == 4
    first.proc.send_signal(signal.SIGTERM)
    assert first.proc.wait(30) == 0
    # A clean exit removes its socket files (the lock file stays, unlocked and empty).
    assert not (run / "requests").exists() and not (run / "outputs").exists()
    assert (run / "spectrio.lock").read_text() == ""


def test_stale_sockets_of_a_killed_server_are_cleaned_up(
    tmp_path: Path, servers: list[Server]
) -> None:
    run = tmp_path / "run"
    dead = Server(tmp_path, "serve", "--run-dir", str(run), "--max-model-len", "128")
    servers.append(dead)
    dead.wait_endpoints()
    dead.proc.kill()
    dead.proc.wait(30)
    assert (run / "requests").is_socket()  # left behind by SIGKILL
    fresh = Server(tmp_path, "serve", "--run-dir", str(run), "--max-model-len", "128")
    servers.append(fresh)
    eps = fresh.wait_endpoints()
    assert len(short_generation(eps)) == 4
    assert (run / "spectrio.lock").read_text().strip() == str(fresh.pid)


def test_a_path_that_is_not_a_socket_is_never_deleted(tmp_path: Path) -> None:
    run = private_dir(tmp_path / "run")
    (run / "requests").write_text("precious")
    (run / "outputs").mkdir()
    proc = subprocess.run(
        [*SERVE, "serve", "--run-dir", str(run)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "not a socket" in proc.stderr and str(run / "requests") in proc.stderr
    assert (run / "requests").read_text() == "precious"
    assert (run / "outputs").is_dir()
    # The same for an explicit ipc endpoint.
    proc = subprocess.run(
        [*SERVE, "serve", "--requests", f"ipc://{run}/requests", "--outputs", f"ipc://{run}/out"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "not a socket" in proc.stderr
    assert (run / "requests").read_text() == "precious"


def test_a_live_socket_of_another_program_is_not_taken_over(tmp_path: Path) -> None:
    run = private_dir(tmp_path / "run")
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(run / "requests"))
    other.listen()
    try:
        proc = subprocess.run(
            [*SERVE, "serve", "--run-dir", str(run)], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 2 and "in use" in proc.stderr
        assert (run / "requests").is_socket()
    finally:
        other.close()


def test_refused_endpoints_and_run_directories_fail_before_loading(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    cases = [
        (["--run-dir", str(shared)], "chmod 700"),
        (["--requests", "tcp://0:*", "--outputs", "tcp://127.0.0.1:*"], "wildcard"),
        (["--requests", "tcp://[::]:*", "--outputs", "tcp://127.0.0.1:*"], "wildcard"),
        (["--requests", "ipc://@spectrio-x", "--outputs", "tcp://127.0.0.1:*"], "abstract"),
        (["--requests", "tcp://10.9.8.7:5555", "--outputs", "tcp://127.0.0.1:*"], "not loopback"),
    ]
    for args, why in cases:
        proc = subprocess.run([*SERVE, "serve", *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (args, proc.stderr)
        assert why in proc.stderr and "model loaded" not in proc.stderr, (args, proc.stderr)


def test_public_without_curve_warns(tmp_path: Path, servers: list[Server]) -> None:
    server = Server(
        tmp_path,
        "serve",
        "--requests",
        "tcp://0.0.0.0:*",
        "--outputs",
        "tcp://127.0.0.1:*",
        "--allow-public",
        "--max-model-len",
        "128",
    )
    servers.append(server)
    eps = server.wait_endpoints()
    assert eps["requests"].startswith("tcp://0.0.0.0:")
    assert "without CURVE" in server.stderr()
    port = eps["requests"].rsplit(":", 1)[1]
    ping(f"tcp://127.0.0.1:{port}")


# ---- item 9: signals while serving --------------------------------------------------------


LONG = SamplingParams(max_tokens=1800, ignore_eos=True)


@pytest.mark.parametrize(
    ("signals", "grace"),
    [
        ((signal.SIGTERM, signal.SIGTERM), None),
        ((signal.SIGINT, signal.SIGINT), None),
        ((signal.SIGINT, signal.SIGTERM), None),
        ((signal.SIGTERM,), "0.5"),
        ((signal.SIGTERM, signal.SIGTERM, signal.SIGINT), None),
    ],
    ids=["term-term", "int-int", "int-term", "term-grace0.5", "term-term-int"],
)
def test_every_accepted_request_gets_its_final_step_in_every_signal_sequence(
    tmp_path: Path, servers: list[Server], signals: tuple[int, ...], grace: str | None
) -> None:
    """16 requests in flight; the signals arrive 0.2 s apart. The consumer sees a finish
    reason for each of the 16, and the server exits 0 within 15 s of the first signal."""
    args = ["serve", "--run-dir", str(tmp_path / "run"), "--max-model-len", "2000"]
    server = Server(tmp_path, *args, *(["--grace", grace] if grace else []))
    servers.append(server)
    eps = server.wait_endpoints()
    ids = [f"r{i}" for i in range(16)]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull = ctx.socket(zmq.PULL)  # connected before anything runs: no step goes elsewhere
    pull.setsockopt(zmq.LINGER, 0)
    pull.connect(eps["outputs"])
    assembler = StreamAssembler(track=ids)
    reasons: dict[str, str] = {}
    started: set[str] = set()
    try:
        with Client(eps["requests"], None, timeout_s=60, stream=False) as client:
            for i, rid in enumerate(ids):
                client.submit(f"def f{i}(x):", LONG, request_id=rid)
        while len(started) < len(ids):  # every request has produced tokens: in flight
            assert pull.poll(60_000)
            for chunk in assembler.feed(pull.recv_multipart()):
                started.add(chunk.request_id)
                assert chunk.finish_reason is None
        t0 = time.monotonic()
        for signum in signals:
            server.proc.send_signal(signum)
            time.sleep(0.2)
        while len(reasons) < len(ids) and pull.poll(20_000):
            for chunk in assembler.feed(pull.recv_multipart()):
                if chunk.finish_reason is not None:
                    reasons[chunk.request_id] = chunk.finish_reason
        code = server.proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        pull.close()
        ctx.term()
    assert sorted(reasons) == sorted(ids), server.stderr()
    assert set(reasons.values()) == {"abort"}
    assert code == 0, server.stderr()
    assert took < 15.0
    assert "Traceback" not in server.stderr()


def test_one_sigterm_with_the_default_grace_exits_within_15_s(
    tmp_path: Path, servers: list[Server]
) -> None:
    """The longest sequence: one signal, the default 10 s grace outlived by every request."""
    server = Server(
        tmp_path,
        *("--log-level", "info"),  # for the fixture's report, should this ever time out
        *("serve", "--run-dir", str(tmp_path / "run"), "--max-model-len", "2000"),
    )
    servers.append(server)
    eps = server.wait_endpoints()
    ids = [f"r{i}" for i in range(16)]
    with Client(eps["requests"], eps["outputs"], timeout_s=60) as client:
        for i, rid in enumerate(ids):
            client.submit(f"class C{i}:", LONG, request_id=rid)
        client.next_chunks()
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        reasons: dict[str, str | None] = {}
        while len(reasons) < len(ids):
            for chunk in client.next_chunks():
                if chunk.finished:
                    reasons[chunk.request_id] = chunk.finish_reason
    assert server.proc.wait(timeout=30) == 0
    took = time.monotonic() - t0
    assert sorted(reasons) == sorted(ids)
    assert 9.5 < took < 15.0


# ---- item 12: a signal during start-up ----------------------------------------------------

BANNER_MARKS = ("FatalError", "C++ Traceback", "Termination signal", "Traceback")


@pytest.mark.parametrize(
    ("signum", "when"),
    [
        (signal.SIGTERM, "loading the model"),
        (signal.SIGTERM, "model loaded"),  # during the warm-up pass
        (signal.SIGINT, "loading the model"),
        (signal.SIGINT, "model loaded"),
    ],
)
def test_a_signal_during_start_up_exits_cleanly(
    tmp_path: Path, servers: list[Server], signum: int, when: str
) -> None:
    run = tmp_path / "run"
    server = Server(tmp_path, "--log-level", "info", "serve", "--run-dir", str(run))
    servers.append(server)
    server.wait_stderr(when)
    t0 = time.monotonic()
    server.proc.send_signal(signum)
    code = server.proc.wait(timeout=30)
    out = server.stdout_rest()
    err = server.stderr()
    assert time.monotonic() - t0 < 15.0
    assert code == 0, err
    assert out == ""  # never started serving: no endpoints line, no banner
    assert not any(mark in out + err for mark in BANNER_MARKS), out + err
    assert "stopped during start-up" in err
    assert sorted(os.listdir(run)) == ["spectrio.lock"]  # no socket left behind
