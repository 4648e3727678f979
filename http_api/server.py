"""Serving the HTTP front: Hypercorn's Trio worker, inside the runtime's own Trio run.

:func:`serve_http` binds, reports the base URL through ``task_status`` and serves until
the front's ``stopped`` event (Hypercorn's shutdown trigger: :meth:`HttpFront.drain`
or :meth:`HttpFront.stop` set it) or until cancelled. Hypercorn's own log lines go
through structlog (``spectrio.http.hypercorn``); its access log is off (each generation
request logs one line of its own).
"""

from __future__ import annotations

import logging
import socket

import structlog
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from spectrio.http_api.app import build_app
from spectrio.http_api.front import HttpFront

__all__ = ["serve_http"]

log = structlog.get_logger("spectrio.http")

GRACEFUL_S = 2.0
"""Seconds Hypercorn gives open connections once stopped; :meth:`HttpFront.drain` has
already ended every response by then, so this only bounds idle keep-alive connections."""


class _ToStructlog(logging.Handler):
    """Hypercorn logs through the standard library; hand its records to structlog."""

    def emit(self, record: logging.LogRecord) -> None:
        log.log(record.levelno, record.getMessage(), source="hypercorn")


def _hypercorn_logger() -> logging.Logger:
    logger = logging.getLogger("spectrio.http.hypercorn")
    if not logger.handlers:
        logger.addHandler(_ToStructlog())
        logger.propagate = False
        logger.setLevel(logging.INFO)
    return logger


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``; raises ``OSError`` (the port is taken, the
    address is not this host's) before anything is served."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # events leave at once
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _config(sock: socket.socket) -> Config:
    config = Config()
    # Hypercorn takes the bound socket over (and closes it when it stops).
    config.bind = [f"fd://{sock.detach()}"]
    config.accesslog = None
    config.errorlog = _hypercorn_logger()
    config.graceful_timeout = GRACEFUL_S
    return config


async def serve_http(
    front: HttpFront,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    sock: socket.socket | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``front`` on ``host:port`` (port 0: a free one), or on ``sock`` already
    bound (:func:`bind_socket`; the CLI binds before it loads the model), until its
    ``stopped`` event is set or this is cancelled; ``task_status`` gets the base URL
    (``http://127.0.0.1:8000``). Cancellation closes every connection, which aborts the
    requests of open responses. A bind that fails raises ``OSError`` before anything
    starts."""
    config = _config(sock if sock is not None else bind_socket(host, port))
    app = build_app(front)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(front.watch_engine)

        async def run(task_status: trio.TaskStatus[list[str]]) -> None:
            try:
                await serve(
                    app,  # type: ignore[arg-type]  # Starlette's ASGI types vs Hypercorn's
                    config,
                    shutdown_trigger=front.stopped.wait,
                    task_status=task_status,
                )
            finally:
                nursery.cancel_scope.cancel()  # the engine watch ends with the server

        binds: list[str] = await nursery.start(run)
        url = binds[0]
        log.info("serving HTTP", url=url, model=front.model_name, auth=front.api_key is not None)
        task_status.started(url)
