"""Logprobs in each endpoint's own format, and the text and bytes of single tokens (pure).

* ``/v1/completions`` (the legacy format): parallel lists ``tokens``,
  ``token_logprobs``, ``top_logprobs`` (a dict per token: the requested top
  alternatives and the sampled token, so up to ``logprobs + 1`` entries, as OpenAI
  documents) and ``text_offset``; with ``echo`` they start with the prompt's tokens
  (:func:`echo_logprobs`), the first one's logprob and alternatives ``null``;
* ``/v1/chat/completions``: ``content``, one object per token with ``token``,
  ``logprob``, ``bytes`` and exactly ``top_logprobs`` alternatives.

A token's ``bytes`` are exact (a byte-level BPE token can hold part of a UTF-8
character); its ``token`` text is those bytes decoded with U+FFFD for a partial
character. Logprobs of ``-inf`` are reported as ``-9999.0``, as OpenAI does: JSON has no
infinity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from tokenizers import decoders

from spectrio.core.messages import TokenLogprob
from spectrio.http_api.schema import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)
from spectrio.models.text.tokenizer import TextTokenizer

__all__ = [
    "MIN_LOGPROB",
    "TokenStrings",
    "chat_logprobs",
    "completion_logprobs",
    "echo_logprobs",
    "join_logprobs",
]

MIN_LOGPROB: Final = -9999.0


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted: byte-level BPE writes byte ``b`` as
    the character ``table[b]`` (printable bytes as themselves, the rest shifted past
    U+0100)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    chars = {b: b for b in keep}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + shift
            shift += 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_LEVEL: Final = _byte_level_alphabet()


class TokenStrings:
    """The bytes and text of single token ids of one tokenizer (cached)."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tok = tokenizer.raw
        self._byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        self._added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])  # SentencePiece's byte fallback
        return piece.replace("\u2581", " ").encode("utf-8")  # SentencePiece's space

    def get(self, token_id: int) -> tuple[str, bytes]:
        """``(text, bytes)`` of one token."""
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            hit = self._cache[token_id] = (raw.decode("utf-8", "replace"), raw)
        return hit

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]


def _lp(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


def completion_logprobs(
    entries: Sequence[TokenLogprob], strings: TokenStrings, offset: int
) -> tuple[CompletionLogprobs, int]:
    """The legacy logprobs object of ``entries`` whose first token starts at character
    ``offset`` of the choice's text; returns it and the offset after the last token."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for entry in entries:
        text = strings.text(entry.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(_lp(entry.logprob))
        top = {strings.text(t): _lp(lp) for t, lp in entry.top}
        top.setdefault(text, _lp(entry.logprob))  # the sampled token is always there
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out, offset


def echo_logprobs(
    prompt_ids: Sequence[int], entries: Sequence[TokenLogprob], strings: TokenStrings
) -> tuple[CompletionLogprobs, int]:
    """The legacy logprobs object of an echoed prompt (``echo`` with ``logprobs``): one
    entry per prompt token, the first with ``null`` logprob and alternatives (no context
    scores it), then ``entries`` (the prompt logprobs of tokens 1 .. P-1). Text offsets
    run over the tokens' own texts from 0; returns the object and the offset after it."""
    if len(entries) != len(prompt_ids) - 1:
        raise ValueError(f"{len(entries)} prompt logprobs for a prompt of {len(prompt_ids)}")
    first = strings.text(prompt_ids[0])
    head = CompletionLogprobs(
        tokens=[first], token_logprobs=[None], top_logprobs=[None], text_offset=[0]
    )
    rest, end = completion_logprobs(entries, strings, len(first))
    return join_logprobs(head, rest), end


def join_logprobs(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    """``a``'s tokens followed by ``b``'s (offsets as each has them)."""
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


def chat_logprobs(entries: Sequence[TokenLogprob], strings: TokenStrings) -> ChatLogprobs:
    """The chat logprobs object of ``entries``."""
    content: list[ChatTokenLogprob] = []
    for entry in entries:
        text, raw = strings.get(entry.token_id)
        top = []
        for token_id, lp in entry.top:
            t_text, t_raw = strings.get(token_id)
            top.append(TopLogprob(token=t_text, logprob=_lp(lp), bytes=list(t_raw)))
        content.append(
            ChatTokenLogprob(
                token=text, logprob=_lp(entry.logprob), bytes=list(raw), top_logprobs=top
            )
        )
    return ChatLogprobs(content=content)
