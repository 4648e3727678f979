"""Chat templates: a checkpoint's Jinja2 template rendered in a sandbox, and the tokens
that end an assistant turn.

The template comes from ``tokenizer_config.json`` (``chat_template``),
``chat_template.jinja`` or a GGUF file's ``tokenizer.chat_template``
(:attr:`spectrio.models.LoadedModel.chat_template`). It is untrusted text from a
download, so it runs in Jinja2's ``ImmutableSandboxedEnvironment``: no attribute access
to Python internals, no mutation of the messages. The environment matches the one
Hugging Face renders with (``trim_blocks``, ``lstrip_blocks``, ``raise_exception``,
``strftime_now``, a ``tojson`` that keeps non-ASCII text), so a template renders here
as it does there.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from spectrio.errors import CheckpointError, InvalidRequest
from spectrio.models.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from spectrio.models.loader import LoadedModel

__all__ = ["ChatTemplate", "Message", "chat_template_for"]

Message = Mapping[str, Any]
"""One chat message: ``{"role": str, "content": str}`` (other keys pass through to the
template)."""

_SENTINEL = "\x00spectrio-end-of-turn\x00"


class ChatTemplate:
    """A compiled chat template with the tokenizer's special tokens bound to it."""

    def __init__(self, source: str, tokenizer: TextTokenizer, special: Mapping[str, str]) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise InvalidRequest("messages", f"the chat template refused them: {message}")

        def tojson(value: Any, indent: int | None = None) -> str:
            return json.dumps(value, ensure_ascii=False, indent=indent)

        def strftime_now(fmt: str) -> str:
            return datetime.datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise CheckpointError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self._tokenizer = tokenizer
        self._special = dict(special)

    def render(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text of ``messages``; with ``add_generation_prompt`` it ends where
        the assistant's answer begins. Malformed messages raise :class:`InvalidRequest`."""
        from jinja2 import TemplateError

        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise InvalidRequest("messages", "must be a non-empty list of messages", got=messages)
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise InvalidRequest("messages", "each must have a string 'role'", got=m, at=i)
            if not isinstance(m.get("content"), str):
                raise InvalidRequest("messages", "each must have a string 'content'", got=m, at=i)
        try:
            return str(
                self._template.render(
                    messages=[dict(m) for m in messages],
                    add_generation_prompt=add_generation_prompt,
                    **self._special,
                    **extra,
                )
            )
        except InvalidRequest:
            raise
        except TemplateError as exc:
            raise InvalidRequest("messages", f"the chat template failed: {exc}") from exc

    def encode(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of :meth:`render`'s text (special tokens in the text become their
        ids; nothing else is added)."""
        return self._tokenizer.encode(self.render(messages, add_generation_prompt))

    def stop_token_ids(self) -> list[int]:
        """The special tokens the template writes right after an assistant's content
        (``<|im_end|>``, ``<|eot_id|>``, ...), found by rendering a conversation with a
        sentinel answer, plus the tokenizer's EOS: generation for a chat ends at any of
        them."""
        conversation = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": _SENTINEL},
        ]
        ids: list[int] = []
        try:
            text = self.render(conversation, add_generation_prompt=False)
        except InvalidRequest:
            text = ""
        if _SENTINEL in text:
            after = text.split(_SENTINEL, 1)[1]
            special = set(self._tokenizer.raw.get_added_tokens_decoder())
            for token in self._tokenizer.encode(after):
                if token in special:
                    ids.append(token)
                elif (self._tokenizer.raw.id_to_token(token) or "").strip():
                    break  # the turn's closing tokens end at the first ordinary text
        eos = self._tokenizer.eos_token_id
        if eos is not None and eos not in ids:
            ids.append(eos)
        return ids


def chat_template_for(loaded: LoadedModel) -> ChatTemplate | None:
    """The loaded checkpoint's chat template, with ``bos_token`` and ``eos_token`` bound
    to its tokenizer's strings for the config's ids; None without a template or a
    tokenizer."""
    tok = loaded.tokenizer
    if loaded.chat_template is None or tok is None:
        return None
    special: dict[str, str] = {}
    for key, index in (("bos_token", loaded.config.bos_token_id), ("eos_token", tok.eos_token_id)):
        token = tok.raw.id_to_token(index) if index is not None else None
        special[key] = token or ""
    return ChatTemplate(loaded.chat_template, tok, special)
