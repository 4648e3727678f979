"""Item 12 of issue 15: a text prompt too long for any prompt under ``max_model_len`` is
refused by its length, before it is tokenized. The bound is exact: a token stands for at
most the longest vocabulary entry's bytes, and text made of that entry repeated reaches
it, so the bound can neither refuse a prompt that fits nor be lowered."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import trio

from spectrio import RuntimeConfig, SamplingParams, open_runtime
from spectrio.core.params import check_prompt, check_text_length, max_prompt_bytes
from spectrio.errors import InvalidRequest
from spectrio.models.architecture.config import BUNDLED_DIR
from spectrio.models.text.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer.from_file(Path(BUNDLED_DIR) / "tokenizer.json")


def test_the_bound_is_the_longest_vocabulary_entry_and_is_reached(tok: TextTokenizer) -> None:
    bound = tok.max_token_bytes
    assert bound == 41  # the bundled tokenizer: a newline and 40 spaces
    vocab = tok.raw.get_vocab()
    longest = [t for t in vocab if len(tok.raw.decode([vocab[t]]).encode()) == bound]
    assert longest
    entry = tok.raw.decode([vocab[longest[0]]])
    max_model_len = 64
    fits = entry * (max_model_len - 1)  # exactly max_prompt_bytes: the longest prompt
    assert len(fits.encode()) == max_prompt_bytes(max_model_len, bound)
    ids = check_prompt(
        fits,
        vocab_size=tok.vocab_size,
        max_model_len=max_model_len,
        tokenize=tok.encode,
        max_token_bytes=bound,
    )
    assert len(ids) == max_model_len - 1  # it fits: the bound refused nothing that fits
    with pytest.raises(InvalidRequest) as refused:
        check_text_length(fits + " ", max_model_len=max_model_len, max_token_bytes=bound)
    assert refused.value.code == "prompt_too_long" and "at least 64 tokens" in str(refused.value)


def test_text_over_the_bound_is_refused_without_tokenizing(tok: TextTokenizer) -> None:
    def no_tokenizing(text: str) -> list[int]:
        raise AssertionError("tokenized")

    bound = tok.max_token_bytes
    assert bound is not None
    for text in ("x" * (2 << 20), "é" * (1 << 20), "🙂" * (255 * bound // 4 + 1)):
        with pytest.raises(InvalidRequest) as refused:
            check_prompt(
                text,
                vocab_size=tok.vocab_size,
                max_model_len=256,
                tokenize=no_tokenizing,
                max_token_bytes=bound,
            )
        assert refused.value.code == "prompt_too_long"
        assert refused.value.field == "prompt"


def test_no_bound_means_tokenize() -> None:
    """A tokenizer without a bound (None): every text is tokenized and judged by count."""
    calls: list[str] = []

    def tokenize(text: str) -> list[int]:
        calls.append(text)
        return [1] * 300

    with pytest.raises(InvalidRequest, match="300 tokens"):
        check_prompt("x" * 10, vocab_size=10, max_model_len=256, tokenize=tokenize)
    assert calls == ["x" * 10]
    check_text_length("x" * 10**6, max_model_len=2, max_token_bytes=None)  # no bound: passes


def test_multibyte_text_is_measured_in_utf8_bytes() -> None:
    bound = 4
    limit = max_prompt_bytes(10, bound)  # 36 bytes
    check_text_length("é" * (limit // 2), max_model_len=10, max_token_bytes=bound)
    with pytest.raises(InvalidRequest):
        check_text_length("é" * (limit // 2) + "x", max_model_len=10, max_token_bytes=bound)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def test_huge_text_prompts_are_refused_at_once_while_another_stream_runs() -> None:
    """Issue 15 item 12's proof: while another stream runs, three 2 MB prompts are refused
    within 100 ms each, the other stream keeps its pace, and RSS grows less than 50 MB."""
    huge = "def f(x):\n    return x\n" * (2_000_000 // 24)
    with trio.fail_after(120):
        async with open_runtime(RuntimeConfig(max_model_len=256)) as rt:
            gaps: list[float] = []
            refusals: list[float] = []
            running = trio.Event()

            async def other() -> None:
                last = time.perf_counter()
                params = SamplingParams(max_tokens=120, ignore_eos=True)
                async with rt.generate([1, 400, 25, 7], params) as stream:
                    async for _ in stream:
                        now = time.perf_counter()
                        gaps.append(now - last)
                        last = now
                        if len(gaps) == 5:
                            running.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(other)
                await running.wait()
                rss0 = _rss_mb()
                for _ in range(3):
                    t0 = time.perf_counter()
                    with pytest.raises(InvalidRequest) as refused:
                        async with rt.generate(huge, SamplingParams(max_tokens=4)) as stream:
                            async for _ in stream:
                                pass
                    refusals.append(time.perf_counter() - t0)
                    assert refused.value.code == "prompt_too_long"
                rss1 = _rss_mb()
            assert max(refusals) < 0.1, refusals
            assert rss1 - rss0 < 50
            steady = sorted(gaps[5:])[len(gaps[5:]) // 2]
            # tokenizing one such prompt would stall the stream about 3 s; a 2-core
            # machine shared with another busy process deschedules it up to about 0.4 s
            assert max(gaps[5:]) < max(10 * steady, 0.5), (max(gaps[5:]), steady)
