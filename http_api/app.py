"""The Starlette app of the HTTP front (routes and statuses: ``docs/http.md``).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``
(and ``/v1/models/{id}``), ``GET /health`` and ``GET /metrics``. With an API key, the
``/v1/`` routes need ``Authorization: Bearer KEY`` (compared in constant time);
``/health`` and ``/metrics`` stay open, for probes and scrapers.

Every request is checked, and every runtime request submitted, before the first byte
of the response: a refusal is an error status, never a 200 with an error inside. A
response then follows the choices' streams (one runtime request per choice) in one Trio
nursery; a client that disconnects cancels it, which closes the streams and so aborts
every request at once (their KV blocks are freed at the next plan). Streaming responses
are server-sent events, one chunk per step per choice, ending in ``data: [DONE]``; if
the engine dies meanwhile, the stream gets an error event and then ``data: [DONE]``.

The app runs on whatever Trio run serves it (Starlette runs on Trio through anyio), so
it awaits the runtime directly: no thread, no second event loop.

The handlers are :mod:`.endpoints`, the exchanges they answer :mod:`.exchange`; this
module assembles the app, its error handlers and its authentication.
"""

from __future__ import annotations

import hmac

import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from spectrio.http_api.endpoints import Endpoints, read_body
from spectrio.http_api.exchange import (
    DONE,
    EventStream,
    Exchange,
    Handle,
    Item,
    error_response,
    json_response,
    run_choices,
)
from spectrio.http_api.front import HttpFront
from spectrio.http_api.mapping import HttpError, error_body

__all__ = ["build_app"]

# Names this module held before it was split, kept importable from here.
_SPLIT_OFF = (DONE, EventStream, Exchange, Handle, Item, read_body, run_choices)

log = structlog.get_logger("spectrio.http")


class BearerAuth:
    """ASGI middleware: ``/v1/`` routes need ``Authorization: Bearer KEY``, compared in
    constant time (``hmac.compare_digest``; only the length can leak)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self._key = key.encode("utf-8")

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"].startswith("/v1")
            and not self._authorized(scope)
        ):
            refused = HttpError(
                401,
                "a valid API key is required: Authorization: Bearer KEY",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await error_response(refused)(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    body = error_body(f"{exc.detail}: {request.method} {request.url.path}",
                      "invalid_request_error", None, code)  # fmt: skip
    return json_response(body, exc.status_code, dict(exc.headers or {}))


async def _server_error(request: Request, exc: Exception) -> Response:
    log.error("HTTP handler failed", path=request.url.path, exc_info=exc)
    return json_response(
        error_body(f"internal error: {type(exc).__name__}", "server_error", None, None), 500
    )


def build_app(front: HttpFront) -> ASGIApp:
    """The ASGI app serving ``front``."""
    ep = Endpoints(front)
    app = Starlette(
        routes=[
            Route("/v1/completions", ep.completions, methods=["POST"]),
            Route("/v1/chat/completions", ep.chat_completions, methods=["POST"]),
            Route("/v1/models", ep.models, methods=["GET"]),
            Route("/v1/models/{model:path}", ep.model, methods=["GET"]),
            Route("/health", ep.health, methods=["GET"]),
            Route("/metrics", ep.metrics, methods=["GET"]),
        ],
        exception_handlers={HTTPException: _http_exception, Exception: _server_error},
    )
    return BearerAuth(app, front.api_key) if front.api_key else app
