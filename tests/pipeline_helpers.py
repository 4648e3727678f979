"""Helpers shared by the pipeline tests: prompts, a small float64 config, a collector, and
the oracle."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from spectrio import Runtime, RuntimeConfig, SamplingParams, SpeculativeConfig
from spectrio.models import load, reference
from spectrio.tools.training.corpus import corpus_files, read_texts

HANDWRITTEN = [
    "def fib(n):",
    "import os\nimport sys\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n    ",
    "    return self._data[",
    "# Copyright",
    'if __name__ == "__main__":\n',
    "def __repr__(self):\n        return",
    "try:\n    import",
    "x = [i * i for i in",
]


def float64_config(*, k: int = 3, adaptive: bool = False, overlap: bool = False) -> RuntimeConfig:
    """A small float64 runtime (8 sequences, 512-token chunks) whose greedy output the
    oracle checks token for token."""
    return RuntimeConfig(
        dtype="float64",
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        enable_overlap=overlap,
        speculative=SpeculativeConfig(num_speculative_tokens=k, adaptive=adaptive),
    )


@lru_cache(maxsize=1)
def held_out_snippets(count: int = 10, max_tokens: int = 40) -> tuple[tuple[int, ...], ...]:
    tok = load("bundled").tokenizer
    assert tok is not None
    out = []
    for text in read_texts(corpus_files("heldout")):
        ids = tok.encode(text)
        if len(ids) > max_tokens:
            out.append(tuple(ids[:max_tokens]))
        if len(out) == count:
            break
    return tuple(out)


def prompts(tok: object) -> list[list[int]]:
    """20 prompts as token ids: handwritten openings plus held-out stdlib snippets."""
    return [tok.encode(p) for p in HANDWRITTEN] + [list(s) for s in held_out_snippets()]  # type: ignore[attr-defined]


async def collect(rt: Runtime, prompt: Sequence[int] | str, params: SamplingParams) -> list[int]:
    out: list[int] = []
    async for delta in rt.generate(prompt, params):
        out.extend(delta.token_ids)
    return out


_ORACLE: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def oracle(dtype: str, prompt: Sequence[int], max_tokens: int) -> list[int]:
    key = (dtype, tuple(prompt), max_tokens)
    if key not in _ORACLE:
        loaded = load("bundled", dtype=dtype)
        _ORACLE[key] = reference.greedy_generate(
            loaded.model, list(prompt), max_tokens, eos_token_id=loaded.config.eos_token_id
        ).token_ids
    return _ORACLE[key]
