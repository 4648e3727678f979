"""A ``spectrio serve --http`` subprocess for the HTTP tests, shared by a test module:
started once, read through its ready line, killed at teardown (its stderr shown with a
failing test)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import openai
from test_serve_process import Server

__all__ = ["HttpServer", "http_server", "sse_events"]


class HttpServer:
    def __init__(self, server: Server, ready: dict[str, str]) -> None:
        self.server = server
        self.ready = ready
        self.url: str = ready["http"]

    @property
    def pid(self) -> int:
        return self.server.pid

    @contextmanager
    def sdk(self, api_key: str = "unused", timeout: float | None = None) -> Iterator[openai.OpenAI]:
        """The official client on this server: no retries (a failure shows at once), and
        ``timeout`` seconds per request (None: the SDK's own)."""
        kw = {} if timeout is None else {"timeout": timeout}
        with openai.OpenAI(
            base_url=self.url + "/v1", api_key=api_key, max_retries=0, **kw
        ) as client:
            yield client


@contextmanager
def http_server(
    tmp: Path, *args: str, env: Mapping[str, str] | None = None
) -> Iterator[HttpServer]:
    """Start ``spectrio serve --http 127.0.0.1:0 ARGS`` (no timing cache: every run
    starts the same) and yield it once it printed its ready line."""
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:  # Popen copies the environment now
        server = Server(tmp, "serve", "--http", "127.0.0.1:0", "--timing-cache", "off", *args)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        yield HttpServer(server, server.wait_endpoints())
    finally:
        running = server.proc.poll() is None
        server.stop()
        err = server.stderr_path.read_text(errors="replace")[-6000:]
        state = "killed at teardown" if running else f"exited {server.proc.returncode}"
        sys.stderr.write(f"--- serve --http pid {server.pid}, {state}; its stderr:\n{err}\n")


def sse_events(body: str) -> list[str]:
    """The ``data:`` payloads of a server-sent event stream, checking its framing: every
    event is one ``data: `` line followed by a blank line."""
    assert body.endswith("\n\n"), body[-200:]
    events = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: ") and "\n" not in block, block[:200]
        events.append(block.removeprefix("data: "))
    return events
