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
from spectrio.models.text.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from spectrio.models.architecture.config import ModelConfig
    from spectrio.models.loading.loader import LoadedModel

__all__ = [
    "MESSAGES_RULE",
    "MESSAGE_RULES",
    "ChatTemplate",
    "Message",
    "build_chat_template",
    "chat_template_for",
    "check_messages",
    "is_messages",
]

Message = Mapping[str, Any]
"""One chat message: ``{"role": str, "content": str}`` (other keys pass through to the
template)."""

_SENTINEL = "\x00spectrio-end-of-turn\x00"


MESSAGES_RULE = "must be a non-empty list of messages"
MESSAGE_RULES: dict[str | None, str] = {
    None: "each must be a message (a map with a string 'role' and a string 'content')",
    "role": "each must have a string 'role'",
    "content": "each must have a string 'content'",
}
"""The rule an item of a message list breaks: not a map (``None``), or a map whose
``role`` or ``content`` is not a string. The wire decoder gives the same text."""


def check_messages(messages: object) -> list[dict[str, Any]]:
    """The one home of the rules a message list must pass before any template sees it
    (the embedding API, ``ChatTemplate.render`` and the wire server all apply them): a
    non-empty list (not a string) of mappings, each with a string ``role`` and a string
    ``content``. Returns plain dicts (copies: the template never sees the caller's
    objects); raises :class:`InvalidRequest` on field ``messages``."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise InvalidRequest("messages", MESSAGES_RULE, got=messages, code="wrong_type")
    if not messages:  # as an empty prompt is
        raise InvalidRequest("messages", MESSAGES_RULE, got=messages, code="empty_prompt")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidRequest("messages", MESSAGE_RULES[None], got=m, at=i, code="wrong_type")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise InvalidRequest("messages", MESSAGE_RULES[key], got=m, at=i, code="wrong_type")
        out.append(dict(m))
    return out


def is_messages(prompt: object) -> bool:
    """Whether a ``generate`` prompt is a message list rather than text or token ids: a
    list or tuple whose first item is a mapping (the rest is checked by
    :func:`check_messages`; an empty list stays an empty prompt)."""
    return isinstance(prompt, list | tuple) and bool(prompt) and isinstance(prompt[0], Mapping)


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

        from jinja2 import meta

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
        try:
            self._template = env.from_string(source)
            variables = meta.find_undeclared_variables(env.parse(source))
        except TemplateError as exc:
            raise CheckpointError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self.reads_tools = "tools" in variables
        """Whether the template renders a ``tools=`` list (a function-calling template);
        one that does not gets the HTTP front's default tool format (docs/http.md)."""
        self._tokenizer = tokenizer
        self._special = dict(special)

    def render(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text of ``messages``; with ``add_generation_prompt`` it ends where
        the assistant's answer begins. ``extra`` are more template variables, such as
        ``tools`` (a list of OpenAI-shaped function tools, for a template that
        :attr:`reads_tools`). Malformed messages raise :class:`InvalidRequest`."""
        from jinja2 import TemplateError

        checked = check_messages(messages)
        try:
            return str(
                self._template.render(
                    messages=checked,
                    add_generation_prompt=add_generation_prompt,
                    **self._special,
                    **extra,
                )
            )
        except InvalidRequest:
            raise
        except TemplateError as exc:
            raise InvalidRequest("messages", f"the chat template failed: {exc}") from exc

    def user_turn_prefix(self) -> list[int]:
        """Token ids of a conversation up to where its first user message's text begins
        (the template's default system turn, if any, and the user turn's opening): what a
        model continues to write a user's request itself."""
        text = self.render([{"role": "user", "content": _SENTINEL}], add_generation_prompt=False)
        if _SENTINEL not in text:
            raise CheckpointError("the chat template does not write the user's message")
        return self._tokenizer.encode(text.split(_SENTINEL, 1)[0])

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
                elif (self._tokenizer.raw.id_to_token(token) or "").replace("\u2581", " ").strip():
                    break  # the turn's closing tokens end at the first ordinary text
        eos = self._tokenizer.eos_token_id
        if eos is not None and eos not in ids:
            ids.append(eos)
        return ids


def chat_template_for(loaded: LoadedModel) -> ChatTemplate | None:
    """The loaded checkpoint's chat template, with ``bos_token`` and ``eos_token`` bound
    to its tokenizer's strings for the config's ids; None without a template or a
    tokenizer."""
    return build_chat_template(loaded.chat_template, loaded.tokenizer, loaded.config)


def build_chat_template(
    source: str | None, tok: TextTokenizer | None, cfg: ModelConfig
) -> ChatTemplate | None:
    """:func:`chat_template_for` from a model's parts (what
    :func:`spectrio.models.loading.loader.load_text_side` reads without the weights)."""
    if source is None or tok is None:
        return None
    special: dict[str, str] = {}
    for key, index in (("bos_token", cfg.bos_token_id), ("eos_token", tok.eos_token_id)):
        token = tok.raw.id_to_token(index) if index is not None else None
        special[key] = token or ""
    return ChatTemplate(source, tok, special)
