"""One HTTP exchange and how it is answered (``docs/http.md``). :class:`Exchange` owns
the runtime requests that one HTTP request started; :func:`run_choices` follows their
streams in one Trio nursery, into a server-sent event response (:class:`EventStream`,
ending in ``data: [DONE]``) or into a JSON one (:func:`collect`). A client that
disconnects cancels the nursery, which closes the streams and so aborts every request
at once. The plain JSON and error responses every handler returns are here too."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import msgspec
import structlog
import trio
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from spectrio.errors import EngineDead
from spectrio.http_api.front import HttpFront
from spectrio.http_api.mapping import HttpError
from spectrio.http_api.responses import ChoiceState
from spectrio.runtime.api import Delta, RequestStream

__all__ = [
    "DONE",
    "EventStream",
    "Exchange",
    "collect",
    "engine_dead_error",
    "error_response",
    "json_response",
    "run_choices",
    "sse_event",
]

log = structlog.get_logger("spectrio.http")

DONE: Final = b"data: [DONE]\n\n"
_STREAM_BUFFER: Final = 16  # deltas waiting for a slow client, per response

Item = Delta | EngineDead
Handle = Callable[[int, Delta], Awaitable[None]]


# ---- plain responses --------------------------------------------------------------------


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        msgspec.json.encode(obj), status, headers=headers, media_type="application/json"
    )


def error_response(exc: HttpError) -> Response:
    return json_response(exc.body(), exc.status, exc.headers)


def engine_dead_error(exc: EngineDead) -> HttpError:
    return HttpError(503, f"the engine is dead: {exc}", type="server_error", code="engine_dead")


def sse_event(obj: Any) -> bytes:
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
                        await event(sse_event(engine_dead_error(dead).body()))
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


async def collect(request: Request, exchange: Exchange, states: Sequence[ChoiceState]) -> bool:
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
            raise engine_dead_error(dead)
    return not gone.cancelled_caught
