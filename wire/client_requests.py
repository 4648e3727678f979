"""What both wire clients share on the request side: the types of their arguments, the
errors their calls raise (:class:`ClientTimeout`, :class:`RequestRefused`), the
``Submit`` frame they send, and how a reply is read; the Trio client is
:mod:`spectrio.wire.async_client`, the synchronous one :mod:`spectrio.wire.sync_client`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final, TypeVar

import msgspec
import zmq

from spectrio.core.params import ChatMessage, SamplingParams
from spectrio.wire.codec import encode
from spectrio.wire.schema import SCHEMA_VERSION, Ack, Error, ErrorCode, ModelInfo, Submit

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ClientTimeout",
    "Context",
    "Messages",
    "Prompt",
    "RequestRefused",
    "expect_reply",
    "older_server",
    "submit_frame",
]

Context = zmq.Context[zmq.Socket[bytes]]
Prompt = str | Sequence[int]
Messages = Sequence[Mapping[str, str] | ChatMessage]
"""A chat for ``submit(messages=...)`` (schema 1.5): each message a ``role`` and a
``content``, as dicts or :class:`~spectrio.core.params.ChatMessage` s."""

DEFAULT_TIMEOUT_S: Final = 60.0
"""Default bound on every wait of a client, for a reply or for the next step message."""


class ClientTimeout(TimeoutError, zmq.Again):  # type: ignore[misc]  # stubs differ on strerror
    """No reply, or no step message, within the client's ``timeout_s``: the server is
    gone, stuck, or not reachable. A ``TimeoutError``; also a ``zmq.Again``, which the
    synchronous client raised before it had this type."""

    def __init__(self, message: str) -> None:
        TimeoutError.__init__(self, message)


class RequestRefused(Exception):
    """The server answered a request with an ``Error``."""

    def __init__(self, error: Error) -> None:
        super().__init__(f"{error.code.value}: {error.reason}")
        self.error = error


_R = TypeVar("_R", ModelInfo, Ack)


def older_server(exc: RequestRefused) -> bool:
    """An ``Info`` refused by a server older than schema 1.2."""
    return exc.error.code is ErrorCode.UNKNOWN_TYPE


def submit_frame(
    prompt: Prompt | None,
    params: SamplingParams | None,
    request_id: str,
    messages: Messages | None = None,
    cache_salt: str = "",
    stream: bool = False,
) -> bytes:
    """A ``Submit`` with a prompt, or with messages (the server checks that there is
    exactly one of them, and each message's fields); ``stream`` asks for the request's
    step messages on the connection that sends it (schema 1.7)."""
    body: str | list[int] | None = None
    if prompt is not None:
        body = prompt if isinstance(prompt, str) else [int(t) for t in prompt]
    chat = None
    if messages is not None:
        chat = [
            m if isinstance(m, ChatMessage) else ChatMessage(role=m["role"], content=m["content"])
            for m in messages
        ]
    submit = Submit(
        v=SCHEMA_VERSION,
        request_id=request_id,
        prompt=body,
        params=params or SamplingParams(),
        messages=chat,
        cache_salt=cache_salt,
        stream=stream,
    )
    # Schema 1.8 added params.prompt_logprobs and 1.10 params.constraint; each is sent only
    # when set, so an older server (which refuses the key as unknown_field) reads every
    # other request as before.
    unset = [
        key for key in ("prompt_logprobs", "constraint") if getattr(submit.params, key) is None
    ]
    if not unset:
        return encode(submit)
    body_map = msgspec.to_builtins(submit)
    for key in unset:
        del body_map["params"][key]
    return msgspec.msgpack.encode(body_map)


def expect_reply(reply: Ack | Error | ModelInfo, kind: type[_R], what: str) -> _R:
    """``reply`` as ``kind``; an ``Error`` reply raises RequestRefused."""
    if isinstance(reply, Error):
        raise RequestRefused(reply)
    if not isinstance(reply, kind):
        raise ValueError(f"expected {what}, got {type(reply).__name__}")
    return reply
