"""Exact stops inside an accepted run: stop tokens, stop strings across tokens, length."""

from __future__ import annotations

import random

import pytest

from spectrio.models import TextTokenizer, load
from spectrio.stages.device.stops import StopStringMatcher, truncate_run


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    t = load("bundled").tokenizer
    assert t is not None
    return t


def test_stop_beats_length() -> None:
    run = [10, 11, 99, 20, 21]
    assert truncate_run(run, stop_token_ids=[99], max_new_tokens=5).num_tokens == 3
    assert truncate_run(run, stop_token_ids=[99], max_new_tokens=5).finish_reason == "stop"
    assert (
        truncate_run(run, stop_token_ids=[99], max_new_tokens=2).num_tokens,
        truncate_run(run, stop_token_ids=[99], max_new_tokens=2).finish_reason,
    ) == (2, "length")
    # The stop token is also the last allowed token: stop wins.
    assert truncate_run([10, 11, 99], stop_token_ids=[99], max_new_tokens=3).finish_reason == "stop"


def test_no_stop() -> None:
    assert truncate_run([1, 2], stop_token_ids=[99], max_new_tokens=5).finish_reason is None
    cut = truncate_run([1, 2], stop_token_ids=[], max_new_tokens=2)
    assert (cut.num_tokens, cut.finish_reason, cut.text_len) == (2, "length", None)


def feed(matcher: StopStringMatcher, ids: list[int]) -> tuple[int, int] | None:
    """(index of the token that completed a stop string, text cut) or None."""
    for j, t in enumerate(ids):
        cut = matcher.push(t)
        if cut is not None:
            return j, cut
    return None


def first_token_containing(tok: TextTokenizer, ids: list[int], end_char: int) -> int:
    return next(
        j for j in range(len(ids)) if len(tok.decode(ids[: j + 1]).rstrip("\ufffd")) >= end_char
    )


def test_stop_string_spanning_tokens(tok: TextTokenizer) -> None:
    text = "def fib(n):\n    return fib(n - 1) + fib(n - 2)\n"
    ids = tok.encode(text)
    # A stop string made of the end of one token and the start of the next.
    j = next(
        i
        for i in range(1, len(ids))
        if len(tok.decode(ids[i - 1 : i])) >= 2 and len(tok.decode(ids[i : i + 1])) >= 2
    )
    stop = tok.decode(ids[j - 1 : j])[-2:] + tok.decode(ids[j : j + 1])[:1]
    start = text.find(stop)
    assert feed(StopStringMatcher(tok, [stop]), ids) == (
        first_token_containing(tok, ids, start + len(stop)),
        start,
    )


def test_every_substring_is_found_where_it_first_ends(tok: TextTokenizer) -> None:
    text = "s = 'héllo 世界'  # naïve → résumé\nprint(s[::-1])\n"
    ids = tok.encode(text)
    full = tok.decode(ids)
    assert full == text
    rng = random.Random(0)
    for _ in range(60):
        a = rng.randrange(len(full) - 1)
        stop = full[a : a + rng.randint(1, 5)]
        start = full.find(stop)
        got = feed(StopStringMatcher(tok, [stop]), ids)
        assert got == (first_token_containing(tok, ids, start + len(stop)), start), stop


def test_earliest_ending_stop_string_wins(tok: TextTokenizer) -> None:
    ids = tok.encode("abc = 1\nxyz = 2\n")
    assert feed(StopStringMatcher(tok, ["xyz = 2", "= 1"]), ids)[1] == 4  # type: ignore[index]
    assert feed(StopStringMatcher(tok, ["nothing here"]), ids) is None


def test_truncate_run_cuts_at_stop_string_and_respects_min_tokens(tok: TextTokenizer) -> None:
    ids = tok.encode("x = 1\ny = 2\nz = 3\n")
    first_newline = first_token_containing(tok, ids, len("x = 1\n"))
    cut = truncate_run(
        ids, stop_token_ids=[], max_new_tokens=100, matcher=StopStringMatcher(tok, ["\n"])
    )
    assert (cut.num_tokens, cut.finish_reason, cut.text_len) == (first_newline + 1, "stop", 5)
    # min_tokens pushes the first eligible stop string past the first newline.
    cut = truncate_run(
        ids,
        stop_token_ids=[],
        max_new_tokens=100,
        min_tokens=first_newline + 2,
        matcher=StopStringMatcher(tok, ["\n"]),
    )
    assert cut.finish_reason == "stop" and cut.text_len == len("x = 1\ny = 2")
    # A stop token before the stop string wins; the length limit before both wins.
    assert (
        truncate_run(
            ids, stop_token_ids=[ids[0]], max_new_tokens=100, matcher=StopStringMatcher(tok, ["\n"])
        ).num_tokens
        == 1
    )
    assert (
        truncate_run(
            ids, stop_token_ids=[], max_new_tokens=1, matcher=StopStringMatcher(tok, ["\n"])
        ).finish_reason
        == "length"
    )


def test_matcher_rejects_empty_stop_strings(tok: TextTokenizer) -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(tok, [""])


def test_stop_string_across_a_split_multibyte_character(tok: TextTokenizer) -> None:
    """ " —" spans a token holding the space and the dash's first bytes, and the next token
    holding its last byte: the stop completes on the second and the text is cut before it."""
    text = "a = 1 — b = 2\n"
    ids = tok.encode(text)
    split = next(j for j, t in enumerate(ids) if tok.decode([t]) == " \ufffd")
    for stop in (" —", "—", "1 — b"):
        got = feed(StopStringMatcher(tok, [stop]), ids)
        end = text.find(stop) + len(stop)
        assert got == (first_token_containing(tok, ids, end), text.find(stop)), stop
        assert got[0] >= split + 1  # type: ignore[index]
    # A stop string ending in the complete part of the split token completes only once the
    # character after it is whole: the matcher sees the text the client streams.
    got = feed(StopStringMatcher(tok, ["1 "]), ids)
    assert got == (split + 1, text.find("1 "))
