"""What ``spectrio bench`` runs: its prompts (held-out code, code to repeat, chat
messages, or random ids for the synthetic device), each case's speculative config, the
order of a round's cases, and the arrivals."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np

from spectrio import SpeculativeConfig
from spectrio.core.config import SPEC_METHODS
from spectrio.models.doubles.synthetic import is_synthetic, parse_spec
from spectrio.models.loading.loader import load_text_side, load_tokenizer
from spectrio.models.text.chat import build_chat_template
from spectrio.tools.training.chat_prompts import heldout_chat_prompts
from spectrio.tools.training.corpus import corpus_files, read_texts

WORKLOADS = ("heldout", "repeat", "chat")
"""What the prompts are (:func:`bench_prompts`)."""

PROMPT_STRIDE = 997
"""Tokens between the starts of two held-out prompts in one pass over the split."""


REPEAT_WORKLOAD_HEAD = 4
"""In the ``repeat`` workload a prompt ends with the first ``1/REPEAT_WORKLOAD_HEAD`` of
its own held-out window again."""


def bench_prompts(
    count: int, prompt_tokens: int, model: str, seed: int = 0, workload: str = "heldout"
) -> list[list[int]]:
    """``count`` prompts of ``prompt_tokens`` ids: held-out corpus text, or for the
    synthetic device seeded random ids (no EOS) within its vocabulary.

    ``workload="repeat"`` makes each a request to rewrite code it holds: the held-out
    window, then its own first quarter again, so a continuation that copies the code
    (as an edit-and-repeat request's answer does) can be drafted from the prompt itself.
    Such prompts hold ``prompt_tokens`` plus a quarter of them.

    Held-out prompts start every :data:`PROMPT_STRIDE` tokens of each text; a second pass
    starts halfway between the first pass's starts, so the first pass's prompts (412 of
    48 tokens from the bundled split) come first and unchanged, and about twice as many
    are available (batch 64 with 12 waves of requests, as batch 16 runs, needs 768).

    ``workload="chat"`` is for an instruct model: held-out user messages
    (:func:`spectrio.tools.training.chat_prompts.heldout_chat_prompts`, no topic or phrasing of
    which ``spectrio train-mtp`` trains on), each through the model's chat template;
    ``prompt_tokens`` does not apply."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")
    if is_synthetic(model):
        rng = np.random.default_rng(seed)
        ids = rng.integers(1, parse_spec(model).vocab, size=(count, prompt_tokens))
        return [[int(t) for t in row] for row in ids]
    if workload == "chat":
        return _chat_prompts(count, model)
    tok = load_tokenizer(model)  # not the weights: the cases load those
    assert tok is not None
    encoded: list[list[int]] = []

    def first_pass() -> Iterator[list[int]]:
        """Each text encoded as the first pass reaches it (most counts need only a few
        texts; all 82 take about 2 s), kept for the second pass."""
        for text in read_texts(corpus_files("heldout")):
            encoded.append(tok.encode(text))
            yield encoded[-1]

    head = max(prompt_tokens // REPEAT_WORKLOAD_HEAD, 1) if workload == "repeat" else 0
    out: list[list[int]] = []
    for offset, texts in ((0, first_pass()), (PROMPT_STRIDE // 2, encoded)):
        for ids_ in texts:
            for start in range(offset, len(ids_) - prompt_tokens, PROMPT_STRIDE):
                window = ids_[start : start + prompt_tokens]
                out.append(window + window[:head])
                if len(out) == count:
                    return out
    raise RuntimeError(
        f"the held-out split holds {len(out)} prompts of {prompt_tokens} tokens, "
        f"not the {count} requested"
    )


def _chat_prompts(count: int, model: str) -> list[list[int]]:
    """The first ``count`` held-out user messages, each one turn through the model's chat
    template (with the assistant's turn opened)."""
    cfg, tok, source = load_text_side(model)
    template = build_chat_template(source, tok, cfg)
    if template is None:
        raise ValueError(f"{model} has no chat template; --prompts chat needs one")
    return [template.encode([{"role": "user", "content": m}]) for m in heldout_chat_prompts(count)]


def spec_config(k: int | str, k_max: int = 4, method: str = "mtp") -> SpeculativeConfig:
    """0: no speculation; N: a fixed N drafts per step; "auto": adaptive, up to ``k_max``;
    drafts made by ``method`` (``mtp``, ``ngram`` or ``draft_model``), unless the case
    names its own (``"ngram:3"``, ``"mtp:auto"``: one run then compares the methods).
    ``draft_model/N``: the target's first N layers draft (``draft_model``: all of them)."""
    if isinstance(k, str) and ":" in k:
        method, k = k.split(":", 1)
        return spec_config(k if k == "auto" else int(k), k_max, method)
    method, _, layers = method.partition("/")
    draft_layers = int(layers) if layers else None
    if k == "auto":
        return SpeculativeConfig(
            method=method, num_speculative_tokens=k_max, adaptive=True, draft_layers=draft_layers
        )
    if k == 0:
        return SpeculativeConfig(method=None)
    return SpeculativeConfig(
        method=method, num_speculative_tokens=int(k), adaptive=False, draft_layers=draft_layers
    )


def parse_case_k(value: str) -> int | str:
    """A ``--k`` value: an int, ``"auto"``, or ``"METHOD:N"``/``"METHOD:auto"`` (METHOD
    one of :data:`~spectrio.core.config.SPEC_METHODS`, or ``draft_model/L``: the target's
    first L layers draft), kept as the case's label; raises ValueError otherwise."""
    if value == "auto":
        return value
    if ":" in value:
        method, k = value.split(":", 1)
        name, _, layers = method.partition("/")
        if name not in SPEC_METHODS or not (k == "auto" or int(k) > 0):
            raise ValueError(value)
        if layers and (name != "draft_model" or int(layers) < 1):
            raise ValueError(value)
        return f"{method}:{k}"
    return int(value)


def round_order(
    cases: Sequence[tuple[int, int | str, int | None]], round_: int
) -> list[tuple[int, int | str, int | None]]:
    """The cases in the order round ``round_`` runs them: grouped by batch size, so the
    cases compared with each other run close together, and each batch's group rotated by
    one case a round, so none always runs first or last. A machine that slows through a
    round (measured: 1567, 1684, 1776, 1551, 1415 and 1272 tokens/s in the order run at
    batch 64, adaptive last in every round) would otherwise charge its slowdown to the
    same case every time."""
    groups: dict[int, list[tuple[int, int | str, int | None]]] = {}
    for case in cases:
        groups.setdefault(case[0], []).append(case)
    out: list[tuple[int, int | str, int | None]] = []
    for group in groups.values():
        shift = round_ % len(group)
        out += group[shift:] + group[:shift]
    return out


def poisson_arrivals(count: int, rate: float | None, seed: int = 0) -> list[float]:
    """Arrival offsets in seconds of ``count`` requests: a seeded Poisson process of
    ``rate`` per second (the first at 0), or every one at 0 when ``rate`` is None."""
    if rate is None or count == 0:
        return [0.0] * count
    if not rate > 0 or math.isinf(rate):
        raise ValueError(f"request rate must be a positive number, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
