"""Chat messages to running requests: the one place the HTTP front renders a chat.

:func:`start_chat` renders the messages with the checkpoint's chat template
(:func:`spectrio.models.chat.chat_template_for`: ``tokenizer_config.json``'s, a
``chat_template.jinja`` or the GGUF's, in Jinja2's sandbox) and starts one request per
choice, each stopping at the template's end-of-turn tokens as well as its own stops.
It is kept this small so that it can become a call of the runtime's own chat API.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from spectrio.core.params import InvalidRequest, SamplingParams
from spectrio.http_api.front import HttpFront
from spectrio.http_api.mapping import HttpError
from spectrio.runtime.api import RequestStream

__all__ = ["start_chat"]


async def start_chat(
    front: HttpFront,
    messages: Sequence[dict[str, str]],
    choices: Sequence[SamplingParams],
    request_ids: Sequence[str],
) -> tuple[list[RequestStream], int]:
    """Start one request per entry of ``choices`` on the rendered ``messages``; returns
    the streams and the prompt's length in tokens. Raises :class:`HttpError` (400) for a
    model without a chat template and :class:`InvalidRequest` for messages the template
    refuses or a prompt that does not fit. ``ignore_eos`` also ignores the template's
    end-of-turn tokens (they are the chat's EOS)."""
    template = front.template
    if template is None:
        raise HttpError(
            400,
            f"messages: the model {front.model_name!r} has no chat template (none in its "
            "tokenizer_config.json, chat_template.jinja or GGUF metadata), so messages "
            "cannot be rendered; use /v1/completions with a prompt",
            param="messages",
            code="no_chat_template",
        )
    text = template.render(messages)
    try:
        [ids] = await front.prompt_ids([text])
    except InvalidRequest as exc:  # the prompt is the messages, rendered
        raise InvalidRequest("messages", f"rendered: {exc.rule}", code=exc.code) from None
    streams: list[RequestStream] = []
    try:
        for params, rid in zip(choices, request_ids, strict=True):
            if not params.ignore_eos:
                stops = [t for t in front.chat_stop_ids if t not in params.stop_token_ids]
                params = msgspec.structs.replace(
                    params, stop_token_ids=[*params.stop_token_ids, *stops]
                )
            streams.append(front.start(ids, params, rid))
    except BaseException:
        for s in streams:
            s.close()
        raise
    return streams, len(ids)
