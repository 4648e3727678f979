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
"""

from __future__ import annotations

import contextlib
import hmac
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, TypeVar

import msgspec
import structlog
import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from spectrio.core.params import InvalidRequest
from spectrio.errors import EngineDead
from spectrio.http_api.chat import start_chat
from spectrio.http_api.front import HttpFront
from spectrio.http_api.mapping import (
    COMPLETION_MAX_TOKENS,
    MAX_CHOICES,
    HttpError,
    chat_messages,
    check_chat,
    check_completion,
    decode,
    echo_only,
    error_body,
    invalid,
    per_choice,
    prompts_of,
    sampling_params,
)
from spectrio.http_api.responses import (
    ChoiceState,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    echo_chunk,
    usage,
)
from spectrio.http_api.schema import (
    ChatChunk,
    ChatCompletionRequest,
    ChatDelta,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from spectrio.runtime.api import Delta, RequestStream
from spectrio.wire.admission import message_cap

__all__ = ["build_app"]

log = structlog.get_logger("spectrio.http")

DONE: Final = b"data: [DONE]\n\n"
_STREAM_BUFFER: Final = 16  # deltas waiting for a slow client, per response
_Body = TypeVar("_Body", CompletionRequest, ChatCompletionRequest)

Item = Delta | EngineDead
Handle = Callable[[int, Delta], Awaitable[None]]


# ---- plain responses --------------------------------------------------------------------


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        msgspec.json.encode(obj), status, headers=headers, media_type="application/json"
    )


def error_response(exc: HttpError) -> Response:
    return _json(exc.body(), exc.status, exc.headers)


def _engine_dead(exc: EngineDead) -> HttpError:
    return HttpError(503, f"the engine is dead: {exc}", type="server_error", code="engine_dead")


def _sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


# ---- following the choices --------------------------------------------------------------


async def _pump(
    index: int, stream: RequestStream, send: trio.MemorySendChannel[tuple[int, Item]]
) -> None:
    async with send:
        try:
            async with stream:  # leaving it (done, cancelled) aborts an unfinished request
                async for delta in stream:
                    await send.send((index, delta))
        except EngineDead as exc:
            await send.send((index, exc))


async def run_choices(streams: Sequence[RequestStream], handle: Handle) -> EngineDead | None:
    """Follow every stream, handing each delta to ``handle`` (in one task, in the order
    they arrive; a choice's own deltas stay in order). Returns the engine's death if it
    died meanwhile. Cancellation closes every stream, which aborts its request."""
    if len(streams) == 1:  # one choice (n = 1, the usual case): no task, no channel
        try:
            async with streams[0] as stream:
                async for delta in stream:
                    await handle(0, delta)
        except EngineDead as exc:
            return exc
        return None
    send, receive = trio.open_memory_channel[tuple[int, Item]](_STREAM_BUFFER)
    dead: EngineDead | None = None
    try:
        async with trio.open_nursery() as nursery:
            async with send:
                for index, stream in enumerate(streams):
                    nursery.start_soon(_pump, index, stream, send.clone())
            async with receive:
                async for index, item in receive:
                    if isinstance(item, EngineDead):
                        # not `return item` here: the nursery's cancelled exit would drop it
                        dead = item
                        nursery.cancel_scope.cancel()
                        break
                    await handle(index, item)
    finally:
        for stream in streams:  # those whose task never ran
            stream.close()
    return dead


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` when the client disconnects (the body has been read, so the
    next ASGI message is the disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


class Exchange:
    """One HTTP request being answered: counted by the front (its drain waits for it)
    and owning the runtime requests it started, which :meth:`close` closes."""

    def __init__(self, front: HttpFront) -> None:
        self.front = front
        self.streams: list[RequestStream] = []
        self._closed = False
        self._cm = contextlib.ExitStack()
        self._cm.enter_context(front.exchange())

    def start(self, streams: Sequence[RequestStream]) -> None:
        self.streams += streams
        self._cm.enter_context(self.front.tracking(streams))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._cm.close()


class EventStream(Response):
    """A server-sent event response that follows ``exchange``'s streams: ``opening``
    events, then what ``handle`` sends for each delta, then ``closing()``'s events (or
    an error event if the engine died), then ``data: [DONE]``. A disconnect cancels it."""

    media_type = "text/event-stream"

    def __init__(
        self,
        exchange: Exchange,
        opening: Sequence[bytes],
        handle: Callable[[int, Delta, Callable[[bytes], Awaitable[None]]], Awaitable[None]],
        closing: Callable[[], Sequence[bytes]],
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})
        self._exchange = exchange
        self._opening = opening
        self._handle = handle
        self._closing = closing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def event(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        async def on_delta(index: int, delta: Delta) -> None:
            await self._handle(index, delta, event)

        try:
            with trio.CancelScope() as gone:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_cancel_on_disconnect, receive, gone)
                    await send(
                        {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
                    )
                    for data in self._opening:
                        await event(data)
                    dead = await run_choices(self._exchange.streams, on_delta)
                    if dead is not None:
                        await event(_sse(_engine_dead(dead).body()))
                    else:
                        for data in self._closing():
                            await event(data)
                    await event(DONE)
                    nursery.cancel_scope.cancel()
            if gone.cancelled_caught:
                log.info("client went away: its requests were aborted",
                         requests=[s.request_id for s in self._exchange.streams])  # fmt: skip
            else:
                # The body ends only once the disconnect watch has stopped: Hypercorn holds
                # a last send made while the app waits in receive() until the client hangs
                # up, so a client that asked to close (`Connection: close`, HTTP/1.0) and
                # reads to the end of the stream would wait for good.
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._exchange.close()


async def _collect(request: Request, exchange: Exchange, states: Sequence[ChoiceState]) -> bool:
    """Follow every choice to its end (``stream: false``). Returns False when the client
    went away first (its requests are then aborted); raises 503 if the engine died."""

    async def on_delta(index: int, delta: Delta) -> None:
        states[index].add(delta)

    with trio.CancelScope() as gone:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, request.receive, gone)
            dead = await run_choices(exchange.streams, on_delta)
            nursery.cancel_scope.cancel()
        if dead is not None:
            raise _engine_dead(dead)
    return not gone.cancelled_caught


# ---- request bodies ---------------------------------------------------------------------


async def read_body(request: Request, cap: int) -> bytes:
    """The body, or 413 when it is over ``cap`` bytes. A larger body is read and dropped
    up to the wire's transport limit (:func:`~spectrio.wire.admission.message_cap`), so a
    client that sends it whole still reads the 413; past that the connection is cut."""
    limit = message_cap(cap)
    declared = request.headers.get("content-length", "")
    too_large = HttpError(
        413,
        f"the request body is over {cap} bytes (the server's --max-request-bytes)",
        code="request_too_large",
    )
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async with contextlib.aclosing(request.stream()) as body:
        async for chunk in body:
            size += len(chunk)
            if size > limit:
                break
            if size <= cap:
                chunks.append(chunk)
    if size > cap:
        raise too_large
    return b"".join(chunks)


def _client(request: Request) -> str:
    return request.client.host if request.client is not None else "unknown"


# ---- the endpoints ----------------------------------------------------------------------


class _Endpoints:
    def __init__(self, front: HttpFront) -> None:
        self.front = front

    async def _answer(
        self, request: Request, body: Callable[[Request, Exchange], Awaitable[Response]]
    ) -> Response:
        """Run one generation endpoint; errors become OpenAI error objects. A streaming
        response takes the exchange over (it closes it when it ends)."""
        exchange = Exchange(self.front)
        response: Response | None = None
        try:
            response = await body(request, exchange)
        except HttpError as exc:
            response = error_response(exc)
        except InvalidRequest as exc:
            response = error_response(invalid(exc))
        except EngineDead as exc:
            response = error_response(_engine_dead(exc))
        except ClientDisconnect:
            response = Response(status_code=400)  # nobody reads it
        finally:
            if not isinstance(response, EventStream):
                exchange.close()
        return response

    async def completions(self, request: Request) -> Response:
        return await self._answer(request, self._completions)

    async def chat_completions(self, request: Request) -> Response:
        return await self._answer(request, self._chat)

    async def _read(self, request: Request, kind: type[_Body]) -> _Body:
        """The request's body as ``kind``, after the rate limit, and naming a served
        model."""
        front = self.front
        front.admit(_client(request))
        req = decode(await read_body(request, front.max_body_bytes), kind)
        front.check_model(req.model)
        return req

    async def _completions(self, request: Request, exchange: Exchange) -> Response:
        front = self.front
        req = await self._read(request, CompletionRequest)
        check_completion(req)
        prompts = prompts_of(req.prompt)
        n = req.n or 1
        if len(prompts) * n > MAX_CHOICES:
            raise InvalidRequest(
                "n", f"times the number of prompts must be at most {MAX_CHOICES}", got=n
            )
        params = sampling_params(
            req,
            vocab_size=front.vocab_size,
            default_max_tokens=COMPLETION_MAX_TOKENS,
            logprobs=req.logprobs,
        )
        ids = await front.prompt_ids(prompts)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        choices = per_choice(params, n)
        salt = req.cache_salt or ""
        only_prompt = echo_only(req)
        states: list[ChoiceState] = []
        for p, prompt_ids in enumerate(ids):
            prefix = ""
            if req.echo:
                text = prompts[p]
                prefix = text if isinstance(text, str) else front.rt.tokenizer.decode(prompt_ids)
            for i in range(n):
                index = p * n + i
                stream = front.start(prompt_ids, choices[i], f"{rid}-{index}", salt)
                exchange.start([stream])
                states.append(
                    ChoiceState(
                        index,
                        prefix=prefix,
                        offset=len(prefix),
                        prompt_ids=prompt_ids if req.echo else [],
                        echo_only=only_prompt,
                    )
                )
        prompt_tokens = sum(len(x) for x in ids)
        log.info("completion", id=rid, choices=len(states), prompt_tokens=prompt_tokens,
                 stream=bool(req.stream), user=req.user)  # fmt: skip
        strings = front.strings if req.logprobs is not None else None
        model = front.model_name
        if not req.stream:
            if not await _collect(request, exchange, states):
                return Response(status_code=499)  # the client is gone: nobody reads it
            return _json(
                completion_response(rid, created, model, states, prompt_tokens, strings, n)
            )

        # echo: the prompt first. Its logprobs come with the request's first delta, so
        # with logprobs each choice's prompt chunk waits for that delta; without, it opens
        # the stream at once.
        waits = bool(req.echo) and strings is not None
        echoed = [False] * len(states)
        opening = [] if waits else [_sse(echo_chunk(rid, created, model, s, None))
                                    for s in states if s.prefix]  # fmt: skip
        for s in states:
            s.offset = len(s.prefix)

        async def handle(
            index: int, delta: Delta, event: Callable[[bytes], Awaitable[None]]
        ) -> None:
            state = states[index]
            state.add(delta)
            if waits and not echoed[index]:
                echoed[index] = True
                await event(_sse(echo_chunk(rid, created, model, state, strings)))
            text, entries = delta.text, delta.logprobs
            if only_prompt:  # the generated token is not part of the answer
                text, entries = "", None
            if text or (delta.token_ids and not only_prompt) or delta.finished:
                reason = state.finish_reason if delta.finished else None
                chunk = completion_chunk(rid, created, model, state, text, entries, strings, reason)
                await event(_sse(chunk))

        def closing() -> list[bytes]:
            if req.stream_options is None or not req.stream_options.include_usage:
                return []
            last = Completion(id=rid, created=created, model=model, choices=[],
                              usage=usage(prompt_tokens, states, n))  # fmt: skip
            return [_sse(last)]

        return EventStream(exchange, opening, handle, closing)

    async def _chat(self, request: Request, exchange: Exchange) -> Response:
        front = self.front
        req = await self._read(request, ChatCompletionRequest)
        check_chat(req)
        messages = chat_messages(req.messages)
        n = req.n or 1
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(
            req,
            vocab_size=front.vocab_size,
            # as many as fit: the runtime ends the request at max_model_len ("length")
            default_max_tokens=front.max_model_len,
            logprobs=logprobs,
        )
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        streams, prompt_tokens = await start_chat(
            front,
            messages,
            per_choice(params, n),
            [f"{rid}-{i}" for i in range(n)],
            req.cache_salt or "",
        )
        exchange.start(streams)
        log.info(
            "chat completion",
            id=rid,
            choices=n,
            prompt_tokens=prompt_tokens,
            stream=bool(req.stream),
            user=req.user,
            safety_identifier=req.safety_identifier,
        )
        states = [ChoiceState(i) for i in range(n)]
        strings = front.strings if logprobs is not None else None
        tier = None if req.service_tier is None else "default"
        model = front.model_name
        if not req.stream:
            if not await _collect(request, exchange, states):
                return Response(status_code=499)
            return _json(chat_response(rid, created, model, states, prompt_tokens, strings, tier))

        opening = [
            _sse(
                chat_chunk(
                    rid,
                    created,
                    model,
                    i,
                    ChatDelta(role="assistant", content=""),
                    None,
                    None,
                    None,
                    tier,
                )
            )  # fmt: skip
            for i in range(n)
        ]

        async def handle(
            index: int, delta: Delta, event: Callable[[bytes], Awaitable[None]]
        ) -> None:
            states[index].add(delta)
            if delta.text or delta.token_ids or delta.finished:
                reason = delta.finish_reason if delta.finished else None
                content = ChatDelta(content=delta.text) if delta.text else ChatDelta()
                entries = (delta.logprobs or []) if strings is not None else None
                chunk = chat_chunk(
                    rid, created, model, index, content, entries, strings, reason, tier
                )
                await event(_sse(chunk))

        def closing() -> list[bytes]:
            if req.stream_options is None or not req.stream_options.include_usage:
                return []
            last = ChatChunk(id=rid, created=created, model=model, choices=[],
                             usage=usage(prompt_tokens, states, n), service_tier=tier)  # fmt: skip
            return [_sse(last)]

        return EventStream(exchange, opening, handle, closing)

    # ---- the rest ---------------------------------------------------------------------------

    def _card(self) -> ModelCard:
        f = self.front
        return ModelCard(id=f.model_name, created=f.created, max_model_len=f.max_model_len)

    async def models(self, request: Request) -> Response:
        return _json(ModelList(data=[self._card()]))

    async def model(self, request: Request) -> Response:
        try:
            self.front.check_model(request.path_params["model"])
        except HttpError as exc:
            return error_response(exc)
        return _json(self._card())

    async def health(self, request: Request) -> Response:
        try:
            self.front.check_available()
        except HttpError as exc:
            return error_response(exc)
        status, body = self.front.health()
        return _json(body, status)

    async def metrics(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if self.front.registry is None:
            return error_response(HttpError(404, "no metrics here", code="not_found"))
        return Response(generate_latest(self.front.registry), media_type=CONTENT_TYPE_LATEST)


# ---- authentication and the app ---------------------------------------------------------


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
    return _json(body, exc.status_code, dict(exc.headers or {}))


async def _server_error(request: Request, exc: Exception) -> Response:
    log.error("HTTP handler failed", path=request.url.path, exc_info=exc)
    return _json(
        error_body(f"internal error: {type(exc).__name__}", "server_error", None, None), 500
    )


def build_app(front: HttpFront) -> ASGIApp:
    """The ASGI app serving ``front``."""
    ep = _Endpoints(front)
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
