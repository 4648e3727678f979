"""Running one ``spectrio bench`` case and measuring it: the requests on a runtime, their
latencies, the device's time per step, and the row of figures a case gives; one case at
a time (:func:`run_case`) or a batch size's cases taking turns (:func:`run_interleaved`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import trio
import trio.testing
from tqdm import tqdm

from spectrio import Runtime, RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.core.constraints import Constraint
from spectrio.core.timing import StepTiming, device_summary
from spectrio.models import LoadedModel, load
from spectrio.stages.output.output_processor import RequestStats
from spectrio.stages.planning.spec_policy import batch_bucket
from spectrio.tools.measurement.bench_workload import poisson_arrivals, spec_config
from spectrio.tools.measurement.latency import percentiles
from spectrio.tools.measurement.trace_format import TraceWriter, runtime_fields
from spectrio.tools.measurement.trace_record import ResultBuilder
from spectrio.tools.measurement.trace_summary import summarize

BREAKDOWN = ("schedule", "draft", "verify", "sample", "publish", "idle")

FIXED_512_BYTES = 4 * (3 + 512) + 512 * (6 * 21 * 4 * 2 + 6 * 4)
"""FastDeploy's speculative top-k message: meta[3 + 512] plus 512 slots of
int tokens[6*21], float scores[6*21], int ranks[6] (530,444 bytes)."""


def fixed_layout_bytes(batch: int) -> int:
    """The same fixed 6 x 21 per-slot layout sized to ``batch`` slots."""
    return 4 * (3 + batch) + batch * (6 * 21 * 4 * 2 + 6 * 4)


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


def case_config(
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


def bench_params(
    max_tokens: int, logprobs: int | None, constraint: Constraint | None
) -> SamplingParams:
    """Every request's parameters: ``max_tokens`` each (EOS ignored), or with a
    constraint (structured output, which ends where its grammar does) up to that many."""
    if constraint is None:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, constraint=constraint)


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
    constraint: Constraint | None = None,
) -> dict[str, Any]:
    """One case: returns its JSON row, plus ``outputs`` (token ids per request) and
    ``_raw`` (traces and step timings, for plots) that the JSON leaves out. With
    ``trace_path``, the run is also saved as a request trace (``docs/trace.md``)."""
    count = batch if num_requests is None else num_requests
    spec = spec_config(k, k_max, method)
    cfg = case_config(model, dtype, batch, spec, prompts, max_tokens, overlap)
    params = bench_params(max_tokens, logprobs, constraint)
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


class CaseRun:
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
        case = CaseRun(rt, params, prompts, arrivals, writer, progress, batch, k)
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
    constraint: Constraint | None = None,
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
    params = bench_params(max_tokens, logprobs, constraint)
    rows: list[dict[str, Any]] = []
    loaded: LoadedModel | None = None
    async with contextlib.AsyncExitStack() as stack:
        cases: list[CaseRun] = []
        for k in ks:
            cfg = case_config(
                model, dtype, batch, spec_config(k, k_max, method), prompts, max_tokens, overlap
            )
            if loaded is None:
                loaded = await trio.to_thread.run_sync(
                    functools.partial(load, serving=True), cfg.model, cfg.model_dtype
                )
            rt = await stack.enter_async_context(open_runtime(cfg, loaded=loaded))
            case = CaseRun(rt, params, prompts, arrivals, None, progress, batch, k)
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
