"""Prometheus metrics of a running runtime (``spectrio serve --metrics HOST:PORT``), the
acceptance drift alarm, and :class:`ObservedRuntime`, the seam through which the CLI sees
every request the wire server starts (for metrics and for ``serve --record``).

Where the figures come from:

* counters and gauges (requests by finish reason, running and waiting, KV blocks,
  preemptions, steps, drafts per position) are read from ``rt.stats()``
  (:class:`spectrio.core.messages.RuntimeStats`), and ``spectrio_healthy`` with its
  gauges from ``rt.health()`` (:class:`spectrio.runtime.health.Health`), by
  :meth:`ServeMetrics.update`, which a Trio task calls every ``interval`` seconds; a
  scrape reads that snapshot, so the HTTP thread never touches runtime state;
* step duration and its breakdown come from ``rt.step_timings()``: each update observes
  the steps completed since the last one;
* TTFT and ITL are observed per request through :class:`ObservedRuntime`; tokens
  generated from every published step record.

Metric names, types and labels are listed in ``docs/trace.md`` ("Metrics").
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import structlog
import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from spectrio.core.messages import PublishedStep, RuntimeStats
    from spectrio.core.params import SamplingParams
    from spectrio.runtime.api import Delta, RequestStream, Runtime

log = structlog.get_logger("spectrio.metrics")

__all__ = [
    "DriftDetector",
    "ObservedRuntime",
    "RequestHooks",
    "ServeMetrics",
    "parse_metrics_address",
]

# Latency buckets in seconds: 1 ms .. 60 s, roughly x2 apart.
LATENCY_BUCKETS = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
STEP_PHASES = ("schedule", "draft", "verify", "sample", "publish")


# ---- the acceptance drift alarm (pure) ------------------------------------------------------


class DriftDetector:
    """Per draft position, compares the acceptance rate of the latest window of
    ``window`` proposals with a rolling baseline: the exponential moving average
    (weight ``alpha``) of the windows before it. After ``warmup`` windows, a window more
    than ``drop`` (absolute) below the baseline raises the alarm for that position; the
    alarm clears when a window comes back within ``drop / 2`` of it. The baseline does
    not move while the alarm is raised, so a lasting drop stays visible instead of
    becoming the new normal.

    Defaults: windows of 200 proposals, 5 windows of warm-up, alpha 0.2, drop 0.15. The
    bundled model accepts about 0.80 / 0.68 / 0.58 at positions 1-3, and a window of 200
    has a standard error of about 0.035, so 0.15 is over four standard errors: noise
    does not raise it, and a mismatched draft layer (acceptance near 0) does at once."""

    def __init__(
        self, window: int = 200, warmup: int = 5, alpha: float = 0.2, drop: float = 0.15
    ) -> None:
        self.window, self.warmup, self.alpha, self.drop = window, warmup, alpha, drop
        self._last_p: list[int] = []
        self._last_a: list[int] = []
        self._win_p: list[int] = []
        self._win_a: list[int] = []
        self.windows: list[int] = []  # completed windows per position
        self.baseline: list[float | None] = []
        self.recent: list[float | None] = []
        self.alarm: list[bool] = []

    def _grow(self, n: int) -> None:
        while len(self.alarm) < n:
            for lst in (self._last_p, self._last_a, self._win_p, self._win_a, self.windows):
                lst.append(0)
            self.baseline.append(None)
            self.recent.append(None)
            self.alarm.append(False)

    def update(self, proposed: Sequence[int], accepted: Sequence[int]) -> list[int]:
        """Feed cumulative per-position counters; returns the positions (0-based) whose
        alarm changed state."""
        self._grow(len(proposed))
        changed: list[int] = []
        for i, (p, a) in enumerate(zip(proposed, accepted, strict=False)):
            self._win_p[i] += max(0, p - self._last_p[i])
            self._win_a[i] += max(0, a - self._last_a[i])
            self._last_p[i], self._last_a[i] = p, a
            if self._win_p[i] < self.window:
                continue
            rate = self._win_a[i] / self._win_p[i]
            self._win_p[i] = self._win_a[i] = 0
            self.recent[i] = rate
            self.windows[i] += 1
            base = self.baseline[i]
            was = self.alarm[i]
            if base is not None and self.windows[i] > self.warmup:
                if not was and rate < base - self.drop:
                    self.alarm[i] = True
                elif was and rate >= base - self.drop / 2:
                    self.alarm[i] = False
            if not self.alarm[i]:
                self.baseline[i] = rate if base is None else base + self.alpha * (rate - base)
            if self.alarm[i] != was:
                changed.append(i)
        return changed


# ---- observing the requests a server starts -----------------------------------------------


class RequestHooks(Protocol):
    """Called by :class:`ObservedRuntime` (all on the runtime's Trio thread; must not block).
    ``now`` is ``time.perf_counter()``."""

    def on_start(
        self, request_id: str, prompt: Any, params: SamplingParams | None, now: float
    ) -> None: ...
    def on_delta(self, request_id: str, delta: Delta, now: float) -> None: ...
    def on_refused(self, request_id: str, error: Exception, now: float) -> None: ...


class _ObservedStream:
    """A :class:`RequestStream` that reports its request's start and deltas to hooks."""

    def __init__(
        self,
        stream: RequestStream,
        hooks: Sequence[RequestHooks],
        prompt: Any,
        params: SamplingParams | None,
    ) -> None:
        self._stream = stream
        self._hooks = hooks
        self._prompt = prompt
        self._params = params
        self._started = False

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    @property
    def finished(self) -> bool:
        return self._stream.finished

    def _start(self) -> None:
        if not self._started:
            self._started = True
            now = time.perf_counter()
            for h in self._hooks:
                h.on_start(self._stream.request_id, self._prompt, self._params, now)

    async def __aenter__(self) -> _ObservedStream:
        self._start()
        try:
            await self._stream.__aenter__()
        except Exception as exc:
            self._refused(exc)
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stream.__aexit__(*exc_info)

    def __aiter__(self) -> _ObservedStream:
        return self

    def _refused(self, exc: Exception) -> None:
        now = time.perf_counter()
        for h in self._hooks:
            h.on_refused(self._stream.request_id, exc, now)

    async def __anext__(self) -> Delta:
        self._start()
        try:
            delta = await self._stream.__anext__()
        except StopAsyncIteration:
            raise
        except Exception as exc:
            self._refused(exc)
            raise
        now = time.perf_counter()
        for h in self._hooks:
            h.on_delta(self._stream.request_id, delta, now)
        return delta

    async def wait_finished(self) -> None:
        """:meth:`RequestStream.wait_finished` for a caller that reads the tokens
        elsewhere (the wire server). The hooks read every delta (metrics, a trace), so
        here the stream is read to its end for them."""
        async for _ in self:
            pass

    def close(self, reason: str = "consumer went away") -> None:
        self._stream.close(reason)

    async def aclose(self) -> None:
        await self._stream.aclose()


class ObservedRuntime:
    """A view of a :class:`~spectrio.runtime.api.Runtime` whose ``generate`` reports every
    request to ``hooks``; everything else is the runtime's own. The CLI hands it to the
    wire server (which only calls the public Runtime API), so recording and metrics need
    no hook inside the server."""

    def __init__(self, runtime: Runtime, hooks: Iterable[RequestHooks]) -> None:
        self._rt = runtime
        self.hooks = list(hooks)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rt, name)

    def generate(
        self,
        prompt: Any,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str = "",
    ) -> _ObservedStream:
        try:  # the runtime checks the request here, so a refusal is counted here
            stream = self._rt.generate(prompt, params, request_id=request_id, cache_salt=cache_salt)
        except Exception as exc:
            now = time.perf_counter()
            for h in self.hooks:
                h.on_refused(request_id or "", exc, now)
            raise
        return _ObservedStream(stream, self.hooks, prompt, params)


# ---- the Prometheus side ------------------------------------------------------------------


def _stats_metrics(s: RuntimeStats | None, drift: DriftDetector) -> Iterable[Metric]:
    if s is None:
        return
    g = GaugeMetricFamily
    yield g("spectrio_requests_running", "Requests holding a batch slot", value=s.running)
    yield g("spectrio_requests_waiting", "Requests queued (new, or preempted)", value=s.waiting)
    kv = g("spectrio_kv_blocks", "KV cache blocks by state", labels=["state"])
    kv.add_metric(["used"], s.num_kv_blocks - s.free_kv_blocks)
    kv.add_metric(["free"], s.free_kv_blocks)
    yield kv
    yield g(
        "spectrio_kv_usage_ratio",
        "Share of KV cache blocks in use",
        value=(s.num_kv_blocks - s.free_kv_blocks) / s.num_kv_blocks if s.num_kv_blocks else 0.0,
    )
    fin = CounterMetricFamily(
        "spectrio_requests_finished", "Requests ended, by finish reason", labels=["finish_reason"]
    )
    for reason in sorted(set(s.finished) | {"stop", "length", "abort"}):
        fin.add_metric([reason], s.finished.get(reason, 0))
    yield fin
    yield CounterMetricFamily("spectrio_preemptions", "Requests preempted", value=s.num_preemptions)
    yield CounterMetricFamily(
        "spectrio_prefix_cache_queries_tokens",
        "Context tokens looked up in the prefix cache when requests were (re)admitted",
        value=s.prefix_cache_queries,
    )
    yield CounterMetricFamily(
        "spectrio_prefix_cache_hits_tokens",
        "Looked-up tokens whose KV came from the prefix cache",
        value=s.prefix_cache_hits,
    )
    yield g(
        "spectrio_prefix_cache_hit_rate",
        "Prefix-cache hit tokens over queried tokens since start",
        value=s.prefix_cache_hit_rate,
    )
    yield g(
        "spectrio_prefix_cache_blocks",
        "KV blocks registered in the prefix cache (held by requests or evictable)",
        value=s.cached_kv_blocks,
    )
    yield CounterMetricFamily(
        "spectrio_prefix_cache_evictions",
        "Cached KV blocks evicted to make room",
        value=s.prefix_cache_evictions,
    )
    yield CounterMetricFamily("spectrio_steps", "Pipeline steps published", value=s.num_steps)
    by_k = CounterMetricFamily(
        "spectrio_steps_by_k",
        "Planned steps with decoding sequences, by drafts per sequence (the adaptive k)",
        labels=["k"],
    )
    for k, n in sorted(s.steps_by_k.items()):
        by_k.add_metric([str(k)], n)
    yield by_k
    prop = CounterMetricFamily(
        "spectrio_drafts_proposed", "Draft tokens proposed, by draft position", labels=["position"]
    )
    acc = CounterMetricFamily(
        "spectrio_drafts_accepted", "Draft tokens accepted, by draft position", labels=["position"]
    )
    rate = g(
        "spectrio_acceptance_rate",
        "Accepted over proposed drafts at each position since start",
        labels=["position"],
    )
    for i, (p, a) in enumerate(
        zip(s.proposed_per_position, s.accepted_per_position, strict=False), 1
    ):
        prop.add_metric([str(i)], p)
        acc.add_metric([str(i)], a)
        rate.add_metric([str(i)], a / p if p else 0.0)
    yield prop
    yield acc
    yield rate
    first = s.proposed_per_position[0] if s.proposed_per_position else 0
    yield g(
        "spectrio_mean_accepted_length",
        "Tokens emitted per speculating verify step (1 + accepted drafts per step)",
        value=1.0 + s.drafts_accepted / first if first else 0.0,
    )
    alarm = g(
        "spectrio_acceptance_drift",
        "1 when acceptance at a position fell well below its rolling baseline",
        labels=["position"],
    )
    base = g("spectrio_acceptance_baseline", "Rolling acceptance baseline", labels=["position"])
    recent = g("spectrio_acceptance_recent", "Acceptance of the last window", labels=["position"])
    for i, on in enumerate(drift.alarm):
        alarm.add_metric([str(i + 1)], float(on))
        b, r = drift.baseline[i], drift.recent[i]
        base.add_metric([str(i + 1)], b if b is not None else math.nan)
        recent.add_metric([str(i + 1)], r if r is not None else math.nan)
    yield alarm
    yield base
    yield recent


class _SnapshotCollector(Collector):
    def __init__(self, owner: ServeMetrics) -> None:
        self._owner = owner

    def collect(self) -> Iterable[Metric]:
        return list(_stats_metrics(self._owner.stats, self._owner.drift))


class ServeMetrics:
    """Every metric of one runtime, in its own registry (``self.registry``). Use
    :meth:`attach` once, run :meth:`run` in a Trio task, and pass ``self`` as a request
    hook to :class:`ObservedRuntime`."""

    def __init__(self, *, interval: float = 0.5, drift: DriftDetector | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.interval = interval
        self.drift = drift or DriftDetector()
        self.stats: RuntimeStats | None = None
        r = self.registry
        self.ttft = Histogram(
            "spectrio_time_to_first_token_seconds",
            "Submission to the first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "spectrio_inter_token_latency_seconds",
            "Gap between consecutive outputs of a request (one step's tokens arrive together)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "spectrio_request_latency_seconds",
            "Submission to the final output",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.step = Histogram(
            "spectrio_step_duration_seconds",
            "Device time of a pipeline step (draft + verify + sample)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.phase = Histogram(
            "spectrio_step_phase_seconds",
            "Time of a step's phases (schedule, draft, verify, sample, publish)",
            ["phase"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "spectrio_generation_tokens", "Output tokens generated (every request)", registry=r
        )
        self.prompt_tokens = Counter(
            "spectrio_prompt_tokens", "Prompt tokens of started requests", registry=r
        )
        self.refused = Counter(
            "spectrio_requests_refused", "Requests the runtime refused", registry=r
        )
        self.drift_alarms = Counter(
            "spectrio_acceptance_drift_alarms", "Times a drift alarm was raised", registry=r
        )
        self.up = Gauge("spectrio_up", "1 while the runtime serves", registry=r)
        self.healthy = Gauge(
            "spectrio_healthy",
            "1 while the runtime's requests can progress (rt.health().ok; /health 200)",
            registry=r,
        )
        self.since_step = Gauge(
            "spectrio_seconds_since_step",
            "Seconds since the last pipeline step completed (NaN before the first)",
            registry=r,
        )
        self.open_requests = Gauge(
            "spectrio_open_requests",
            "Requests accepted and not yet ended, every front (HTTP, wire, embedding)",
            registry=r,
        )
        self.sink_blocked = Gauge(
            "spectrio_record_sink_blocked_seconds",
            "Seconds the publisher has been awaiting its current record sink (0: none)",
            registry=r,
        )
        r.register(_SnapshotCollector(self))
        self._seen_steps = 0
        self._last: dict[str, float] = {}  # request id -> time of its last output
        self._start: dict[str, float] = {}

    # ---- sources ------------------------------------------------------------------------

    def attach(self, rt: Runtime) -> Callable[[], None]:
        """Count every published token (a record observer); returns the remover."""
        self.up.set(1)
        self._seen_steps = len(rt.step_timings())
        return rt.add_record_observer(self.on_record)

    def on_record(self, pub: PublishedStep) -> None:
        # header word 3 is the record's emitted-token count (spectrio.core.record)
        self.tokens.inc(int.from_bytes(pub.record[12:16], "little", signed=True))

    def update(self, rt: Runtime) -> None:
        """Take a stats snapshot and the runtime's health (``spectrio_healthy`` and its
        gauges), and observe the steps completed since the last update."""
        s = rt.stats()
        self.stats = s
        health = rt.health()
        self.healthy.set(1 if health.ok else 0)
        since = health.seconds_since_step
        self.since_step.set(math.nan if since is None else since)
        self.open_requests.set(health.open_requests)
        self.sink_blocked.set(health.blocked_s or 0.0)
        for i in self.drift.update(s.proposed_per_position, s.accepted_per_position):
            if self.drift.alarm[i]:
                self.drift_alarms.inc()
                log.warning(
                    "acceptance drift: draft position far below its baseline",
                    position=i + 1,
                    recent=round(self.drift.recent[i] or 0.0, 3),
                    baseline=round(self.drift.baseline[i] or 0.0, 3),
                )
            else:
                log.info("acceptance drift cleared", position=i + 1)
        timings = rt.step_timings()
        for t in timings[self._seen_steps :]:
            self.step.observe(t.device)
            for phase in STEP_PHASES:
                self.phase.labels(phase).observe(max(0.0, getattr(t, phase)))
        self._seen_steps = len(timings)

    async def run(self, rt: Runtime) -> None:
        """Update every ``interval`` seconds until cancelled (then marks the runtime down)."""
        try:
            while True:
                self.update(rt)
                await trio.sleep(self.interval)
        finally:
            self.up.set(0)
            self.healthy.set(0)

    # ---- request hooks ------------------------------------------------------------------

    def on_start(
        self, request_id: str, prompt: Any, params: SamplingParams | None, now: float
    ) -> None:
        self._start[request_id] = now
        if isinstance(prompt, list):
            self.prompt_tokens.inc(len(prompt))

    def on_delta(self, request_id: str, delta: Delta, now: float) -> None:
        start = self._start.get(request_id)
        if start is None:
            return
        if delta.token_ids:
            last = self._last.get(request_id)
            if last is None:
                self.ttft.observe(now - start)
            else:
                self.itl.observe(now - last)
            self._last[request_id] = now
        if delta.finished:
            self.e2e.observe(now - start)
            self._start.pop(request_id, None)
            self._last.pop(request_id, None)

    def on_refused(self, request_id: str, error: Exception, now: float) -> None:
        self.refused.inc()
        self._start.pop(request_id, None)
        self._last.pop(request_id, None)

    # ---- HTTP -----------------------------------------------------------------------------

    def serve_http(self, host: str, port: int) -> tuple[Any, str]:
        """Serve ``/metrics`` from a daemon thread; returns the server (``.shutdown()``
        stops it) and its URL."""
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        bound = server.server_port
        shown = f"[{host}]" if ":" in host else host
        return server, f"http://{shown}:{bound}/metrics"


def parse_metrics_address(
    value: str, *, allow_public: bool = False, flag: str = "--metrics"
) -> tuple[str, int]:
    """``PORT``, ``HOST:PORT`` or ``[V6]:PORT`` -> (host, port); host defaults to
    127.0.0.1. A host other than a loopback address needs ``allow_public`` (the same
    policy as the wire endpoints). Raises ValueError with the rule, naming ``flag``
    (``--http`` parses its address with it too)."""
    host, sep, port_s = value.rpartition(":")
    if not sep:
        host, port_s = "127.0.0.1", value
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"{flag}: expected [HOST:]PORT, got {value!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{flag}: port must be in [0, 65535], got {port}")
    if host == "localhost":
        host = "127.0.0.1"
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        raise ValueError(f"{flag}: host must be an IP address, got {host!r}") from None
    if not loopback and not allow_public:
        raise ValueError(
            f"{flag}: {host} is not loopback; pass --allow-public to serve beyond this machine"
        )
    return host, port
