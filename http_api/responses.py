"""OpenAI response objects from a request's deltas (pure: no I/O, no Trio).

:class:`ChoiceState` follows one choice's deltas; the builders make a whole response
(``stream: false``) or one stream chunk from it. Finish reasons are the runtime's:
``"stop"`` (EOS, a stop token or a stop string), ``"length"`` (``max_tokens``, or the
end of ``max_model_len``) and ``"abort"`` (the server cut the request: shutdown), the
last one an extension of OpenAI's list. A chat answer read for tool calls
(:mod:`.tool_parsers`) that made one and ended by itself ends with ``"tool_calls"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from spectrio.core.messages import TokenLogprob
from spectrio.http_api.logprobs import (
    TokenStrings,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    join_logprobs,
)
from spectrio.http_api.schema import (
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatCompletion,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    DeltaFunctionCall,
    DeltaToolCall,
    DraftUsage,
    FunctionCall,
    PromptTokensDetails,
    ResponseMessage,
    ToolCall,
    Usage,
)
from spectrio.http_api.tool_parsers import CallDelta, ToolParser, parse_all
from spectrio.runtime.api import Delta

__all__ = [
    "ChoiceState",
    "chat_chunk",
    "chat_message",
    "chat_response",
    "delta_tool_calls",
    "tool_finish",
    "completion_chunk",
    "echo_chunk",
    "completion_response",
    "usage",
]


@dataclasses.dataclass
class ChoiceState:
    """What one choice has produced so far."""

    index: int
    prefix: str = ""  # text before the output (completions' echo)
    # completions' echo with logprobs: the prompt's ids, and its tokens' logprobs (from the
    # request's first delta; None until then)
    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    # echo with max_tokens 0: the answer is the scored prompt alone; the one token the
    # runtime generates (it always emits one) is dropped, and the choice ends "length"
    echo_only: bool = False
    pieces: list[str] = dataclasses.field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    cached_tokens: int = 0  # prompt tokens its request took from the prefix cache
    offset: int = 0  # completions' text_offset of the next token (streaming)

    def add(self, delta: Delta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if not self.echo_only:
            self.pieces.append(delta.text)
            self.num_tokens += len(delta.token_ids)
            self.logprobs += delta.logprobs or ()
        self.drafts_proposed += delta.num_drafts
        self.drafts_accepted += delta.num_accepted
        if delta.finished:
            self.finish_reason = delta.finish_reason
            if self.echo_only and delta.finish_reason != "abort":
                self.finish_reason = "length"  # max_tokens 0 reached at once
            self.cached_tokens = delta.cached_tokens or 0
            # the scheduler's own count over the request's life wins over the sum of steps
            if delta.total_drafts is not None and delta.total_accepted is not None:
                self.drafts_proposed = delta.total_drafts
                self.drafts_accepted = delta.total_accepted

    @property
    def text(self) -> str:
        return self.prefix + "".join(self.pieces)


def usage(prompt_tokens: int, choices: Sequence[ChoiceState], n: int = 1) -> Usage:
    """``prompt_tokens`` counts each prompt once (whatever ``n``, the choices per prompt,
    is); completion tokens and drafts add up over every choice. ``cached_tokens`` counts
    each prompt once too: the mean over its ``n`` choices (each choice is a request of
    its own, and the first may compute what the others then find cached)."""
    completion = sum(c.num_tokens for c in choices)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=sum(c.cached_tokens for c in choices) // max(1, n)
        ),
        spectrio=DraftUsage(
            drafts_proposed=sum(c.drafts_proposed for c in choices),
            drafts_accepted=sum(c.drafts_accepted for c in choices),
        ),
    )


def completion_response(
    rid: str,
    created: int,
    model: str,
    choices: Sequence[ChoiceState],
    prompt_tokens: int,
    strings: TokenStrings | None,
    n: int = 1,
) -> Completion:
    """The whole ``/v1/completions`` response; ``strings`` when logprobs were asked for,
    ``n`` choices per prompt."""
    out: list[CompletionChoice] = []
    for c in choices:
        lp: CompletionLogprobs | None = None
        if strings is not None:
            lp, _ = completion_logprobs(c.logprobs, strings, len(c.prefix))
            if c.prompt_logprobs is not None:  # echo: the prompt's tokens first
                lp = join_logprobs(echo_logprobs(c.prompt_ids, c.prompt_logprobs, strings)[0], lp)
        out.append(
            CompletionChoice(index=c.index, text=c.text, logprobs=lp, finish_reason=c.finish_reason)
        )
    return Completion(
        id=rid, created=created, model=model, choices=out, usage=usage(prompt_tokens, choices, n)
    )


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    state: ChoiceState,
    text: str,
    entries: Sequence[TokenLogprob] | None,
    strings: TokenStrings | None,
    finish_reason: str | None,
) -> Completion:
    """One ``/v1/completions`` stream chunk of one choice: ``text`` and the logprobs of
    its tokens (text offsets continue from ``state.offset``, which advances)."""
    lp: CompletionLogprobs | None = None
    if strings is not None:
        lp, state.offset = completion_logprobs(entries or (), strings, state.offset)
    choice = CompletionChoice(
        index=state.index, text=text, logprobs=lp, finish_reason=finish_reason
    )
    return Completion(id=rid, created=created, model=model, choices=[choice])


def echo_chunk(
    rid: str, created: int, model: str, state: ChoiceState, strings: TokenStrings | None
) -> Completion:
    """The stream chunk that echoes one choice's prompt: its text and, when logprobs were
    asked for, its tokens' logprobs (:func:`~.logprobs.echo_logprobs`; the prompt's
    logprobs come with the request's first delta, so this chunk waits for it). The
    output's text offsets then continue from the prompt's text."""
    lp: CompletionLogprobs | None = None
    if strings is not None and state.prompt_logprobs is not None:
        lp, _ = echo_logprobs(state.prompt_ids, state.prompt_logprobs, strings)
    state.offset = len(state.prefix)
    choice = CompletionChoice(index=state.index, text=state.prefix, logprobs=lp, finish_reason=None)
    return Completion(id=rid, created=created, model=model, choices=[choice])


def tool_finish(reason: str | None, called: bool) -> str | None:
    """The finish reason of an answer read for tool calls: ``"tool_calls"`` when it made
    one and ended by itself (``"stop"``); otherwise the runtime's."""
    return "tool_calls" if called and reason == "stop" else reason


def chat_message(
    state: ChoiceState, parser: ToolParser | None
) -> tuple[ResponseMessage, str | None]:
    """A whole choice's message and finish reason; with ``parser``, its tool calls read
    out of the text (the content is then what is left, stripped, or null)."""
    if parser is None:
        return ResponseMessage(content=state.text), state.finish_reason
    content, calls = parse_all(parser, state.text)
    tool_calls = [
        ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls
    ]
    message = ResponseMessage(content=content, tool_calls=tool_calls or None)
    return message, tool_finish(state.finish_reason, bool(calls))


def delta_tool_calls(deltas: Sequence[CallDelta]) -> list[DeltaToolCall]:
    """Pieces of calls in OpenAI's chunk shape: a call's first with its ``id``, ``type``
    and ``function.name``, then ``function.arguments`` pieces; consecutive pieces of one
    call are joined."""
    out: list[DeltaToolCall] = []
    for d in deltas:
        last = out[-1] if out else None
        if d.id is None and last is not None and last.index == d.index:
            assert last.function is not None
            last.function.arguments = (last.function.arguments or "") + d.arguments
            continue
        function = DeltaFunctionCall(name=d.name, arguments=d.arguments)
        kind = None if d.id is None else "function"
        out.append(DeltaToolCall(index=d.index, id=d.id, type=kind, function=function))
    return out


def chat_response(
    rid: str,
    created: int,
    model: str,
    choices: Sequence[ChoiceState],
    prompt_tokens: int,
    strings: TokenStrings | None,
    service_tier: str | None,
    parsers: Sequence[ToolParser | None] | None = None,
) -> ChatCompletion:
    """The whole ``/v1/chat/completions`` response; ``parsers``, one per choice, read
    its text for tool calls."""
    out: list[ChatChoice] = []
    for i, c in enumerate(choices):
        message, reason = chat_message(c, None if parsers is None else parsers[i])
        out.append(
            ChatChoice(
                index=c.index,
                message=message,
                logprobs=chat_logprobs(c.logprobs, strings) if strings is not None else None,
                finish_reason=reason,
            )
        )
    return ChatCompletion(
        id=rid,
        created=created,
        model=model,
        choices=out,
        usage=usage(prompt_tokens, choices, len(choices)),
        service_tier=service_tier,
    )


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    delta: ChatDelta,
    entries: Sequence[TokenLogprob] | None,
    strings: TokenStrings | None,
    finish_reason: str | None,
    service_tier: str | None,
) -> ChatChunk:
    """One ``/v1/chat/completions`` stream chunk of one choice."""
    lp: ChatLogprobs | None = None
    if strings is not None and entries is not None:
        lp = chat_logprobs(entries, strings)
    choice = ChatChunkChoice(index=index, delta=delta, logprobs=lp, finish_reason=finish_reason)
    return ChatChunk(
        id=rid, created=created, model=model, choices=[choice], service_tier=service_tier
    )
