"""spectrio.models.text: text in and out of token ids. The tokenizer with incremental
decoding (``tokenizer``) and chat templates rendered in a sandbox (``chat``).

Public names: ``TextTokenizer``, ``IncrementalDetokenizer``, ``ChatTemplate``,
``chat_template_for``; each imported on first use (neither imports Paddle)."""

from typing import TYPE_CHECKING

from spectrio._lazy import lazy_exports

_EXPORTS = {
    "TextTokenizer": "spectrio.models.text.tokenizer",
    "IncrementalDetokenizer": "spectrio.models.text.tokenizer",
    "ChatTemplate": "spectrio.models.text.chat",
    "chat_template_for": "spectrio.models.text.chat",
}

__all__ = [
    "ChatTemplate",
    "IncrementalDetokenizer",
    "TextTokenizer",
    "chat_template_for",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from spectrio.models.text.chat import ChatTemplate, chat_template_for
    from spectrio.models.text.tokenizer import IncrementalDetokenizer, TextTokenizer
