"""The prefix-cache workload of ``spectrio bench --shared-prefix TOKENS``.

Each request's prompt is one system prompt of TOKENS held-out tokens followed by a short
unique suffix (``--prompt-tokens`` held-out tokens of its own): the shape of a service
whose requests share instructions or few-shot examples. Every case runs twice, with the
prefix cache on and off (``enable_prefix_caching``), and, as the control, on the same
prompts with each suffix moved in front of the system prompt: the same tokens and
lengths, but no two prompts share a first block, so the cache can only cost. The four
runs of a batch size and k alternate, their order rotated every ``--repeat`` round
(:func:`~spectrio.tools.measurement.bench_workload.round_order`), each on a fresh runtime
warmed up with one short request that shares no block with the workload.

Reported per case: tokens per second (output tokens over the wall time from the first
arrival to the last token), TTFT percentiles, the prefix cache's hit rate (hit tokens
over looked-up tokens, during the measured window), and per workload the on/off ratios:
TTFT p50 (off / on) and tokens per second (on / off).

``--multi-turn TURNS`` adds a chat workload: ``batch`` conversations run side by side,
each sending TURNS turns one after another; turn t's prompt is the conversation so far
(every earlier user message and the answer the runtime gave to it) followed by a new
user message of ``--prompt-tokens`` held-out tokens, so each turn resends the previous
turn's prompt, which the cache holds, and the answer, which it does not (only prompt
blocks are cached). Its TTFT percentiles are over the turns after the first (turn 0 has
nothing to find); tokens per second over the whole run.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import trio
from tqdm import tqdm

from spectrio import SamplingParams, open_runtime
from spectrio.tools.measurement.bench_report import format_cell, machine_name, median_run
from spectrio.tools.measurement.bench_run import CaseRun, case_config
from spectrio.tools.measurement.bench_workload import bench_prompts, round_order, spec_config
from spectrio.tools.measurement.latency import percentiles

__all__ = ["prefix_prompts", "run_multi_turn_case", "run_prefix_case", "run_shared_prefix"]

WORKLOADS = ("shared", "control")


def prefix_prompts(
    count: int, prefix_tokens: int, suffix_tokens: int, model: str, seed: int = 0
) -> dict[str, list[list[int]]]:
    """``shared``: one ``prefix_tokens`` system prompt, then each request's own
    ``suffix_tokens``; ``control``: each suffix first, then the system prompt."""
    windows = bench_prompts(count + 1, max(prefix_tokens, suffix_tokens), model, seed)
    system = windows[0][:prefix_tokens]
    suffixes = [w[:suffix_tokens] for w in windows[1:]]
    return {
        "shared": [system + s for s in suffixes],
        "control": [s + system for s in suffixes],
    }


async def run_prefix_case(
    model: str,
    dtype: str,
    k: int | str,
    batch: int,
    prompts: list[list[int]],
    max_tokens: int,
    caching: bool,
    overlap: bool = False,
    k_max: int = 4,
    method: str = "mtp",
) -> dict[str, Any]:
    """One run: every prompt at once, at most ``batch`` running; the bench's row keys
    plus the prefix cache's counters over the measured window."""
    spec = spec_config(k, k_max, method)
    cfg = case_config(model, dtype, batch, spec, prompts, max_tokens, overlap, caching)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    arrivals = [0.0] * len(prompts)
    async with open_runtime(cfg) as rt:
        case = CaseRun(rt, params, prompts, arrivals, None, False, batch, k)
        await case.warm_up()  # 8 tokens: no full block, nothing cached
        before = rt.stats()
        t0 = case.start()
        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(case.request, i)
        wall = time.perf_counter() - t0
        row = {**await case.row(wall), "samples": [[case.tokens, round(wall, 6)]]}
        after = rt.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return {
        "batch": batch,
        "k": k,
        "caching": caching,
        **row,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else 0.0,
        "prefix_cache_evictions": after.prefix_cache_evictions - before.prefix_cache_evictions,
    }


async def run_multi_turn_case(
    model: str,
    dtype: str,
    k: int | str,
    batch: int,
    messages: list[list[list[int]]],
    max_tokens: int,
    caching: bool,
    overlap: bool = False,
    k_max: int = 4,
    method: str = "mtp",
) -> dict[str, Any]:
    """``messages[c][t]``: conversation c's user message of turn t. Conversations run
    side by side, their turns one after another (module docstring)."""
    spec = spec_config(k, k_max, method)
    longest = sum(len(m) + max_tokens for m in max(messages, key=lambda c: sum(map(len, c))))
    cfg = case_config(model, dtype, batch, spec, [[0] * longest], max_tokens, overlap, caching)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ttfts: list[float] = []
    tokens = 0
    async with open_runtime(cfg) as rt:
        async for _ in rt.generate(messages[0][0][:8], SamplingParams(max_tokens=4)):
            pass
        await rt.wait_idle()
        before = rt.stats()

        async def conversation(turns: list[list[int]]) -> None:
            nonlocal tokens
            history: list[int] = []
            for t, message in enumerate(turns):
                prompt = history + message
                t0 = time.perf_counter()
                answer: list[int] = []
                async for delta in rt.generate(prompt, params):
                    if not answer and delta.token_ids and t:
                        ttfts.append((time.perf_counter() - t0) * 1e3)
                    answer += delta.token_ids
                tokens += len(answer)
                history = prompt + answer

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for turns in messages:
                nursery.start_soon(conversation, turns)
        wall = time.perf_counter() - t0
        after = rt.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return {
        "workload": "multiturn",
        "batch": batch,
        "k": k,
        "caching": caching,
        "requests": sum(map(len, messages)),
        "tokens": tokens,
        "seconds": round(wall, 4),
        "tokens_per_second": round(tokens / wall, 1),
        "ttft_ms": percentiles(ttfts),
        "tpot_ms": percentiles([]),
        "samples": [[tokens, round(wall, 6)]],
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else 0.0,
        "prefix_cache_evictions": after.prefix_cache_evictions - before.prefix_cache_evictions,
    }


def summary(rows: list[dict[str, Any]]) -> str:
    head = f"{'workload':>8} {'cache':>5} {'batch':>5} {'k':>4} {'tok/s':>8} {'ttft50':>8} "
    head += f"{'ttft99':>8} {'tpot50':>7} {'hit':>6} {'evict':>5}"
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['workload']:>8} {'on' if r['caching'] else 'off':>5} {r['batch']:>5} "
            f"{str(r['k']):>4} {r['tokens_per_second']:>8} "
            f"{format_cell(r['ttft_ms']['p50'], '.1f'):>8} "
            f"{format_cell(r['ttft_ms']['p99'], '.1f'):>8} "
            f"{format_cell(r['tpot_ms']['p50'], '.2f'):>7} {r['prefix_cache_hit_rate']:>6.1%} "
            f"{r['prefix_cache_evictions']:>5}"
        )
    lines.append("cache on vs off (TTFT p50 off/on, tokens/s on/off; medians over rounds):")
    for r in rows:
        if not r["caching"]:
            continue
        off = next(
            o
            for o in rows
            if not o["caching"]
            and (o["workload"], o["batch"], o["k"]) == (r["workload"], r["batch"], r["k"])
        )
        t_on, t_off = r["ttft_ms"]["p50"], off["ttft_ms"]["p50"]
        ttft = f"{t_off / t_on:.2f}x" if t_on and t_off else "-"
        rate = r["tokens_per_second"] / off["tokens_per_second"]
        lines.append(
            f"  {r['workload']} batch={r['batch']} k={r['k']}: TTFT p50 {ttft} lower, "
            f"tokens/s {rate:.2f}x"
        )
    return "\n".join(lines)


def run_shared_prefix(args: argparse.Namespace, ks: list[int | str], counts: dict[int, int]) -> int:
    """``spectrio bench --shared-prefix TOKENS``: the workloads above for each batch size
    and k of the command, ``--repeat`` rounds, median row per case."""
    prompts = prefix_prompts(
        max(counts.values()), args.shared_prefix, args.prompt_tokens, args.model, args.seed
    )
    turns = args.multi_turn or 0
    workloads = WORKLOADS + (("multiturn",) if turns else ())
    chats: list[list[list[int]]] = []
    if turns:
        windows = bench_prompts(max(args.batch) * turns, args.prompt_tokens, args.model, args.seed)
        chats = [windows[c * turns : (c + 1) * turns] for c in range(max(args.batch))]
    cases = [(b, k, None) for b in args.batch for k in ks]
    runs: dict[tuple[str, int, int | str, bool], list[dict[str, Any]]] = {}
    plan = [
        (round_, b, k, workload, caching)
        for round_ in range(args.repeat)
        for b, k, _ in round_order(cases, round_)
        for workload, caching in _rotated(round_, workloads)
    ]
    progress = args.progress == "on"
    for _, b, k, workload, caching in tqdm(plan, desc="bench", unit="run", disable=not progress):
        common = (args.max_tokens, caching, args.overlap, args.k_max, args.spec_method)
        if workload == "multiturn":
            row = trio.run(run_multi_turn_case, args.model, args.dtype, k, b, chats[:b], *common)
        else:
            case_prompts = prompts[workload][: counts[b]]
            row = trio.run(run_prefix_case, args.model, args.dtype, k, b, case_prompts, *common)
        runs.setdefault((workload, b, k, caching), []).append({**row, "workload": workload})
    rows = [
        median_run(runs[(w, b, k, c)])
        for b in args.batch
        for k in ks
        for w in workloads
        for c in (True, False)
    ]
    machine = machine_name()
    print(
        f"machine: {machine}; model={args.model} dtype={args.dtype} "
        f"shared_prefix={args.shared_prefix} suffix={args.prompt_tokens} "
        f"max_tokens={args.max_tokens} overlap={args.overlap} spec_method={args.spec_method} "
        f"requests={', '.join(f'{counts[b]} at batch {b}' for b in args.batch)} "
        f"rounds={args.repeat}"
        + (f" multi_turn={turns} turns x {max(args.batch)}" if turns else "")
    )
    print(summary(rows))
    if args.json:
        for r in rows:
            r.pop("_raw", None)
            r.pop("outputs", None)
        with open(args.json, "w") as fh:
            json.dump({"machine": machine, "args": vars(args), "rows": rows}, fh, indent=1)
    return 0


def _rotated(round_: int, workloads: tuple[str, ...]) -> list[tuple[str, bool]]:
    runs = [(w, c) for w in workloads for c in (True, False)]
    shift = round_ % len(runs)
    return runs[shift:] + runs[:shift]
