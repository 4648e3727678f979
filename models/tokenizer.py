"""The text tokenizer: a Hugging Face ``tokenizers`` BPE model plus incremental decoding."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, eos_token_id: int | None) -> None:
        self._tok = tokenizer
        self.eos_token_id = eos_token_id

    @classmethod
    def from_file(cls, path: str | Path, eos_token_id: int | None = None) -> TextTokenizer:
        return cls(Tokenizer.from_file(str(path)), eos_token_id)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def stream(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)


class IncrementalDetokenizer:
    """Turns a growing id list into text deltas without ever splitting a UTF-8 character.

    Byte-level BPE can end a token in the middle of a multi-byte character; such a
    tail decodes to U+FFFD and is held back until the following tokens complete it.
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._emitted = ""

    def push(self, new_ids: list[int]) -> str:
        self._ids.extend(new_ids)
        text = self._tok.decode(self._ids)
        stable = text.rstrip("\ufffd") if text.endswith("\ufffd") else text
        delta = stable[len(self._emitted) :]
        self._emitted = stable
        return delta

    def flush(self) -> str:
        text = self._tok.decode(self._ids)
        delta = text[len(self._emitted) :]
        self._emitted = text
        return delta

    @property
    def text(self) -> str:
        return self._emitted
