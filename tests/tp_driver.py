"""Tensor-parallel scenarios, each run in a fresh process by ``tests/test_tensor_parallel.py``
(a process joins at most one collective group, and TP=2 changes the environment). Prints
one JSON line with what the test checks.

    python tests/tp_driver.py generate TP K
    python tests/tp_driver.py prefix TP K on|off
    python tests/tp_driver.py prompt TP K
    python tests/tp_driver.py constrained TP K
    python tests/tp_driver.py kill
    python tests/tp_driver.py twice
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import trio

from spectrio import RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.errors import ConfigError, EngineDead

#: a model file to run instead of the bundled model in float64
MODEL_ENV = "TP_DRIVER_MODEL"

PROMPTS = [
    "Once upon a time",
    "The little robot",
    "In the garden there was a",
]


def config(tp: int, k: int, method: str = "mtp", **kw: object) -> RuntimeConfig:
    fields: dict[str, object] = {
        "dtype": "float64",
        "max_model_len": 128,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 64,
        "num_kv_blocks": 64,
        "num_threads": 1,
        "tensor_parallel_size": tp,
        "speculative": (
            SpeculativeConfig(method=None)
            if k == 0
            else SpeculativeConfig(
                method=method, num_speculative_tokens=k, adaptive=False, prompt_lookup_min=1
            )
        ),
    }
    model = os.environ.get(MODEL_ENV)
    if model:  # a GGUF file, served from its quantized blocks in float32
        fields.update(model=model, dtype="float32")
    fields.update(kw)
    return RuntimeConfig(**fields)  # type: ignore[arg-type]


async def generate(tp: int, k: int, max_tokens: int, method: str = "mtp") -> dict[str, object]:
    records: list[int] = []
    outputs: list[list[int]] = [[] for _ in PROMPTS]
    with trio.fail_after(240):
        async with open_runtime(config(tp, k, method)) as rt:
            rt.add_record_observer(lambda p: records.append(p.step))
            group = rt._group
            pids = [p.pid for p in group.procs.values()] if group is not None else []

            async def one(i: int) -> None:
                params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
                async with rt.generate(PROMPTS[i], params) as stream:
                    async for delta in stream:
                        outputs[i] += delta.token_ids

            async with trio.open_nursery() as nursery:
                for i in range(len(PROMPTS)):
                    nursery.start_soon(one, i)
            await rt.wait_idle()
            steps = rt.num_steps
            link = group.link if group is not None else None
            sent = link.messages_sent if link is not None else 0
    return {
        "outputs": outputs,
        "records": records,
        "steps": steps,
        "pids": pids,
        "link_messages": sent,
        "drafts_proposed": rt.num_drafts_proposed,
    }


async def pressure(tp: int, k: int, method: str = "mtp") -> dict[str, object]:
    """Overlap on, chunked prefill (a 40-token prompt in a 16-token budget), a KV pool
    small enough to preempt, and seeded random requests beside greedy ones."""
    prompts = [
        list(range(300 + 11 * i, 300 + 11 * i + (40 if i == 0 else 6 + 5 * i))) for i in range(4)
    ]
    outputs: list[list[int]] = [[] for _ in prompts]
    cfg = config(
        tp,
        k,
        method,
        max_model_len=80,
        max_num_batched_tokens=16,
        num_kv_blocks=24,
        block_size=4,
        enable_overlap=True,
    )
    with trio.fail_after(240):
        async with open_runtime(cfg) as rt:

            async def one(i: int) -> None:
                params = (
                    SamplingParams(max_tokens=24, temperature=1.0, seed=77 + i, ignore_eos=True)
                    if i % 2
                    else SamplingParams(max_tokens=24, ignore_eos=True)
                )
                async with rt.generate(prompts[i], params) as stream:
                    async for delta in stream:
                        outputs[i] += delta.token_ids

            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i)
            await rt.wait_idle()
            preemptions = rt.scheduler.num_preemptions
            free = rt.blocks.num_free_blocks == rt.blocks.num_blocks
    return {"outputs": outputs, "preemptions": preemptions, "blocks_back": free}


async def constrained(tp: int, k: int, method: str = "mtp") -> dict[str, object]:
    """Structured output under overlap and preemption: every rank keeps the grammar state
    from the plans alone and cuts the same drafts, so the ranks verify the same rows."""
    from spectrio.core.constraints import Constraint

    schema = {
        "type": "object",
        "properties": {"a": {"enum": ["x", "yy"]}, "b": {"type": "integer", "maximum": 99}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    constraints = [
        Constraint.json_schema(schema),
        Constraint.choice(["one", "two three"]),
        Constraint.json_schema(schema),
        Constraint.regex("[a-c]{2,5}-[0-9]{3}"),
    ] * 2
    outputs: list[list[int]] = [[] for _ in constraints]
    cfg = config(tp, k, method, max_model_len=64, num_kv_blocks=17, block_size=4,
                 max_num_batched_tokens=16, enable_overlap=True)  # fmt: skip
    with trio.fail_after(240):
        async with open_runtime(cfg) as rt:

            async def one(i: int) -> None:
                params = SamplingParams(
                    max_tokens=32,
                    temperature=1.0 if i % 2 else 0.0,
                    seed=5 + i,
                    constraint=constraints[i],
                )
                async with rt.generate(PROMPTS[i % len(PROMPTS)], params) as stream:
                    async for delta in stream:
                        outputs[i] += delta.token_ids

            async with trio.open_nursery() as nursery:
                for i in range(len(constraints)):
                    nursery.start_soon(one, i)
            await rt.wait_idle()
            preemptions = rt.scheduler.num_preemptions
            free = rt.blocks.num_free_blocks == rt.blocks.num_blocks
            drafts = rt.scheduler.acceptance.proposed
    return {"outputs": outputs, "preemptions": preemptions, "blocks_back": free, "drafts": drafts}


async def prompt(tp: int, k: int, method: str = "mtp") -> dict[str, object]:
    """prompt_logprobs under overlap, chunked prefill (16-token budget) and a pool small
    enough to preempt: every rank computes the scored rows' logits (the same
    logits_indices, so the vocabulary-parallel head's collective matches), rank 0 alone
    reduces and publishes them. Returns each request's tokens and prompt logprobs, and
    how many prompt logprob entries the records carried in all."""
    prompts = [list(range(300 + 11 * i, 300 + 11 * i + 20 + 7 * i)) for i in range(4)]
    outputs: list[list[int]] = [[] for _ in prompts]
    scores: list[list[object]] = [[] for _ in prompts]
    published: list[int] = []
    cfg = config(
        tp, k, method, max_model_len=80, max_num_batched_tokens=16, num_kv_blocks=24,
        block_size=4, enable_overlap=True,
    )  # fmt: skip
    with trio.fail_after(240):
        async with open_runtime(cfg) as rt:
            rt.add_record_observer(
                lambda p: published.append(sum(len(v) for v in p.prompt_logprobs.values()))
            )

            async def one(i: int) -> None:
                params = SamplingParams(max_tokens=20, ignore_eos=True, prompt_logprobs=2)
                async with rt.generate(prompts[i], params) as stream:
                    async for delta in stream:
                        outputs[i] += delta.token_ids
                        for e in delta.prompt_logprobs or []:
                            scores[i].append([e.token_id, e.logprob, e.rank, e.top])

            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i)
            await rt.wait_idle()
            preemptions = rt.scheduler.num_preemptions
    return {
        "outputs": outputs,
        "scores": scores,
        "published": sum(published),
        "expected": sum(len(p) - 1 for p in prompts),
        "preemptions": preemptions,
    }


async def prefix(tp: int, k: int, method: str, caching: bool) -> dict[str, object]:
    """Prefix caching: a second wave of requests shares the first wave's 41-token prefix
    (overlap on, chunked prefill, greedy and seeded). Rank 0 decides every hit; a follower
    reads it from the plan."""
    shared = list(range(300, 341))
    prompts = [shared + list(range(400 + 7 * i, 403 + 7 * i)) for i in range(5)]
    outputs: list[list[int]] = [[] for _ in prompts]
    cfg = config(
        tp,
        k,
        method,
        max_model_len=80,
        max_num_batched_tokens=16,
        block_size=4,
        enable_overlap=True,
        enable_prefix_caching=caching,
    )
    with trio.fail_after(240):
        async with open_runtime(cfg) as rt:

            async def one(i: int) -> None:
                params = (
                    SamplingParams(max_tokens=16, temperature=1.0, seed=77 + i, ignore_eos=True)
                    if i % 2
                    else SamplingParams(max_tokens=16, ignore_eos=True)
                )
                async with rt.generate(prompts[i], params) as stream:
                    async for delta in stream:
                        outputs[i] += delta.token_ids

            for wave in ([0, 1], [2, 3, 4]):
                async with trio.open_nursery() as nursery:
                    for i in wave:
                        nursery.start_soon(one, i)
                await rt.wait_idle()
            hits = rt.stats().prefix_cache_hits
            free = rt.blocks.num_free_blocks == rt.blocks.num_blocks
    return {"outputs": outputs, "hits": hits, "blocks_back": free}


async def kill() -> dict[str, object]:
    """Kill rank 1 with SIGKILL once tokens flow; every request must end with EngineDead."""
    errors: list[str] = []
    t_kill = 0.0
    ended: list[float] = []
    pid = 0
    try:
        with trio.fail_after(120):
            async with open_runtime(config(2, 2)) as rt:
                assert rt._group is not None
                pid = rt._group.procs[1].pid

                async def one(i: int) -> None:
                    nonlocal t_kill
                    params = SamplingParams(max_tokens=100, ignore_eos=True)
                    try:
                        async with rt.generate(PROMPTS[i], params) as stream:
                            async for _delta in stream:
                                if i == 0 and not t_kill:
                                    t_kill = time.monotonic()
                                    os.kill(pid, signal.SIGKILL)
                    except EngineDead as exc:
                        errors.append(str(exc))
                    ended.append(time.monotonic())

                async with trio.open_nursery() as nursery:
                    for i in range(len(PROMPTS)):
                        nursery.start_soon(one, i)
    except EngineDead as exc:
        exit_error = str(exc)
    else:
        exit_error = ""
    return {
        "errors": errors,
        "exit_error": exit_error,
        "seconds_to_fail": max(ended) - t_kill if ended and t_kill else None,
        "pid": pid,
    }


async def twice() -> dict[str, object]:
    """A second group in the same process is refused with ConfigError, at once."""
    await generate(2, 0, 2)
    t0 = time.monotonic()
    try:
        with trio.fail_after(30):
            await generate(2, 0, 2)
    except ConfigError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - t0}
    return {"error": None}


def main() -> None:
    what = sys.argv[1]
    # k as "2", or "ngram:2" for another draft method
    method, _, k = (sys.argv[3] if len(sys.argv) > 3 else "").rpartition(":")
    method = method or "mtp"
    if what == "generate":
        out = trio.run(generate, int(sys.argv[2]), int(k), int(sys.argv[4]), method)
    elif what == "pressure":
        out = trio.run(pressure, int(sys.argv[2]), int(k), method)
    elif what == "constrained":
        out = trio.run(constrained, int(sys.argv[2]), int(k), method)
    elif what == "prompt":
        out = trio.run(prompt, int(sys.argv[2]), int(k), method)
    elif what == "prefix":
        out = trio.run(prefix, int(sys.argv[2]), int(k), method, sys.argv[4] == "on")
    elif what == "twice":
        out = trio.run(twice)
    elif what == "kill":
        out = trio.run(kill)
    else:
        raise SystemExit(f"unknown scenario {what!r}")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
