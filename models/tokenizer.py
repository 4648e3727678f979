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

    Byte-level BPE can end a token in the middle of a multi-byte character; such a tail
    decodes to U+FFFD and is held back until the following tokens complete it. Only the
    ids since the last point where the text was complete are decoded again, so each
    push costs O(1) in the length of the output.
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._window_start = 0  # ids before this decode to complete characters
        self._window_emitted = 0  # characters of the window's text already returned
        self._parts: list[str] = []

    def push(self, new_ids: list[int]) -> str:
        self._ids.extend(new_ids)
        window = self._tok.decode(self._ids[self._window_start :])
        complete = not window.endswith("\ufffd")
        stable = window if complete else window.rstrip("\ufffd")
        delta = stable[self._window_emitted :]
        if complete:
            self._window_start, self._window_emitted = len(self._ids), 0
        else:
            self._window_emitted = len(stable)
        self._parts.append(delta)
        return delta

    def flush(self) -> str:
        """Whatever is held back, replacement characters included (the output ended)."""
        window = self._tok.decode(self._ids[self._window_start :])
        delta = window[self._window_emitted :]
        self._window_start, self._window_emitted = len(self._ids), 0
        self._parts.append(delta)
        return delta

    @property
    def text(self) -> str:
        return "".join(self._parts)
