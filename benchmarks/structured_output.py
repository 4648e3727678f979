"""Structured output's speed on a real model (issue 60's goals).

* ``--batch 1``: the same chat prompts answered as free text and as JSON under a schema,
  the two cases alternated request by request through one runtime (the model's default
  speculation, so the grammar's forced tokens are drafted). The figure is decode tokens
  per second (tokens after the first over the time from the first to the last), pooled
  per case, and the JSON / free-text ratio with a bootstrap 95% interval over rounds.
* ``--batch 16``: 16 JSON requests at once, then 16 free-text ones, alternated: the
  grammar's share of the device worker's time over the constrained steps
  (``StepTiming.grammar_seconds`` over the step's device time: state, drafts, masks), and
  tokens/s of both.

Every finished JSON answer is validated with ``jsonschema``. Prints a progress line per
round on stderr and one JSON summary on stdout::

    python benchmarks/structured_output.py --model smollm2 --rounds 6
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np
import trio

from spectrio import RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.core.constraints import Constraint
from spectrio.runtime.api import Runtime

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 40},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 30},
                "city": {"type": "string", "maxLength": 20},
                "country": {"type": "string", "maxLength": 20},
            },
            "required": ["street", "city", "country"],
            "additionalProperties": False,
        },
        "role": {"enum": ["engineer", "teacher", "doctor", "artist", "other"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "email", "address", "role", "skills"],
    "additionalProperties": False,
}

PEOPLE = [
    "a nurse from Lyon",
    "a retired sailor",
    "a young painter in Lisbon",
    "a software engineer in Toronto",
    "a chemistry teacher",
    "a football coach from Manchester",
    "a baker in Vienna",
    "a pilot who loves chess",
    "a librarian in Kyoto",
    "a gardener from Cape Town",
    "a violinist in Prague",
    "a doctor in Nairobi",
    "a student of history",
    "a carpenter in Oslo",
    "a journalist in Buenos Aires",
    "a marine biologist",
]


def _chat(i: int, json_answer: bool) -> list[dict[str, str]]:
    ask = f"Describe {PEOPLE[i % len(PEOPLE)]}: their name, age, email, address, role and skills."
    if json_answer:
        ask += " Answer in JSON."
    return [{"role": "user", "content": ask}]


class Tally:
    def __init__(self) -> None:
        self.tokens = 0
        self.seconds = 0.0
        self.per_round: list[tuple[int, float]] = []
        self.valid = 0
        self.finished = 0

    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


async def _one(
    rt: Runtime, messages: list[dict[str, str]], params: SamplingParams
) -> tuple[int, float, str, str | None]:
    """Decode tokens (after the first), their seconds, the text and the finish reason."""
    first = last = None
    n = 0
    text, finish = "", None
    async with rt.chat(messages, params) as stream:
        async for delta in stream:
            now = time.perf_counter()
            if delta.token_ids:
                if first is None:
                    first = now
                    n -= 1
                last = now
                n += len(delta.token_ids)
            text += delta.text
            finish = delta.finish_reason or finish
    return (
        max(0, n),
        (last - first) if first is not None and last is not None else 0.0,
        text,
        finish,
    )


def _check(text: str, finish: str | None, tally: Tally) -> None:
    import jsonschema  # type: ignore[import-untyped, unused-ignore]

    if finish != "stop":
        return
    tally.finished += 1
    jsonschema.validate(json.loads(text), SCHEMA)
    tally.valid += 1


async def _batch(
    rt: Runtime, start: int, size: int, params: SamplingParams, json_answer: bool, tally: Tally
) -> tuple[int, float, float, float]:
    """``size`` requests at once: their decode tokens, their decode seconds (one request:
    from its first token to its last; a batch: the wall time), and the grammar's and the
    device's seconds over their steps."""
    results: list[tuple[int, float, str, str | None]] = []
    before = {t.step for t in rt.step_timings()}
    t0 = time.perf_counter()

    async def run(i: int) -> None:
        results.append(await _one(rt, _chat(start + i, json_answer), params))

    async with trio.open_nursery() as nursery:
        for i in range(size):
            nursery.start_soon(run, i)
    wall = time.perf_counter() - t0 if size > 1 else results[0][1]
    steps = [t for t in rt.step_timings() if t.step not in before]
    tokens = sum(r[0] for r in results)
    if json_answer:
        for _, _, text, finish in results:
            _check(text, finish, tally)
    return (
        tokens,
        wall,
        sum(t.grammar_seconds for t in steps),
        sum(t.device for t in steps),
    )


def _ratio_interval(
    a: list[tuple[int, float]], b: list[tuple[int, float]], seed: int = 0
) -> list[float]:
    """Bootstrap 95% interval of (sum a tokens / sum a s) / (same for b), resampling rounds."""
    rng = np.random.default_rng(seed)
    n = len(a)
    ratios = []
    for _ in range(2000):
        idx = rng.integers(0, n, n)
        ra = sum(a[i][0] for i in idx) / max(1e-9, sum(a[i][1] for i in idx))
        rb = sum(b[i][0] for i in idx) / max(1e-9, sum(b[i][1] for i in idx))
        ratios.append(ra / rb)
    return [float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))]


async def main(args: argparse.Namespace) -> dict[str, Any]:
    spec = SpeculativeConfig(method=None) if args.no_spec else SpeculativeConfig()
    cfg = RuntimeConfig(
        model=args.model, max_model_len=1024, max_num_seqs=max(args.batch), speculative=spec
    )
    constraint = Constraint.json_schema(SCHEMA)
    out: dict[str, Any] = {"model": args.model, "speculative": spec.method, "rounds": args.rounds}
    async with open_runtime(cfg) as rt:
        for batch in args.batch:
            free, structured = Tally(), Tally()
            grammar_s = device_s = 0.0
            for r in range(args.rounds + 1):  # round 0 warms up, untimed
                order = [(False, free), (True, structured)]
                if r % 2:
                    order.reverse()
                for json_answer, tally in order:
                    params = SamplingParams(
                        max_tokens=args.max_tokens,
                        temperature=args.temperature,
                        seed=r,
                        constraint=constraint if json_answer else None,
                    )
                    n, s, g, d = await _batch(rt, r * batch, batch, params, json_answer, tally)
                    if r == 0:
                        continue
                    tally.tokens += n
                    tally.seconds += s
                    tally.per_round.append((n, s))
                    if json_answer:
                        grammar_s += g
                        device_s += d
                rates = f"free {free.rate():.1f} tok/s, json {structured.rate():.1f} tok/s"
                print(f"b{batch} round {r}: {rates}", file=sys.stderr)
            out[f"b{batch}"] = {
                "free_tok_s": free.rate(),
                "json_tok_s": structured.rate(),
                "json_over_free": structured.rate() / free.rate() if free.rate() else None,
                "interval95": _ratio_interval(structured.per_round, free.per_round),
                # each round's ratio, its median: robust to one slow round of the host
                "paired_median": float(
                    np.median(
                        [
                            (a[0] / a[1]) / (b[0] / b[1])
                            for a, b in zip(structured.per_round, free.per_round, strict=True)
                            if a[1] and b[1]
                        ]
                    )
                ),
                "json_finished": structured.finished,
                "json_valid": structured.valid,
                "grammar_share_of_device": grammar_s / device_s if device_s else None,
            }
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-spec", action="store_true", help="both cases without speculation")
    print(json.dumps(trio.run(main, p.parse_args()), indent=1))
