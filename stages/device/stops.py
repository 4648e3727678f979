"""Exact stops inside an accepted run (pure; the tokenizer is the only dependency).

The sampler hands :func:`truncate_run` the tokens a step would emit for one request.
The first of these, token by token, ends the run right there:

* a stop token (EOS unless ``ignore_eos``, or one of ``stop_token_ids``): kept, reason ``"stop"``;
* a stop string completed by the token (only once ``min_tokens`` tokens are out): the
  token is kept, later ones are dropped, reason ``"stop"``, and the output text is cut
  right before the stop string (``text_len``);
* the length limit: reason ``"length"``.

Checked in that order for each token, so a stop beats the length limit when both fall
on the same token: ``[10, 11, STOP, 20, 21]`` with ``max_tokens=5`` ends after 3 tokens
with reason ``"stop"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from spectrio.models import TextTokenizer

__all__ = ["StopStringMatcher", "Truncation", "truncate_run"]


class StopStringMatcher:
    """Finds stop strings in a request's output text as tokens arrive.

    The text comes from the tokenizer's incremental detokenizer
    (:meth:`TextTokenizer.stream`), the one the embedding API and the wire client stream
    text with, so a cut position counts exactly the characters they stream. A token
    whose text ends in an incomplete UTF-8 character adds no text until a later token
    completes it. Besides the detokenizer, the state is the last
    ``max(len(stop)) - 1`` characters of text.
    """

    def __init__(self, tokenizer: TextTokenizer, stop: Sequence[str]) -> None:
        if not stop or not all(stop):
            raise ValueError("stop strings must be non-empty")
        self._detok = tokenizer.stream()
        self._stop = list(stop)
        self._keep = max(len(s) for s in self._stop) - 1
        self._tail = ""  # last <= keep characters of the text so far
        self.num_chars = 0  # characters of complete text so far

    def push(self, token_id: int) -> int | None:
        """Add one token. If it completes a stop string, return the output text's length
        when cut right before that string (the earliest-ending match wins), else None."""
        delta = self._detok.push([token_id])
        if not delta:
            return None
        text = self._tail + delta
        best: tuple[int, int] | None = None  # (end, start)
        for s in self._stop:
            start = text.find(s, max(0, len(self._tail) - len(s) + 1))
            if start >= 0 and (best is None or (start + len(s), start) < best):
                best = (start + len(s), start)
        text_start = self.num_chars - len(self._tail)
        self.num_chars += len(delta)
        self._tail = text[max(0, len(text) - self._keep) :]
        return None if best is None else text_start + best[1]


@dataclasses.dataclass(frozen=True)
class Truncation:
    num_tokens: int  # tokens kept from the front of the run
    finish_reason: str | None  # "stop" | "length" | None
    text_len: int | None = None  # characters of output text to keep (stop strings only)


def truncate_run(
    tokens: Sequence[int],
    *,
    stop_token_ids: Sequence[int],
    max_new_tokens: int,
    num_output: int = 0,
    min_tokens: int = 0,
    matcher: StopStringMatcher | None = None,
) -> Truncation:
    """Where a run of ``tokens`` ends. ``num_output`` tokens were emitted before it and
    ``max_new_tokens`` more may be emitted. The matcher, if any, is fed every kept token."""
    stops = set(stop_token_ids)
    for j, tok in enumerate(tokens):
        if j >= max_new_tokens:
            return Truncation(j, "length")
        if tok in stops:
            return Truncation(j + 1, "stop")
        if matcher is not None:
            cut = matcher.push(tok)
            if cut is not None and num_output + j + 1 >= min_tokens:
                return Truncation(j + 1, "stop", cut)
    n = len(tokens)
    return Truncation(n, "length" if n >= max_new_tokens else None)
