"""The text tokenizer: a Hugging Face ``tokenizers`` BPE model plus incremental decoding,
and the bound that lets a text prompt be refused by its length before it is tokenized."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from tokenizers.models import BPE
from tokenizers.pre_tokenizers import ByteLevel

__all__ = ["IncrementalDetokenizer", "TextTokenizer", "max_token_bytes", "utf8_len"]

_NON_DROPPING_PRE_TOKENIZERS: Final = frozenset({"ByteLevel", "Split", "Digits", "Punctuation"})


def _keeps_every_byte(pre: dict[str, object] | None) -> bool:
    """Whether a pre-tokenizer only splits (never drops) the text, so every input byte
    ends up inside some token."""
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        items = pre.get("pretokenizers")
        return isinstance(items, list) and all(_keeps_every_byte(p) for p in items)
    return kind in _NON_DROPPING_PRE_TOKENIZERS and pre.get("behavior") != "Removed"


def max_token_bytes(tokenizer: Tokenizer) -> int | None:
    """The most input bytes one token can stand for: the longest vocabulary entry, in
    bytes of the text it encodes. None when no such bound holds (a normalizer, a
    pre-tokenizer that drops text, or fused unknown tokens could make any length of text
    one token). With a bound L, text of N UTF-8 bytes has at least ceil(N / L) tokens,
    and text made of the longest entry repeated reaches it, so the bound is exact."""
    # Read through the tokenizer's objects, not its JSON: this runs on a runtime's first
    # request, and parsing the whole file (a vocabulary and its merges) cost more than
    # the rest of the check.
    model = tokenizer.model
    if tokenizer.normalizer is not None:
        return None
    pre = tokenizer.pre_tokenizer
    if not _keeps_every_byte(None if pre is None else json.loads(pre.__getstate__())):
        return None
    if not isinstance(model, BPE) or (model.unk_token is not None and model.fuse_unk):
        return None
    byte_level = dict.fromkeys(map(ord, ByteLevel.alphabet()))  # str.translate deletes them
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    longest = 4  # an unknown character (one UTF-8 character) as one token
    for token in tokenizer.get_vocab(with_added_tokens=True):
        if token not in added and not token.translate(byte_level):
            size = len(token)  # byte-level alphabet: one character per byte
        else:
            size = len(token.encode("utf-8"))  # raw text (or an over-estimate)
        longest = max(longest, size)
    return longest


def utf8_len(text: str) -> int:
    """The UTF-8 length of ``text``; O(1) for ASCII text (CPython keeps the flag)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, eos_token_id: int | None) -> None:
        self._tok = tokenizer
        self.eos_token_id = eos_token_id

    @classmethod
    def from_file(cls, path: str | Path, eos_token_id: int | None = None) -> TextTokenizer:
        return cls(Tokenizer.from_file(str(path)), eos_token_id)

    @property
    def raw(self) -> Tokenizer:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The most UTF-8 bytes of text one token stands for (:func:`max_token_bytes`),
        or None when this tokenizer gives no such bound. Computed once."""
        return max_token_bytes(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_releasing_gil(self, text: str) -> list[int]:
        """:meth:`encode`, for a worker thread: ``Tokenizer.encode`` holds the GIL for the
        whole call (a 1 MB text stalls every other thread, the event loop included, for
        about a second), ``encode_batch`` releases it. Same ids."""
        return list(self._tok.encode_batch([text], add_special_tokens=False)[0].ids)

    def encode_prompt(self, text: str) -> list[int]:
        """A text prompt's ids: with the special tokens the tokenizer itself adds around
        a text (a BOS where its post-processor adds one: Llama, Mistral), as Hugging
        Face's ``tokenizer(text)`` and other engines' completions do. A rendered chat
        template writes its own, so it goes through :meth:`encode`."""
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def encode_prompt_releasing_gil(self, text: str) -> list[int]:
        """:meth:`encode_prompt` for a worker thread (see :meth:`encode_releasing_gil`)."""
        return list(self._tok.encode_batch([text], add_special_tokens=True)[0].ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def stream(self) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer (one per output stream)."""
        return IncrementalDetokenizer(self)


class IncrementalDetokenizer:
    """Turns a growing id list into text deltas without ever splitting a UTF-8 character.

    The one incremental detokenizer of the project: the embedding API, the wire client
    and the stop-string matcher (:mod:`spectrio.stages.device.stops`) all use it, so the text
    they see agrees token by token. It wraps ``tokenizers``' own
    :class:`~tokenizers.decoders.DecodeStream`, which decodes only the ids since the last
    complete character (O(1) per token) and holds back a tail that decodes to U+FFFD,
    since byte-level BPE can end a token in the middle of a multi-byte character.
    :meth:`flush` returns what is held back when the output ends. It costs about a
    microsecond a token (``DecodeStream`` decodes its context again for every id).
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tok = tokenizer
        self._raw = tokenizer.raw
        self._stream = DecodeStream(skip_special_tokens=True)
        self._last = -1  # the last id of the text emitted so far (-1: none yet)
        self._held: list[int] = []  # ids since then, whose text is not out yet
        self._parts: list[str] = []

    def push(self, new_ids: Sequence[int]) -> str:
        """Add ids; return the text they complete (possibly ``""``)."""
        out = ""
        # One id per step: ``DecodeStream.step`` takes lists only in recent releases, and
        # a list costs the same per id.
        for t in new_ids:
            tid = int(t)
            chunk = self._stream.step(self._raw, tid)
            if chunk is None:
                self._held.append(tid)
            else:
                out += chunk
                self._last = tid
                if self._held:
                    self._held = []
        if out:
            self._parts.append(out)
        return out

    def flush(self) -> str:
        """Whatever is held back, replacement characters included (the output ended).
        Further pushes start a new text."""
        if not self._held:
            return ""
        # Decode with one id of context, as the stream does, for decoders that treat the
        # first token of a sequence specially.
        context = [self._last] if self._last >= 0 else []
        before = self._tok.decode(context) if context else ""
        delta = self._tok.decode(context + self._held)[len(before) :]
        self._stream = DecodeStream(skip_special_tokens=True)
        self._last, self._held = -1, []
        self._parts.append(delta)
        return delta

    @property
    def text(self) -> str:
        """All text returned so far."""
        return "".join(self._parts)
