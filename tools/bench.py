"""Throughput benchmark of the pipeline on a model (default: the bundled one).

For each batch size and speculation setting it runs ``batch`` concurrent requests of
held-out stdlib prompts (``ignore_eos``, fixed ``max_tokens``) and reports output tokens
per second, the mean accepted length (tokens emitted per verify step), and the share of
wall time spent outside Paddle forward calls (the pipeline's own overhead: scheduling,
channels, threads, sampling, detokenisation).

``--logprobs off 0 20`` repeats every case with each logprob setting (``off``: none; N: the
sampled token plus N alternatives, in every request) and reports the step record's mean
bytes per step next to FastDeploy's fixed 512 x 6 x 21 message (530,444 bytes) and a fixed
``batch x 6 x 21`` layout of the same batch.

``--agreement`` also reports the float32 pipeline's token agreement with the float32
one-token-at-a-time reference (batched verification rounds differently in float32).

Run: ``spectrio bench [--batch 1 16] [--k 0 1 2 3] [--logprobs off 0 20] [--max-tokens 64]
[--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import trio
from tqdm import tqdm

from spectrio import RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.core.messages import PublishedStep
from spectrio.models import load, reference
from spectrio.tools.corpus import corpus_files, read_texts
from spectrio.tools.generation_stats import GenerationStats

FIXED_512_BYTES = 4 * (3 + 512) + 512 * (6 * 21 * 4 * 2 + 6 * 4)
"""FastDeploy's speculative top-k message: meta[3 + 512] plus 512 slots of
int tokens[6*21], float scores[6*21], int ranks[6] (530,444 bytes)."""


def fixed_layout_bytes(batch: int) -> int:
    """The same fixed 6 x 21 per-slot layout sized to ``batch`` slots."""
    return 4 * (3 + batch) + batch * (6 * 21 * 4 * 2 + 6 * 4)


def bench_prompts(count: int, prompt_tokens: int, model: str) -> list[list[int]]:
    tok = load(model).tokenizer
    assert tok is not None
    out: list[list[int]] = []
    for text in read_texts(corpus_files("heldout")):
        ids = tok.encode(text)
        for start in range(0, len(ids) - prompt_tokens, 997):
            out.append(ids[start : start + prompt_tokens])
            if len(out) == count:
                return out
    raise RuntimeError("held-out split too small for the requested prompts")


def spec_config(k: int | str, k_max: int = 3) -> SpeculativeConfig:
    """0: no speculation; N: a fixed N drafts per step; "auto": adaptive, up to ``k_max``."""
    if k == "auto":
        return SpeculativeConfig(num_speculative_tokens=k_max, adaptive=True)
    if k == 0:
        return SpeculativeConfig(method=None)
    return SpeculativeConfig(num_speculative_tokens=int(k), adaptive=False)


async def run_case(
    model: str,
    dtype: str,
    k: int | str,
    batch: int,
    prompts: list[list[int]],
    max_tokens: int,
    logprobs: int | None = None,
    overlap: bool = False,
    k_max: int = 3,
) -> dict[str, object]:
    spec = spec_config(k, k_max)
    cfg = RuntimeConfig(
        model=model,
        dtype=dtype,
        speculative=spec,
        max_num_seqs=max(batch, 1),
        max_num_batched_tokens=max(2048, batch * spec.tokens_per_seq),
        max_model_len=512,
        enable_overlap=overlap,
    )
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    record_bytes: list[int] = []

    def observe(pub: PublishedStep) -> None:
        record_bytes.append(len(pub.record))

    async with open_runtime(cfg) as rt:
        async for _ in rt.generate(prompts[0][:8], SamplingParams(max_tokens=4)):  # warm-up
            pass
        stats = [GenerationStats() for _ in range(batch)]
        outputs: list[list[int]] = [[] for _ in range(batch)]
        fwd0, steps0 = rt.workspace.forward_seconds, rt.num_steps
        rt.add_record_observer(observe)
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            async for delta in rt.generate(prompts[i], params):
                stats[i].add(delta)
                outputs[i] += delta.token_ids

        async with trio.open_nursery() as nursery:
            for i in range(batch):
                nursery.start_soon(one, i)
        wall = time.perf_counter() - t0
        forward = rt.workspace.forward_seconds - fwd0
        steps = rt.num_steps - steps0
    tokens = sum(s.num_tokens for s in stats)
    return {
        "batch": batch,
        "k": k,
        "logprobs": "off" if logprobs is None else logprobs,
        "dtype": dtype,
        "tokens": tokens,
        "seconds": round(wall, 3),
        "tokens_per_second": round(tokens / wall, 1),
        "mean_accept_len": round(tokens / max(1, sum(s.num_steps for s in stats)), 3),
        "pipeline_steps": steps,
        "overhead_share": round(1.0 - forward / wall, 4),
        "record_bytes_per_step": round(sum(record_bytes) / max(1, len(record_bytes)), 1),
        "fixed_bytes_same_batch": fixed_layout_bytes(batch),
        "fixed_bytes_512": FIXED_512_BYTES,
        "outputs": outputs,
    }


def _median_run(runs: list[dict[str, object]]) -> dict[str, object]:
    """The run with the median tokens per second, with every run's figure attached."""
    ordered = sorted(runs, key=lambda r: float(r["tokens_per_second"]))  # type: ignore[arg-type]
    row = dict(ordered[len(ordered) // 2])
    row["tokens_per_second_runs"] = [r["tokens_per_second"] for r in runs]
    return row


def agreement(
    model: str, prompts: list[list[int]], outputs: list[list[int]], max_tokens: int
) -> float:
    loaded = load(model, dtype="float32")
    same = total = 0
    for prompt, got in zip(prompts, outputs, strict=False):
        want = reference.greedy_generate(loaded.model, prompt, max_tokens).token_ids
        n = min(len(want), len(got))
        first_diff = next((i for i in range(n) if want[i] != got[i]), n)
        same += first_diff
        total += len(want)
    return same / total if total else 1.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="spectrio bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="bundled")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument(
        "--k",
        nargs="+",
        default=["0", "1", "2", "3", "auto"],
        help="0 means --no-spec, N a fixed k, 'auto' the adaptive policy up to --k-max",
    )
    p.add_argument("--k-max", type=int, default=3, help="largest k the adaptive policy may use")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every case this many times, interleaved, and report medians",
    )
    p.add_argument(
        "--logprobs",
        nargs="+",
        default=["off"],
        help="logprob settings to run: 'off' or N in 0..20 (top alternatives)",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--agreement", action="store_true", help="float32 agreement with the reference")
    p.add_argument("--overlap", action="store_true", help="run with enable_overlap=True")
    p.add_argument("--json", type=str, default=None, help="write results to this file")
    args = p.parse_args(argv)

    try:
        settings = [None if v == "off" else int(v) for v in args.logprobs]
    except ValueError:
        p.error("--logprobs takes 'off' or integers")
    if any(v is not None and not 0 <= v <= 20 for v in settings):
        p.error("--logprobs values must be 'off' or in 0..20")
    try:
        ks: list[int | str] = [v if v == "auto" else int(v) for v in args.k]
    except ValueError:
        p.error("--k takes integers and 'auto'")
    prompts = bench_prompts(max(args.batch), args.prompt_tokens, args.model)
    cases = [(b, k, lp) for b in args.batch for k in ks for lp in settings]
    runs: dict[tuple[int, int | str, int | None], list[dict[str, object]]] = {c: [] for c in cases}
    # Rounds alternate the cases, so a busy machine slows every case alike.
    for _round, (b, k, lp) in tqdm(
        [(r, c) for r in range(args.repeat) for c in cases], desc="bench", unit="case"
    ):
        runs[(b, k, lp)].append(
            trio.run(
                run_case,
                args.model,
                args.dtype,
                k,
                b,
                prompts,
                args.max_tokens,
                lp,
                args.overlap,
                args.k_max,
            )
        )
    rows = [_median_run(runs[c]) for c in cases]
    cores = __import__("os").cpu_count()
    machine = f"{platform.machine()} {platform.processor() or ''} cores={cores}".strip()
    print(
        f"machine: {machine}; model={args.model} dtype={args.dtype} max_tokens={args.max_tokens} "
        f"overlap={args.overlap}"
    )
    print(
        f"{'batch':>5} {'k':>3} {'logprobs':>8} {'tok/s':>8} {'accept_len':>10} {'overhead':>9} "
        f"{'steps':>6} {'record B/step':>13} {'fixed B (batch)':>15} {'fixed B (512)':>13}"
    )
    for r in rows:
        k_label = "off" if r["k"] == 0 else str(r["k"])
        print(
            f"{r['batch']:>5} {k_label:>3} {r['logprobs']:>8} {r['tokens_per_second']:>8} "
            f"{r['mean_accept_len']:>10} {r['overhead_share']:>9.1%} {r['pipeline_steps']:>6} "
            f"{r['record_bytes_per_step']:>13} {r['fixed_bytes_same_batch']:>15} "
            f"{r['fixed_bytes_512']:>13}"
        )
    if args.agreement:
        if args.dtype != "float32":
            p.error("--agreement compares float32 runs")
        for r in rows:
            r["agreement"] = round(agreement(args.model, prompts, r["outputs"], args.max_tokens), 4)  # type: ignore[arg-type]
            print(f"agreement batch={r['batch']} k={r['k']}: {r['agreement']:.2%}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "machine": machine,
                    "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows],
                },
                fh,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
