"""The text tokenizer: a Hugging Face ``tokenizers`` BPE model plus incremental decoding."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


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

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def stream(self) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer (one per output stream)."""
        return IncrementalDetokenizer(self)


class IncrementalDetokenizer:
    """Turns a growing id list into text deltas without ever splitting a UTF-8 character.

    The one incremental detokenizer of the project: the embedding API, the wire client
    and the stop-string matcher (:mod:`spectrio.stages.stops`) all use it, so the text
    they see agrees token by token. It wraps ``tokenizers``' own
    :class:`~tokenizers.decoders.DecodeStream`, which decodes only the ids since the last
    complete character (O(1) per token) and holds back a tail that decodes to U+FFFD,
    since byte-level BPE can end a token in the middle of a multi-byte character.
    :meth:`flush` returns what is held back when the output ends.

    Measured on the bundled tokenizer (2-core CPU), per token: 0.8 us pushing one id at
    a time, against 0.7 us for the hand-written windowed decoder it replaced; 0.7 us
    against 0.35 us pushing 3 ids at a time (``DecodeStream`` decodes the context again
    for every id).
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
