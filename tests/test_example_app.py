"""Issue 15 item 14: ``examples/sse_app.py`` under a real uvicorn on a loopback port.
Greedy output over SSE equals the recorded golden continuation (float64) for concurrent
streams; a client that disconnects has its request aborted and its KV blocks freed; a bad
request is refused with HTTP 400 before any event; ``/health`` answers while streams run;
the block pool is back where it started."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((ROOT / "tests" / "data" / "bundled_golden.json").read_text())
START_TIMEOUT = 120.0


class App:
    def __init__(self, base: str, proc: subprocess.Popen[str], err: Path) -> None:
        self.base = base
        self.proc = proc
        self.err = err

    def health(self) -> dict[str, Any]:
        reply = httpx.get(f"{self.base}/health", timeout=10)
        assert reply.status_code == 200
        body: dict[str, Any] = reply.json()
        return body

    def events(self, prompt: str, **params: Any) -> list[dict[str, Any]]:
        """Every SSE event of one request, up to ``[DONE]``."""
        out: list[dict[str, Any]] = []
        body = {"prompt": prompt, "params": params}
        with httpx.stream("POST", f"{self.base}/generate", json=body, timeout=60) as reply:
            assert reply.status_code == 200
            assert reply.headers["content-type"].startswith("text/event-stream")
            for line in reply.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return out
                out.append(json.loads(line[len("data: ") :]))
        raise AssertionError(f"no [DONE] after {out}")


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    tmp = tmp_path_factory.mktemp("app")
    config = tmp / "config.json"
    config.write_text(json.dumps({"dtype": "float64", "max_model_len": 1024}))
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))  # uvicorn serves on this socket: no port race
    listener.set_inheritable(True)
    port = listener.getsockname()[1]
    err = tmp / "uvicorn.err"
    with err.open("w") as err_file:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "uvicorn", "sse_app:app"),
                *("--app-dir", str(ROOT / "examples"), "--fd", str(listener.fileno())),
                *("--log-level", "warning"),
            ],
            env={**os.environ, "SPECTRIO_CONFIG": str(config)},
            stderr=err_file,
            pass_fds=(listener.fileno(),),
            text=True,
        )
    listener.close()
    served = App(f"http://127.0.0.1:{port}", proc, err)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert proc.poll() is None, err.read_text()
            try:
                served.health()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, err.read_text()
                time.sleep(0.2)
        yield served
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def wait_for_free_blocks(app: App, want: int, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        health = app.health()
        if health["free_kv_blocks"] == want:
            return health
        assert time.monotonic() < deadline, f"{health} (free blocks before: {want})"
        time.sleep(0.02)


def test_greedy_output_over_sse_is_exact_for_concurrent_streams(app: App) -> None:
    free = app.health()["free_kv_blocks"]
    n = len(GOLDEN["token_ids"])
    with ThreadPoolExecutor(4) as pool:
        runs = list(
            pool.map(
                lambda _: app.events(GOLDEN["prompt"], max_tokens=n, ignore_eos=True), range(4)
            )
        )
    for events in runs:
        assert [t for e in events for t in e["token_ids"]] == GOLDEN["token_ids"]
        assert "".join(e["text"] for e in events) == GOLDEN["text"]
        assert events[-1]["finish_reason"] == "length"
    wait_for_free_blocks(app, free)


def test_a_disconnect_aborts_the_request_and_frees_its_blocks(app: App) -> None:
    free = app.health()["free_kv_blocks"]
    body = {"prompt": GOLDEN["prompt"], "params": {"max_tokens": 900, "ignore_eos": True}}
    with httpx.stream("POST", f"{app.base}/generate", json=body, timeout=60) as reply:
        seen = 0
        for line in reply.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                busy = app.health()  # /health answers while the stream runs
                assert busy["free_kv_blocks"] < free and busy["running"] == 1
                break  # leaving the loop closes the response: the client is gone
    t0 = time.monotonic()
    health = wait_for_free_blocks(app, free, timeout=3.0)  # 900 tokens would take far longer
    assert time.monotonic() - t0 < 3.0
    assert health["finished"].get("abort", 0) >= 1
    assert health["running"] == 0


def test_a_bad_request_is_refused_before_the_stream_starts(app: App) -> None:
    for body, code in [
        ({"prompt": "x", "params": {"max_tokens": 0}}, "invalid_params"),
        ({"prompt": "", "params": {}}, "empty_prompt"),
        ({"prompt": [1, 2.5]}, "wrong_type"),
    ]:
        reply = httpx.post(f"{app.base}/generate", json=body, timeout=30)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"] == code, reply.text
