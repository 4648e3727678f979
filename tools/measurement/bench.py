"""Benchmark of the pipeline on a model: throughput, latency, acceptance and where each
step's time goes.

For each batch size and speculation setting it runs ``--num-requests`` requests (one
count, or one per batch size, so that each batch size's cases run about as long: a case's
figure carries the machine's noise in proportion to one over the root of its seconds;
default: the batch size times ``--waves``, default 1, and at least ``--min-requests``: a small
batch then runs long enough to reach its steady state, as a server's runtime does, where
a few requests would time mostly its first steps) with at most ``batch`` running at once
(``max_num_seqs``), each ``ignore_eos`` with a fixed ``--max-tokens``. With several waves
a finished request's slot goes to the next waiting one, so the batch stays full until the
last wave: the steady state of a server, rather than one batch that shrinks at its end as
its requests finish on different steps (speculation finishes them unevenly), and at batch
1 a run long enough to time on a noisy machine (one 128-token request lasts 0.4 s).
Requests arrive all at once, or as a seeded Poisson process with ``--request-rate R``
requests per second. Prompts are held-out corpus text for real models and seeded random
token ids for ``--model synthetic:...`` (the synthetic device,
:mod:`spectrio.models.doubles.synthetic`, which measures the runtime alone:
``--model synthetic:step_ms=10,per_row_us=20``).

``--logprobs off 0 20`` repeats every case with each logprob setting (``off``: none; N: the
sampled token plus N alternatives, in every request) and reports the step record's mean
bytes per step next to FastDeploy's fixed 512 x 6 x 21 message (530,444 bytes) and a fixed
``batch x 6 x 21`` layout of the same batch. ``--agreement`` also reports the float32
pipeline's token agreement with the float32 one-token-at-a-time reference (not for the
synthetic device, which has no reference path). ``--plot out.png`` draws an inter-token
latency histogram, acceptance per draft position and a step timeline (device busy
intervals) per case. ``--save-trace PATH`` saves each run as a request trace
(``docs/trace.md``: the planned arrivals, each request's result, and a summary) for
``spectrio replay`` and ``spectrio diff``.

``--interleave SECONDS`` runs the cases of a batch size side by side instead of one after
another: every case's runtime is open at once with all its requests queued, and they take
turns of SECONDS on the machine (``Runtime.pause``/``resume``: one steps at a time, in an
order rotated every turn). Tokens per second count each case's own turns. On a shared
machine whose speed drifts over seconds to minutes, each case then meets every stretch
instead of its own, so the ratios between cases hold still where one-after-another
rounds moved by 10-20%. Latencies would include the other cases' turns: the rows have none.

Run: ``spectrio bench [--model M] [--batch 1 16] [--k 0 1 2 3 auto] [--waves W] [--request-rate R]
[--logprobs off 0 20] [--max-tokens 64] [--overlap] [--json out.json] [--plot out.png]
[--save-trace run.jsonl]``.

JSON (``--json``; stable, for scripts that compare runs): ``{"schema": 2, "machine",
"memory" ({"peak_rss_mib"}: the bench process's peak; for a checkpoint, the memory floor
of its forward, probed after the runs (:mod:`spectrio.models.ops.memory_floor`):
``read_gb_s`` and ``read_method``, the bandwidth probe; ``forward_weight_bytes``, what a
target forward reads of its weights; ``floor_us_1row``, those bytes at that bandwidth,
the least a 1-row forward can take),
"args" (the options), "rows": [...]}`` with one row per case, keys:

* case: ``batch``, ``k`` (int or "auto"), ``logprobs`` ("off" or N), ``dtype``,
  ``overlap``, ``request_rate`` (null: all at once), ``interleave`` (the turn in seconds
  with ``--interleave``, else null), ``requests``, ``max_tokens``;
* throughput: ``tokens`` (output tokens), ``seconds`` (wall, first arrival to last
  token), ``tokens_per_second``, ``requests_per_second``, ``tokens_per_second_runs``
  (every ``--repeat`` run; the row is the median one), ``samples`` (``[tokens,
  seconds]`` of every turn of every run with ``--interleave``, of every run otherwise),
  ``tokens_per_second_pooled`` (all of them pooled) and ``tokens_per_second_se`` (its
  standard error, null with one sample;
  :func:`spectrio.tools.measurement.bench_speedup.pooled_rate`);
* latency, each ``{"p50", "p90", "p99", "mean"}`` in ms (null when there is no sample):
  ``ttft_ms`` (arrival to first token), ``itl_ms`` (gap between consecutive deltas of a
  request; a delta carries every token a step emitted), ``tpot_ms`` (per request:
  (last token - first token) / (tokens - 1));
* speculation: ``mean_accept_len`` (tokens per request per step), ``mean_accepted``
  (drafts accepted per request per step), ``acceptance_per_position`` (position i:
  accepted / proposed with drafts 1..i-1 accepted, the draft model's conditional rate),
  ``accepted_per_position`` (accepted / proposed), ``drafts_proposed``,
  ``drafts_accepted``;
* device (from ``Runtime.step_timings()`` over the measured steps, after the warm-up;
  :func:`spectrio.core.timing.device_summary`): ``efficiency`` (device busy / wall),
  ``bubble`` (device idle between steps / wall), ``model_share`` (model forwards /
  wall), ``overhead_share`` (1 - model_share), ``pipeline_steps``, ``steps_by_k``
  (steps with decoding sequences by the drafts each proposed, keys as strings: the
  adaptive policy's choices; the table prints their shares for ``auto``),
  ``timing_cache_warm`` (the adaptive policy started this batch's bucket from step times
  kept by an earlier run: ``runtime/timing_cache.py``), ``breakdown_ms``:
  mean per step of ``schedule``, ``draft``, ``verify``, ``sample``, ``publish``,
  ``idle`` (idle: mean gap between steps);
* records: ``record_bytes_per_step``, ``fixed_bytes_same_batch``, ``fixed_bytes_512``;
* ``agreement`` with ``--agreement`` only.

``"speedups"``: per batch size (and logprob setting) that has ``k = 0`` and a fixed k,
:class:`spectrio.tools.measurement.bench_speedup.Speedup` as a map: ``best_k``, ``best_over_none``
and ``auto_over_better`` (ratios of medians; null without an ``auto`` case), each also
``..._rounds`` (round by round), ``..._paired`` (the median of the rounds' ratios),
``..._pooled`` (the ratio of pooled rates) and ``..._se`` (its standard error), and
``better`` (``best_k``, or 0 where no speculation was faster). The text output prints
them under the table.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path
from typing import Any

import msgspec
import trio
import trio.testing
from tqdm import tqdm

from spectrio.core.config import SPEC_METHODS
from spectrio.core.constraints import CONSTRAINT_KINDS, Constraint, check_constraint
from spectrio.models.doubles.synthetic import is_synthetic
from spectrio.process_memory import peak_rss_bytes
from spectrio.runtime import timing_cache
from spectrio.tools.measurement.bench_report import (
    agreement,
    json_row,
    machine_name,
    median_run,
    memory_floor,
    summary_table,
)
from spectrio.tools.measurement.bench_run import run_case, run_interleaved
from spectrio.tools.measurement.bench_speedup import format_speedups, speedups
from spectrio.tools.measurement.bench_workload import (
    WORKLOADS,
    bench_prompts,
    parse_case_k,
    round_order,
)

SCHEMA = 2
"""Version of the ``--json`` layout; bumped when a key changes meaning or goes away."""


def trace_path(
    path: str | None, batch: int, k: int | str, logprobs: int | None, round_: int, single: bool
) -> str | None:
    """Where ``--save-trace PATH`` saves one run: PATH itself when the command has a
    single run, else PATH with the run's case and round before its suffix."""
    if path is None or single:
        return path
    p = Path(path)
    lp = "off" if logprobs is None else logprobs
    return str(p.with_name(f"{p.stem}.b{batch}.k{k}.lp{lp}.r{round_}{p.suffix}"))


def parse_constraint(text: str | None) -> Constraint | None:
    """``--constraint``'s value: ``json_object``, or ``KIND:SPEC`` with the spec as text
    or ``@FILE``; checked as a request's constraint is."""
    if text is None:
        return None
    kind, _, spec = text.partition(":")
    if spec.startswith("@"):
        spec = Path(spec[1:]).read_text()
    if kind not in CONSTRAINT_KINDS or kind == "choice":
        raise ValueError(f"KIND must be json_object, json_schema, regex or grammar, got {kind!r}")
    constraint = msgspec.convert({"kind": kind, "spec": spec}, Constraint)
    return check_constraint(constraint)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="spectrio bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="bundled",
        help="'bundled', a checkpoint folder, or the synthetic device "
        "'synthetic:step_ms=10,per_row_us=20,accept=0.8,0.6,0.4'",
    )
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="max running requests")
    p.add_argument(
        "--k",
        nargs="+",
        default=["0", "1", "2", "3", "auto"],
        help="0 means --no-spec, N a fixed k, 'auto' the adaptive policy up to --k-max; "
        "METHOD:N or METHOD:auto (mtp, ngram, draft_model, or draft_model/L: the target's "
        "first L layers) drafts that case with METHOD instead of --spec-method, so one run "
        "compares methods",
    )
    p.add_argument("--k-max", type=int, default=4, help="largest k the adaptive policy may use")
    p.add_argument(
        "--spec-method",
        choices=SPEC_METHODS,
        default="mtp",
        help="how the speculating cases draft: the MTP layer, n-gram prompt lookup, or the "
        "target drafting for itself",
    )
    p.add_argument(
        "--prompts",
        choices=WORKLOADS,
        default="heldout",
        help="held-out code; held-out code followed by its own first quarter again "
        "(a rewrite request whose answer repeats the prompt); or held-out user messages "
        "through the model's chat template (an instruct model's requests)",
    )
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
    p.add_argument(
        "--constraint",
        type=str,
        default=None,
        metavar="KIND[:SPEC]",
        help="structured output for every request: json_object, json_schema:SCHEMA, "
        "regex:PATTERN or grammar:LARK (SCHEMA and LARK as text or @FILE); requests then "
        "end where the grammar does, up to --max-tokens (use --prompts chat)",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument(
        "--num-requests",
        type=int,
        nargs="+",
        default=None,
        help="requests per case: one count for every batch size, or one per --batch in its "
        "order, so each batch size runs about as long (default: the batch size times --waves)",
    )
    p.add_argument(
        "--waves",
        type=int,
        default=1,
        help="requests per case as a multiple of the batch size (a full batch until the "
        "last wave); not with --num-requests",
    )
    p.add_argument(
        "--min-requests",
        type=int,
        default=1,
        help="at least this many requests per case with --waves (small batches run longer)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrivals at this many requests per second (default: all at once)",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds arrivals and synthetic prompts")
    p.add_argument("--agreement", action="store_true", help="float32 agreement with the reference")
    p.add_argument("--overlap", action="store_true", help="run with enable_overlap=True")
    p.add_argument(
        "--interleave",
        type=float,
        default=None,
        metavar="SECONDS",
        help="run the cases of a batch size side by side, taking turns of SECONDS on the "
        "machine (tokens per second over each case's own turns; no latencies)",
    )
    p.add_argument(
        "--shared-prefix",
        type=int,
        default=None,
        metavar="TOKENS",
        help="the prefix-cache workload (tools/measurement/bench_prefix.py): every prompt is one "
        "TOKENS-token system prompt plus --prompt-tokens of its own, run with the prefix "
        "cache on and off, beside a control of the same prompts with no shared prefix",
    )
    p.add_argument(
        "--multi-turn",
        type=int,
        default=None,
        metavar="TURNS",
        help="with --shared-prefix: also run --batch conversations of TURNS turns, each "
        "resending the conversation so far (tools/measurement/bench_prefix.py)",
    )
    p.add_argument("--json", type=str, default=None, help="write results to this file")
    p.add_argument("--plot", type=str, default=None, help="write a figure (PNG) to this file")
    p.add_argument(
        "--save-trace",
        type=str,
        default=None,
        metavar="PATH",
        help="save each run as a request trace (docs/trace.md); with several runs, "
        "PATH gets .b<batch>.k<k>.lp<logprobs>.r<round> before its suffix",
    )
    p.add_argument(
        "--progress",
        choices=("auto", "on", "off"),
        default="auto",
        help="progress bars (auto: when stderr is a terminal)",
    )
    args = p.parse_args(argv)

    try:
        settings = [None if v == "off" else int(v) for v in args.logprobs]
    except ValueError:
        p.error("--logprobs takes 'off' or integers")
    if any(v is not None and not 0 <= v <= 20 for v in settings):
        p.error("--logprobs values must be 'off' or in 0..20")
    try:
        ks: list[int | str] = [parse_case_k(v) for v in args.k]
    except ValueError:
        p.error("--k takes integers, 'auto', and METHOD:N or METHOD:auto (mtp, ngram)")
    try:
        constraint = parse_constraint(args.constraint)
    except (ValueError, OSError) as exc:
        p.error(f"--constraint: {exc}")
    if any(b < 1 for b in args.batch):
        p.error("--batch sizes must be positive")
    if len(set(args.batch)) != len(args.batch):
        p.error("--batch sizes must differ")
    if args.num_requests is not None:
        if any(n < 1 for n in args.num_requests):
            p.error("--num-requests must be positive")
        if len(args.num_requests) not in (1, len(args.batch)):
            p.error("--num-requests takes one count, or one per --batch")
    if args.waves < 1:
        p.error("--waves must be positive")
    if (args.waves != 1 or args.min_requests != 1) and args.num_requests is not None:
        p.error("--waves and --min-requests do not go with --num-requests: give one")
    if args.min_requests < 1:
        p.error("--min-requests must be positive")
    if args.request_rate is not None and not 0 < args.request_rate < math.inf:
        p.error("--request-rate must be a positive number")
    if args.max_tokens < 1 or args.prompt_tokens < 1 or args.repeat < 1:
        p.error("--max-tokens, --prompt-tokens and --repeat must be positive")
    if args.agreement and is_synthetic(args.model):
        p.error("--agreement needs a reference model; the synthetic device has none")
    if args.agreement and args.dtype != "float32":
        p.error("--agreement compares float32 runs")
    if args.interleave is not None:
        if not 0 < args.interleave < math.inf:
            p.error("--interleave must be a positive number of seconds")
        if args.request_rate is not None or args.save_trace is not None:
            p.error("--interleave runs requests all at once and saves no trace")
    progress = args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())
    if args.num_requests is None:  # requests per case
        counts = {b: max(b * args.waves, args.min_requests) for b in args.batch}
    elif len(args.num_requests) == 1:
        counts = dict.fromkeys(args.batch, args.num_requests[0])
    else:
        counts = dict(zip(args.batch, args.num_requests, strict=True))
    if args.multi_turn is not None and (args.shared_prefix is None or args.multi_turn < 1):
        p.error("--multi-turn takes a positive number of turns, with --shared-prefix")
    if args.shared_prefix is not None:
        if args.shared_prefix < 1 or args.interleave is not None:
            p.error("--shared-prefix takes a positive token count, and not --interleave")
        from spectrio.tools.measurement.bench_prefix import run_shared_prefix

        return run_shared_prefix(args, ks, counts)
    if args.prompts != "heldout" and is_synthetic(args.model):
        p.error(f"--prompts {args.prompts} needs held-out text; the synthetic device has none")
    prompts = bench_prompts(
        max(counts.values()), args.prompt_tokens, args.model, args.seed, args.prompts
    )
    cases = [(b, k, lp) for b in args.batch for k in ks for lp in settings]
    runs: dict[tuple[int, int | str, int | None], list[dict[str, Any]]] = {c: [] for c in cases}
    if args.interleave is not None:
        groups = [(b, lp) for b in args.batch for lp in settings]
        for round_, (b, lp) in tqdm(
            [(r, g) for r in range(args.repeat) for g in groups],
            desc="bench",
            unit="batch",
            disable=not progress,
        ):
            rows_ = trio.run(
                functools.partial(
                    run_interleaved,
                    args.model,
                    args.dtype,
                    ks,
                    b,
                    prompts,
                    args.max_tokens,
                    args.interleave,
                    logprobs=lp,
                    overlap=args.overlap,
                    k_max=args.k_max,
                    num_requests=counts[b],
                    round_=round_,
                    progress=progress,
                    method=args.spec_method,
                    constraint=constraint,
                )
            )
            for row in rows_:
                runs[(b, row["k"], lp)].append(row)
    else:
        # Rounds alternate the cases, so a busy machine slows every case alike.
        single = len(cases) * args.repeat == 1
        for round_, (b, k, lp) in tqdm(
            [(r, c) for r in range(args.repeat) for c in round_order(cases, r)],
            desc="bench",
            unit="case",
            disable=not progress,
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
                    args.request_rate,
                    counts[b],
                    args.seed,
                    progress,
                    trace_path(args.save_trace, b, k, lp, round_, single),
                    args.spec_method,
                    constraint,
                )
            )
    rows = [median_run(runs[c]) for c in cases]
    machine = machine_name()
    requests_label = (
        f"{args.waves} x batch, at least {args.min_requests}"
        if args.num_requests is None
        else ", ".join(f"{counts[b]} at batch {b}" for b in args.batch)
    )
    print(
        f"machine: {machine}; model={args.model} dtype={args.dtype} max_tokens={args.max_tokens} "
        f"overlap={args.overlap} request_rate={args.request_rate or 'all at once'} "
        f"spec_method={args.spec_method} prompts={args.prompts} "
        f"requests={requests_label}"
        + ("" if args.interleave is None else f" interleave={args.interleave}s turns")
        + ("" if constraint is None else f" constraint={constraint.kind}")
    )
    if "auto" in ks:
        warm = [
            f"batch={b}: {sum(bool(r.get('timing_cache_warm')) for r in runs[(b, 'auto', lp)])}"
            f"/{len(runs[(b, 'auto', lp)])}"
            for b in args.batch
            for lp in settings
        ]
        root = timing_cache.cache_root("auto")
        print(f"adaptive runs started from kept step times ({root or 'off'}): " + ", ".join(warm))
    print(summary_table(rows))
    memory: dict[str, object] = {"peak_rss_mib": round(peak_rss_bytes() / 2**20)}
    print(f"memory: peak RSS {memory['peak_rss_mib']} MiB (the whole bench process)")
    if not args.model.startswith("synthetic:"):
        floor = memory_floor(args.model, args.dtype)
        memory.update(msgspec.structs.asdict(floor))
        print(
            f"memory floor: {floor.forward_weight_bytes / 1e6:.1f} MB of weights a forward, "
            f"read at {floor.read_gb_s} GB/s ({floor.read_method}): "
            f"{floor.floor_us_1row} µs for one row"
        )
    gains = speedups(rows)
    if gains:
        print(format_speedups(gains))
    if args.agreement:
        for r in rows:
            r["agreement"] = round(agreement(args.model, prompts, r["outputs"], args.max_tokens), 4)
            print(f"agreement batch={r['batch']} k={r['k']}: {r['agreement']:.2%}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "schema": SCHEMA,
                    "machine": machine,
                    "memory": memory,
                    "args": vars(args),
                    "rows": [json_row(r) for r in rows],
                    "speedups": [g.as_json() for g in gains],
                },
                fh,
                indent=1,
            )
    if args.plot:
        from spectrio.tools.measurement.bench_plot import plot_rows

        plot_rows(rows, args.plot, title=f"{args.model} on {machine}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
