"""Chat messages to running requests: the one place the HTTP front starts a chat.

:func:`start_chat` renders and tokenizes the messages with the runtime's own chat API
(:meth:`~spectrio.runtime.api.Runtime.chat_prompt`: the checkpoint's template in
Jinja2's sandbox, its end-of-turn tokens as stops) in the front's worker thread, once,
and starts one request per choice on those token ids.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import trio

from spectrio.core.params import SamplingParams, with_chat_stops
from spectrio.http_api.front import HttpFront
from spectrio.http_api.mapping import HttpError
from spectrio.runtime.api import RequestStream

__all__ = ["start_chat"]


async def start_chat(
    front: HttpFront,
    messages: Sequence[dict[str, Any]],
    choices: Sequence[SamplingParams],
    request_ids: Sequence[str],
    cache_salt: str = "",
    tools: Sequence[dict[str, Any]] | None = None,
) -> tuple[list[RequestStream], int]:
    """Start one request per entry of ``choices`` on the rendered ``messages``; returns
    the streams and the prompt's length in tokens. ``tools`` are passed to a template
    that renders them (:mod:`.tool_calls`). Raises :class:`HttpError` (400) for a
    model without a chat template and :class:`InvalidRequest` for messages the template
    refuses or a prompt that does not fit. ``ignore_eos`` also ignores the template's
    end-of-turn tokens (they are the chat's EOS)."""
    if front.rt.chat_template is None:
        raise HttpError(
            400,
            f"messages: the model {front.model_name!r} has no chat template (none in its "
            "tokenizer_config.json, chat_template.jinja or GGUF metadata), so messages "
            "cannot be rendered; use /v1/completions with a prompt",
            param="messages",
            code="no_chat_template",
        )
    render = functools.partial(front.rt.chat_prompt, messages, choices[0], tools=tools)
    ids, _ = await trio.to_thread.run_sync(render, abandon_on_cancel=True)
    streams: list[RequestStream] = []
    try:
        for params, rid in zip(choices, request_ids, strict=True):
            chat_params = with_chat_stops(params, front.rt.chat_stop_ids)
            streams.append(front.start(ids, chat_params, rid, cache_salt))
    except BaseException:
        for s in streams:
            s.close()
        raise
    return streams, len(ids)
