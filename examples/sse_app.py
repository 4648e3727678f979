"""A small ASGI web app on spectrio: server-sent events, abort on disconnect, /health.

Run it with uvicorn (the web libraries are in spectrio's ``test`` extra, not in its
dependencies)::

    pip install -e '.[test]'
    uvicorn sse_app:app --app-dir examples --port 8000
    curl -N localhost:8000/generate -d '{"prompt": "def fib(n):", "params": {"max_tokens": 32}}'

``SPECTRIO_CONFIG`` may name a ``RuntimeConfig`` file (TOML or JSON, as ``spectrio serve
--config``); the default is the bundled model.

* ``POST /generate`` with ``{"prompt": text or token ids, "params": {SamplingParams}}``
  streams one SSE event per step, ``data: {"text", "token_ids", "finish_reason"}``, then
  ``data: [DONE]``. A bad request is refused with HTTP 400 and the field's reason before
  any event is sent: ``generate`` checks and submits the request when it is called.
* A client that disconnects cancels the response; leaving the stream's ``async with``
  aborts the request at once, and its KV blocks go back to the pool.
* ``GET /health`` answers from the event loop without touching the model: the runtime's
  counters (running requests, free KV blocks, finished requests by reason).
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from spectrio import InvalidRequest, RuntimeConfig, SamplingParams
from spectrio.runtime.aio import AsyncioRuntime, open_runtime_asyncio
from spectrio.runtime.config_file import load_config


def _config() -> RuntimeConfig:
    path = os.environ.get("SPECTRIO_CONFIG")
    return load_config(path) if path else RuntimeConfig()


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with open_runtime_asyncio(_config()) as rt:
        app.state.rt = rt
        yield


def _runtime(request: Request) -> AsyncioRuntime:
    rt = request.app.state.rt
    assert isinstance(rt, AsyncioRuntime)
    return rt


def _refusal(exc: InvalidRequest) -> JSONResponse:
    return JSONResponse({"error": exc.code, "reason": str(exc)}, status_code=400)


async def generate(request: Request) -> Response:
    try:
        body = await request.json()
    except ValueError:
        return JSONResponse({"error": "bad_json", "reason": "the body is not JSON"}, 400)
    if not isinstance(body, dict) or "prompt" not in body:
        return JSONResponse({"error": "missing_field", "reason": "prompt: required"}, 400)
    try:
        params = msgspec.convert(body.get("params") or {}, SamplingParams)
    except msgspec.ValidationError as exc:
        return JSONResponse({"error": "invalid_params", "reason": str(exc)}, 400)
    try:
        stream = _runtime(request).generate(body["prompt"], params)  # checked and submitted
    except InvalidRequest as exc:  # before any byte of the response: a 400, not a 200
        return _refusal(exc)

    async def events() -> AsyncIterator[str]:
        try:
            async for delta in stream:
                event = {
                    "text": delta.text,
                    "token_ids": delta.token_ids,
                    "finish_reason": delta.finish_reason,
                }
                yield f"data: {json.dumps(event)}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # a disconnect cancels us: closing the stream aborts the request at once
            await stream.aclose()

    # The background task closes the stream too when the client left before the first event.
    return StreamingResponse(
        events(), media_type="text/event-stream", background=BackgroundTask(stream.aclose)
    )


def _stats(rt: AsyncioRuntime) -> dict[str, Any]:
    snapshot = rt.stats()  # a plain call: the runtime runs on this thread (Trio guest mode)
    return {
        "running": snapshot.running,
        "waiting": snapshot.waiting,
        "free_kv_blocks": snapshot.free_kv_blocks,
        "num_kv_blocks": snapshot.num_kv_blocks,
        "finished": dict(snapshot.finished),
    }


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok", **_stats(_runtime(request))})


app = Starlette(
    routes=[Route("/generate", generate, methods=["POST"]), Route("/health", health)],
    lifespan=lifespan,
)
