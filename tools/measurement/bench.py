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
token ids for ``--model synthetic:...`` (the synthetic device, :mod:`spectrio.models.synthetic`,
which measures the runtime alone: ``--model synthetic:step_ms=10,per_row_us=20``).

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
of its forward, probed after the runs (:mod:`spectrio.models.memory_floor`):
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
  standard error, null with one sample; :func:`spectrio.tools.bench_speedup.pooled_rate`);
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
:class:`spectrio.tools.bench_speedup.Speedup` as a map: ``best_k``, ``best_over_none``
and ``auto_over_better`` (ratios of medians; null without an ``auto`` case), each also
``..._rounds`` (round by round), ``..._paired`` (the median of the rounds' ratios),
``..._pooled`` (the ratio of pooled rates) and ``..._se`` (its standard error), and
``better`` (``best_k``, or 0 where no speculation was faster). The text output prints
them under the table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import platform
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import trio
import trio.testing
from tqdm import tqdm

from spectrio import Runtime, RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.core.config import SPEC_METHODS
from spectrio.core.timing import StepTiming, device_summary
from spectrio.models import LoadedModel, load, reference
from spectrio.models.chat import build_chat_template
from spectrio.models.loader import load_text_side, load_tokenizer
from spectrio.models.synthetic import is_synthetic, parse_spec
from spectrio.process_memory import peak_rss_bytes
from spectrio.runtime import timing_cache
from spectrio.stages.output_processor import RequestStats
from spectrio.stages.spec_policy import batch_bucket
from spectrio.tools.bench_speedup import Z_95, format_speedups, pooled_rate, speedups
from spectrio.tools.chat_prompts import heldout_chat_prompts
from spectrio.tools.corpus import corpus_files, read_texts
from spectrio.tools.latency import percentiles
from spectrio.tools.trace import ResultBuilder, TraceWriter, runtime_fields, summarize

SCHEMA = 2
"""Version of the ``--json`` layout; bumped when a key changes meaning or goes away."""

BREAKDOWN = ("schedule", "draft", "verify", "sample", "publish", "idle")

FIXED_512_BYTES = 4 * (3 + 512) + 512 * (6 * 21 * 4 * 2 + 6 * 4)
"""FastDeploy's speculative top-k message: meta[3 + 512] plus 512 slots of
int tokens[6*21], float scores[6*21], int ranks[6] (530,444 bytes)."""


def fixed_layout_bytes(batch: int) -> int:
    """The same fixed 6 x 21 per-slot layout sized to ``batch`` slots."""
    return 4 * (3 + batch) + batch * (6 * 21 * 4 * 2 + 6 * 4)


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
    (:func:`spectrio.tools.chat_prompts.heldout_chat_prompts`, no topic or phrasing of
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


@dataclasses.dataclass
class RequestTrace:
    """When one request arrived and when each of its token-carrying deltas came."""

    arrival: float
    delta_times: list[float] = dataclasses.field(default_factory=list)
    num_tokens: int = 0

    def add(self, now: float, num_tokens: int) -> None:
        if num_tokens:
            self.delta_times.append(now)
            self.num_tokens += num_tokens

    @property
    def ttft(self) -> float | None:
        return self.delta_times[0] - self.arrival if self.delta_times else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.delta_times, self.delta_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        if self.num_tokens < 2:
            return None
        return (self.delta_times[-1] - self.delta_times[0]) / (self.num_tokens - 1)


def latency_summary(traces: Sequence[RequestTrace]) -> dict[str, dict[str, float | None]]:
    """``ttft_ms``, ``itl_ms`` and ``tpot_ms`` percentiles over the requests."""
    ttft = [t.ttft * 1e3 for t in traces if t.ttft is not None]
    itl = [g * 1e3 for t in traces for g in t.itls]
    tpot = [t.tpot * 1e3 for t in traces if t.tpot is not None]
    return {"ttft_ms": percentiles(ttft), "itl_ms": percentiles(itl), "tpot_ms": percentiles(tpot)}


def timing_summary(
    timings: Sequence[StepTiming], wall: float, pauses: Sequence[tuple[float, float]] = ()
) -> dict[str, Any]:
    """The device keys of a row (``efficiency``, ``bubble``, ``model_share``,
    ``overhead_share``, ``breakdown_ms``) from the measured steps' timings; every value
    None when there are none. ``pauses``: spans the runtime was paused (not idle)."""
    summary = device_summary(list(timings), wall, pauses)
    if not summary:
        return {
            "efficiency": None,
            "bubble": None,
            "model_share": None,
            "overhead_share": None,
            "breakdown_ms": dict.fromkeys(BREAKDOWN),
        }
    return {
        "efficiency": round(summary["efficiency"], 4),
        "bubble": round(summary["bubble"], 4),
        "model_share": round(summary["model_share"], 4),
        "overhead_share": round(1.0 - summary["model_share"], 4),
        "breakdown_ms": {name: round(summary[f"{name}_ms"], 4) for name in BREAKDOWN},
    }


def _case_config(
    model: str,
    dtype: str,
    batch: int,
    spec: SpeculativeConfig,
    prompts: list[list[int]],
    max_tokens: int,
    overlap: bool,
    prefix_caching: bool = True,
) -> RuntimeConfig:
    """The runtime of one case: ``batch`` running requests at most, each as long as the
    longest prompt plus ``max_tokens``, and KV for exactly that (the default sizing): the
    interleaved cases are open at once, each with its own KV cache."""
    return RuntimeConfig(
        model=model,
        dtype=dtype,
        speculative=spec,
        max_num_seqs=max(batch, 1),
        max_num_batched_tokens=max(2048, batch * spec.tokens_per_seq),
        max_model_len=len(max(prompts, key=len)) + max_tokens + 1,
        enable_overlap=overlap,
        enable_prefix_caching=prefix_caching,
    )


def _case_keys(
    batch: int,
    k: int | str,
    logprobs: int | None,
    dtype: str,
    overlap: bool,
    request_rate: float | None,
    interleave: float | None,
) -> dict[str, Any]:
    """The keys of a row that name its case (the JSON's "case" keys)."""
    return {
        "batch": batch,
        "k": k,
        "logprobs": "off" if logprobs is None else logprobs,
        "dtype": dtype,
        "overlap": overlap,
        "request_rate": request_rate,
        "interleave": interleave,
    }


async def run_case(
    model: str,
    dtype: str,
    k: int | str,
    batch: int,
    prompts: list[list[int]],
    max_tokens: int,
    logprobs: int | None = None,
    overlap: bool = False,
    k_max: int = 4,
    request_rate: float | None = None,
    num_requests: int | None = None,
    seed: int = 0,
    progress: bool = False,
    trace_path: str | None = None,
    method: str = "mtp",
) -> dict[str, Any]:
    """One case: returns its JSON row, plus ``outputs`` (token ids per request) and
    ``_raw`` (traces and step timings, for plots) that the JSON leaves out. With
    ``trace_path``, the run is also saved as a request trace (``docs/trace.md``)."""
    count = batch if num_requests is None else num_requests
    spec = spec_config(k, k_max, method)
    cfg = _case_config(model, dtype, batch, spec, prompts, max_tokens, overlap)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    arrivals = poisson_arrivals(count, request_rate, seed)
    with contextlib.ExitStack() as stack:
        writer = (
            None
            if trace_path is None
            else stack.enter_context(
                TraceWriter(trace_path, source="bench", model=model, runtime=runtime_fields(cfg))
            )
        )
        measured = await _measure(cfg, params, prompts, arrivals, writer, progress, batch, k)
    return {**_case_keys(batch, k, logprobs, dtype, overlap, request_rate, None), **measured}


class _CaseRun:
    """One case's requests on its runtime, and what they produced: the measured keys of
    its row (:meth:`row`). Shared by the plain run (:func:`_measure`) and the
    interleaved one (:func:`run_interleaved`)."""

    def __init__(
        self,
        rt: Runtime,
        params: SamplingParams,
        prompts: list[list[int]],
        arrivals: list[float],
        writer: TraceWriter | None,
        progress: bool,
        batch: int,
        k: int | str,
    ) -> None:
        self.rt, self.params, self.prompts, self.arrivals = rt, params, prompts, arrivals
        self.writer, self.batch = writer, batch
        count = len(arrivals)
        self.record_bytes: list[int] = []
        self.bar = tqdm(
            total=count * (params.max_tokens or 0),
            desc=f"batch={batch} k={k}",
            unit="tok",
            leave=False,
            disable=not progress,
        )
        self.builders = [ResultBuilder(f"r{i}", start=0.0) for i in range(count)]
        self.stats = [RequestStats() for _ in range(count)]
        self.outputs: list[list[int]] = [[] for _ in range(count)]
        self.traces: list[RequestTrace] = []
        self.unfinished = count
        self.tokens = 0  # output tokens received so far
        self.done = trio.Event()
        self.steps0 = 0
        self.steps_by_k0: dict[int, int] = {}
        self.last_warm_step = -1
        self.t0 = 0.0  # the start of the measured window

    async def warm_up(self) -> None:
        """One short request, so the first measured step does not pay one-time costs."""
        rt = self.rt
        async for _ in rt.generate(self.prompts[0][:8], SamplingParams(max_tokens=4)):
            pass
        await rt.wait_idle()

    def start(self) -> float:
        """Mark the start of the measured window; returns its time."""
        rt = self.rt
        self.steps0 = rt.num_steps
        self.steps_by_k0 = dict(rt.stats().steps_by_k)
        before = rt.step_timings()
        self.last_warm_step = before[-1].step if before else -1  # the window: later steps
        rt.add_record_observer(lambda pub: self.record_bytes.append(len(pub.record)))
        self.t0 = t0 = time.perf_counter()
        self.traces = [RequestTrace(arrival=t0 + a) for a in self.arrivals]
        for i, (b, a) in enumerate(zip(self.builders, self.arrivals, strict=True)):
            b.start = t0 + a
            if self.writer is not None:  # the planned arrivals, in order
                self.writer.add_request(b.request_id, self._prompt(i), self.params, arrival_s=a)
        if not self.arrivals:
            self.done.set()
        return t0

    def _prompt(self, i: int) -> list[int]:
        return self.prompts[i % len(self.prompts)]

    async def request(self, i: int) -> None:
        """Run request ``i`` from its arrival to its last delta."""
        trace, builder = self.traces[i], self.builders[i]
        await trio.sleep(max(0.0, trace.arrival - time.perf_counter()))
        async for delta in self.rt.generate(
            self._prompt(i), self.params, request_id=builder.request_id
        ):
            now = time.perf_counter()
            trace.add(now, len(delta.token_ids))
            builder.add(delta, now)
            self.stats[i].add(delta)
            self.outputs[i] += delta.token_ids
            self.tokens += len(delta.token_ids)
            self.bar.update(len(delta.token_ids))
        if self.writer is not None:
            self.writer.add_result(builder.result())
        self.unfinished -= 1
        if self.unfinished == 0:
            self.done.set()

    async def row(self, wall: float, pauses: Sequence[tuple[float, float]] = ()) -> dict[str, Any]:
        """The measured keys of the case's row, ``wall`` seconds after :meth:`start`
        (``pauses``: the spans it was paused, interleaved; then it has no latencies)."""
        rt = self.rt
        steps = rt.num_steps - self.steps0
        await rt.wait_idle()
        timings = [t for t in rt.step_timings() if t.step > self.last_warm_step]
        self.bar.close()
        count = len(self.arrivals)
        if self.writer is not None:
            self.writer.add_summary(wall, summarize([b.result() for b in self.builders], wall))
        total = RequestStats()
        for s in self.stats:
            total.merge(s)
        tokens = total.num_tokens
        latency = latency_summary([] if pauses else self.traces)
        return {
            "requests": count,
            "max_tokens": self.params.max_tokens,
            "tokens": tokens,
            "seconds": round(wall, 4),
            "tokens_per_second": round(tokens / wall, 1),
            "requests_per_second": round(count / wall, 3),
            **latency,
            "mean_accept_len": round(total.mean_accept_len, 3),
            "mean_accepted": round(total.mean_accepted, 3),
            "acceptance_per_position": [round(x, 4) for x in total.conditional_acceptance],
            "accepted_per_position": [round(x, 4) for x in total.accepted_per_position],
            "drafts_proposed": sum(total.proposed),
            "drafts_accepted": sum(total.accepted),
            "pipeline_steps": steps,
            "timing_cache_warm": batch_bucket(self.batch) in rt.timing_cache_buckets,
            "steps_by_k": {
                str(k): n - self.steps_by_k0.get(k, 0)
                for k, n in rt.stats().steps_by_k.items()
                if n > self.steps_by_k0.get(k, 0)
            },
            **timing_summary(timings, wall, pauses),
            "record_bytes_per_step": round(
                sum(self.record_bytes) / max(1, len(self.record_bytes)), 1
            ),
            "fixed_bytes_same_batch": fixed_layout_bytes(self.batch),
            "fixed_bytes_512": FIXED_512_BYTES,
            "outputs": self.outputs,
            "_raw": {
                "traces": [] if pauses else self.traces,
                "timings": timings,
                "t0": self.t0,
            },
        }


async def _measure(
    cfg: RuntimeConfig,
    params: SamplingParams,
    prompts: list[list[int]],
    arrivals: list[float],
    writer: TraceWriter | None,
    progress: bool,
    batch: int,
    k: int | str,
) -> dict[str, Any]:
    """Run one case's requests on a fresh runtime; the row's measured keys (run_case)."""
    async with open_runtime(cfg) as rt:
        case = _CaseRun(rt, params, prompts, arrivals, writer, progress, batch, k)
        await case.warm_up()
        t0 = case.start()
        async with trio.open_nursery() as nursery:
            for i in range(len(arrivals)):
                nursery.start_soon(case.request, i)
        wall = time.perf_counter() - t0
        return {**await case.row(wall), "samples": [[case.tokens, round(wall, 6)]]}


async def run_interleaved(
    model: str,
    dtype: str,
    ks: Sequence[int | str],
    batch: int,
    prompts: list[list[int]],
    max_tokens: int,
    slice_seconds: float,
    logprobs: int | None = None,
    overlap: bool = False,
    k_max: int = 4,
    num_requests: int | None = None,
    round_: int = 0,
    progress: bool = False,
    method: str = "mtp",
) -> list[dict[str, Any]]:
    """The cases ``ks`` of one batch size side by side: every case's runtime is open at
    once, with all its requests queued, and the cases take turns of ``slice_seconds`` on
    the machine (:meth:`Runtime.pause` / :meth:`Runtime.resume`; only one steps at a
    time), in an order rotated by one each turn and by ``round_``. A case's tokens per
    second count its own turns only. The machine's speed drifts by 25% over stretches of
    seconds to minutes, more than the differences being measured; run one after
    another, each case meets a different stretch, taking turns every case meets all of
    them. Latencies include the pauses, so the rows have none. Each row's ``samples`` are
    its turns' ``[tokens, seconds]``. Returns one row per k.

    The cases run on one copy of the weights (``open_runtime``'s ``loaded``), so that
    they differ in k alone: each runtime on its own copy, four identical ones at batch 64
    (fixed k = 3, 192 requests, 1-second turns) differed by 2.0% (rms over 4 rounds of
    their standard deviation; 1.4% in one round of 768 requests: a longer run does not
    shrink it), on one shared copy by 0.9%. Each runtime keeps its offset for its whole
    life, a noise that more rounds average away and longer ones do not."""
    count = batch if num_requests is None else num_requests
    arrivals = [0.0] * count
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    rows: list[dict[str, Any]] = []
    loaded: LoadedModel | None = None
    async with contextlib.AsyncExitStack() as stack:
        cases: list[_CaseRun] = []
        for k in ks:
            cfg = _case_config(
                model, dtype, batch, spec_config(k, k_max, method), prompts, max_tokens, overlap
            )
            if loaded is None:
                loaded = await trio.to_thread.run_sync(
                    functools.partial(load, serving=True), cfg.model, cfg.model_dtype
                )
            rt = await stack.enter_async_context(open_runtime(cfg, loaded=loaded))
            case = _CaseRun(rt, params, prompts, arrivals, None, progress, batch, k)
            await case.warm_up()
            await rt.pause()
            cases.append(case)
        active = [0.0] * len(cases)
        pauses: list[list[tuple[float, float]]] = [[] for _ in cases]
        turns: list[list[list[float]]] = [[] for _ in cases]
        async with trio.open_nursery() as nursery:
            starts = [case.start() for case in cases]
            for case in cases:
                for i in range(count):
                    nursery.start_soon(case.request, i)
            await trio.testing.wait_all_tasks_blocked()  # every request is queued
            last_end = list(starts)
            turn = round_
            running = list(range(len(cases)))
            while running:
                shift = turn % len(running)
                for c in running[shift:] + running[:shift]:
                    case = cases[c]
                    tokens0 = case.tokens
                    t0 = time.perf_counter()
                    pauses[c].append((last_end[c], t0))
                    case.rt.resume()
                    with trio.move_on_after(slice_seconds):
                        await case.done.wait()
                    await case.rt.pause()
                    last_end[c] = time.perf_counter()
                    active[c] += last_end[c] - t0
                    # The turn's last deltas reach their streams' readers now, off its clock.
                    await trio.testing.wait_all_tasks_blocked()
                    turns[c].append([case.tokens - tokens0, round(last_end[c] - t0, 6)])
                running = [c for c in running if not cases[c].done.is_set()]
                turn += 1
        for c, case in enumerate(cases):
            case.rt.resume()
            rows.append({**await case.row(active[c], pauses[c]), "samples": turns[c]})
    return [
        {**_case_keys(batch, k, logprobs, dtype, overlap, None, slice_seconds), **row}
        for k, row in zip(ks, rows, strict=True)
    ]


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median tokens per second, with every run's figure and every
    run's samples attached, and the samples' pooled rate and its standard error."""
    ordered = sorted(runs, key=lambda r: float(r["tokens_per_second"]))
    row = dict(ordered[len(ordered) // 2])
    row["tokens_per_second_runs"] = [r["tokens_per_second"] for r in runs]
    row["samples"] = [s for r in runs for s in r["samples"]]
    rate, se = pooled_rate(row["samples"])
    row["tokens_per_second_pooled"] = round(rate, 1)
    row["tokens_per_second_se"] = None if se is None else round(se, 2)
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


def json_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row as ``--json`` writes it (no outputs, no raw traces)."""
    return {k: v for k, v in row.items() if k not in ("outputs", "_raw")}


def _fmt(value: object, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec)


def summary_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as an aligned text table, one line per case."""
    cols: list[tuple[str, int, Any]] = [
        ("batch", 5, lambda r: r["batch"]),
        ("k", 4, lambda r: "off" if r["k"] == 0 else r["k"]),
        ("lp", 4, lambda r: r["logprobs"]),
        ("tok/s", 9, lambda r: r["tokens_per_second"]),
        ("req/s", 8, lambda r: _fmt(r["requests_per_second"], ".2f")),
        ("ttft50", 8, lambda r: _fmt(r["ttft_ms"]["p50"], ".1f")),
        ("ttft99", 8, lambda r: _fmt(r["ttft_ms"]["p99"], ".1f")),
        ("itl50", 7, lambda r: _fmt(r["itl_ms"]["p50"], ".2f")),
        ("itl99", 7, lambda r: _fmt(r["itl_ms"]["p99"], ".2f")),
        ("acc_len", 7, lambda r: r["mean_accept_len"]),
        ("eff", 6, lambda r: _fmt(r["efficiency"], ".1%")),
        ("bubble", 6, lambda r: _fmt(r["bubble"], ".1%")),
        ("ovh", 6, lambda r: _fmt(r["overhead_share"], ".1%")),
        *[
            (f"{name[:5]}ms", 8, lambda r, n=name: _fmt(r["breakdown_ms"][n], ".3f"))
            for name in BREAKDOWN
        ],
        ("steps", 6, lambda r: r["pipeline_steps"]),
        ("rec B", 8, lambda r: r["record_bytes_per_step"]),
    ]
    lines = [" ".join(f"{name:>{w}}" for name, w, _ in cols)]
    for r in rows:
        lines.append(" ".join(f"{str(get(r)):>{w}}" for _, w, get in cols))
    accept = [
        f"batch={r['batch']} k={r['k']}: "
        + " ".join(f"{x:.3f}" for x in r["acceptance_per_position"])
        for r in rows
        if r["acceptance_per_position"]
    ]
    pooled = [
        f"batch={r['batch']} k={r['k']}: {r['tokens_per_second_pooled']:.1f}"
        f" ± {Z_95 * se:.1f} ({len(r['samples'])} samples)"
        for r in rows
        if (se := r.get("tokens_per_second_se")) is not None
    ]
    if pooled:
        lines.append("tokens/s pooled over every turn or run, ± its 95% interval:")
        lines += ["  " + p for p in pooled]
    if accept:
        lines.append("acceptance per draft position (conditional):")
        lines += ["  " + a for a in accept]
    chosen = [
        f"batch={r['batch']}: "
        + " ".join(f"k={k} {n / total:.0%}" for k, n in r["steps_by_k"].items())
        + (" (started from kept step times)" if r.get("timing_cache_warm") else " (cold)")
        for r in rows
        if r["k"] == "auto" and (total := sum(r["steps_by_k"].values()))
    ]
    if chosen:
        lines.append("adaptive k, share of decoding steps:")
        lines += ["  " + c for c in chosen]
    return "\n".join(lines)


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


class _Floor(msgspec.Struct, frozen=True):
    """The bench's ``memory`` keys of the floor (module docstring)."""

    read_gb_s: float
    read_method: str
    forward_weight_bytes: int
    floor_us_1row: float


def _block_bytes(model: str, dtype: str) -> int | None:
    """The weight bytes a forward reads when the runtime serves ``model`` (a GGUF file)
    from its quantized blocks; None when it serves float weights."""
    from spectrio.models.loader import blocks_enabled, resolve_path

    if dtype != "float32" or not blocks_enabled() or model.startswith("synthetic"):
        return None
    path = resolve_path(model)
    if not path.is_file():
        return None
    from spectrio.models.block_serving import served_weight_bytes
    from spectrio.models.gguf_file import GGUFFile

    gguf = GGUFFile(path)
    return served_weight_bytes(gguf, gguf.config)


def _memory_floor(model: str, dtype: str) -> _Floor:
    """The memory floor of ``model``'s forward, its bandwidth probed now."""
    from spectrio.core.config import RuntimeConfig
    from spectrio.models.loader import model_config
    from spectrio.models.memory_floor import floor_us, forward_bytes, read_bandwidth

    cfg = model_config(model)
    width = np.dtype(dtype).itemsize
    weights = forward_bytes(
        cfg, [], weight_bytes=width, kv_bytes=width, weights_total=_block_bytes(model, dtype)
    )
    probe = read_bandwidth(threads=RuntimeConfig().resolve_num_threads())
    return _Floor(
        read_gb_s=probe.best_gb_s,
        read_method=probe.method,
        forward_weight_bytes=weights,
        floor_us_1row=round(floor_us(weights, probe), 1),
    )


def _machine() -> str:
    cores = os.cpu_count()
    return f"{platform.machine()} {platform.processor() or ''} cores={cores}".strip()


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
        help="the prefix-cache workload (tools/bench_prefix.py): every prompt is one "
        "TOKENS-token system prompt plus --prompt-tokens of its own, run with the prefix "
        "cache on and off, beside a control of the same prompts with no shared prefix",
    )
    p.add_argument(
        "--multi-turn",
        type=int,
        default=None,
        metavar="TURNS",
        help="with --shared-prefix: also run --batch conversations of TURNS turns, each "
        "resending the conversation so far (tools/bench_prefix.py)",
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
        from spectrio.tools.bench_prefix import run_shared_prefix

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
                )
            )
    rows = [_median_run(runs[c]) for c in cases]
    machine = _machine()
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
        floor = _memory_floor(args.model, args.dtype)
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
        from spectrio.tools.bench_plot import plot_rows

        plot_rows(rows, args.plot, title=f"{args.model} on {machine}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
