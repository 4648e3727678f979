"""The HTTP front's route handlers (:class:`Endpoints`): the generation endpoints
(``/v1/completions``, ``/v1/chat/completions``), which check every request and submit
every runtime request before the first byte of the response, so a refusal is an error
status, never a 200 with an error inside; and the model list, health and metrics."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from spectrio.core.params import InvalidRequest
from spectrio.errors import EngineDead
from spectrio.http_api.chat import start_chat
from spectrio.http_api.exchange import (
    EventStream,
    Exchange,
    collect,
    engine_dead_error,
    error_response,
    json_response,
    sse_event,
)
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
    invalid,
    per_choice,
    prompts_of,
    sampling_params,
)
from spectrio.http_api.response_format import (
    Sourced,
    constraint_sources,
    one_constraint,
    requested_constraint,
)
from spectrio.http_api.responses import (
    ChoiceState,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    delta_tool_calls,
    echo_chunk,
    tool_finish,
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
from spectrio.http_api.tool_calls import ToolPlan, default_format, tool_plan
from spectrio.http_api.tool_parsers import ToolParser
from spectrio.runtime.api import Delta
from spectrio.wire.admission import message_cap

__all__ = ["Endpoints", "read_body"]

log = structlog.get_logger("spectrio.http")

_Body = TypeVar("_Body", CompletionRequest, ChatCompletionRequest)


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


def _checked(plan: ToolPlan | None, asked: Sourced | None, runs: Sourced | None) -> list[Sourced]:
    """The constraints to compile before a chat runs, each refused by its own field:
    each called function's parameters (``tools[i].function.parameters``), the
    constraint the request's fields ask for, and the one it runs (the two differ when
    tool_choice auto meets a JSON format: :meth:`ToolPlan.with_answer`)."""
    out = [] if plan is None else list(plan.schemas)
    out += [s for s in (asked, runs) if s is not None and s not in out]
    return out


class Endpoints:
    """The route handlers over one front; :func:`~spectrio.http_api.app.build_app` routes
    to them."""

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
            response = error_response(engine_dead_error(exc))
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
        sourced = requested_constraint(req)
        params = sampling_params(
            req,
            vocab_size=front.vocab_size,
            default_max_tokens=COMPLETION_MAX_TOKENS,
            logprobs=req.logprobs,
            constraint=sourced,
        )
        if sourced is not None:
            await front.check_constraints([sourced])
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
            if not await collect(request, exchange, states):
                return Response(status_code=499)  # the client is gone: nobody reads it
            return json_response(
                completion_response(rid, created, model, states, prompt_tokens, strings, n)
            )

        # echo: the prompt first. Its logprobs come with the request's first delta, so
        # with logprobs each choice's prompt chunk waits for that delta; without, it opens
        # the stream at once.
        waits = bool(req.echo) and strings is not None
        echoed = [False] * len(states)
        opening = [] if waits else [sse_event(echo_chunk(rid, created, model, s, None))
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
                await event(sse_event(echo_chunk(rid, created, model, state, strings)))
            text, entries = delta.text, delta.logprobs
            if only_prompt:  # the generated token is not part of the answer
                text, entries = "", None
            if text or (delta.token_ids and not only_prompt) or delta.finished:
                reason = state.finish_reason if delta.finished else None
                chunk = completion_chunk(rid, created, model, state, text, entries, strings, reason)
                await event(sse_event(chunk))

        def closing() -> list[bytes]:
            if req.stream_options is None or not req.stream_options.include_usage:
                return []
            last = Completion(id=rid, created=created, model=model, choices=[],
                              usage=usage(prompt_tokens, states, n))  # fmt: skip
            return [sse_event(last)]

        return EventStream(exchange, opening, handle, closing)

    async def _chat(self, request: Request, exchange: Exchange) -> Response:
        front = self.front
        req = await self._read(request, ChatCompletionRequest)
        check_chat(req)
        template = front.rt.chat_template
        plan = tool_plan(
            req,
            template_source=None if template is None else template.source,
            reads_tools=template is not None and template.reads_tools,
        )
        messages = chat_messages(req.messages)
        if template is not None and not template.reads_tools:
            messages = default_format(messages, plan)
        found = constraint_sources(req)
        if plan is not None and plan.constraint is not None:
            found.append(plan.constraint)
        asked = one_constraint(found)
        sourced = asked if plan is None else plan.with_answer(asked)
        n = req.n or 1
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(
            req,
            vocab_size=front.vocab_size,
            # as many as fit: the runtime ends the request at max_model_len ("length")
            default_max_tokens=front.max_model_len,
            logprobs=logprobs,
            constraint=sourced,
        )
        await front.check_constraints(_checked(plan, asked, sourced))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        streams, prompt_tokens = await start_chat(
            front,
            messages,
            per_choice(params, n),
            [f"{rid}-{i}" for i in range(n)],
            req.cache_salt or "",
            tools=plan.tools if plan is not None and plan.native and plan.tools else None,
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
            tool_choice=None if plan is None else plan.choice,
            constraint=None if sourced is None else sourced.param,
        )
        states = [ChoiceState(i) for i in range(n)]
        parsers: list[ToolParser] | None = None
        if plan is not None and plan.parses:
            parsers = [plan.parser() for _ in range(n)]
        called = [False] * n
        strings = front.strings if logprobs is not None else None
        tier = None if req.service_tier is None else "default"
        model = front.model_name
        if not req.stream:
            if not await collect(request, exchange, states):
                return Response(status_code=499)
            return json_response(
                chat_response(rid, created, model, states, prompt_tokens, strings, tier, parsers)
            )

        opening = [
            sse_event(
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
            text, calls = delta.text, None
            if parsers is not None:
                out = parsers[index].feed(delta.text)
                if delta.finished:
                    out.extend(parsers[index].finish())
                text, calls = out.content, delta_tool_calls(out.calls) or None
                called[index] = called[index] or calls is not None
            if text or calls or delta.token_ids or delta.finished:
                reason = delta.finish_reason if delta.finished else None
                if parsers is not None:
                    reason = tool_finish(reason, called[index])
                content = ChatDelta(content=text or None, tool_calls=calls)
                entries = (delta.logprobs or []) if strings is not None else None
                chunk = chat_chunk(
                    rid, created, model, index, content, entries, strings, reason, tier
                )
                await event(sse_event(chunk))

        def closing() -> list[bytes]:
            if req.stream_options is None or not req.stream_options.include_usage:
                return []
            last = ChatChunk(id=rid, created=created, model=model, choices=[],
                             usage=usage(prompt_tokens, states, n), service_tier=tier)  # fmt: skip
            return [sse_event(last)]

        return EventStream(exchange, opening, handle, closing)

    # ---- the rest ---------------------------------------------------------------------------

    def _card(self) -> ModelCard:
        f = self.front
        return ModelCard(id=f.model_name, created=f.created, max_model_len=f.max_model_len)

    async def models(self, request: Request) -> Response:
        return json_response(ModelList(data=[self._card()]))

    async def model(self, request: Request) -> Response:
        try:
            self.front.check_model(request.path_params["model"])
        except HttpError as exc:
            return error_response(exc)
        return json_response(self._card())

    async def health(self, request: Request) -> Response:
        try:
            self.front.check_available()
        except HttpError as exc:
            return error_response(exc)
        status, body = self.front.health()
        return json_response(body, status)

    async def metrics(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if self.front.registry is None:
            return error_response(HttpError(404, "no metrics here", code="not_found"))
        return Response(generate_latest(self.front.registry), media_type=CONTENT_TYPE_LATEST)
