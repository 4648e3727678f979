"""Prometheus metrics (issue 13, section 2): the drift alarm's rule, the address policy,
a scrape after a short real run parsed with prometheus_client's own parser, and
``serve --metrics --record`` as a process."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
import trio
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_serve_process import Server

from spectrio import RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.runtime.metrics import (
    DriftDetector,
    ObservedRuntime,
    ServeMetrics,
    parse_metrics_address,
)
from spectrio.tools.measurement.trace_format import read_trace
from spectrio.wire.client import open_client


def feed(d: DriftDetector, rates: list[float], per: int = 100) -> list[list[int]]:
    """Feed ``per`` more proposals at position 1 per rate (the detector reads cumulative
    counters, kept here on the detector's side); returns the changes of each update."""
    p, a = getattr(d, "_test_counts", (0, 0))
    out = []
    for r in rates:
        p += per
        a += round(per * r)
        out.append(d.update([p], [a]))
    d._test_counts = (p, a)  # type: ignore[attr-defined]
    return out


def test_drift_alarm_raises_on_a_drop_and_clears_on_recovery() -> None:
    d = DriftDetector(window=200, warmup=3, alpha=0.5, drop=0.15)
    changes = feed(d, [0.8] * 12)  # 6 windows of 0.8: no alarm
    assert not any(changes) and d.alarm == [False] and d.baseline[0] == pytest.approx(0.8)
    changes = feed(d, [0.7, 0.7])  # 0.10 below: noise, not drift
    assert not any(changes) and d.alarm == [False]
    base = d.baseline[0]
    assert base is not None
    changes = feed(d, [0.1, 0.1])  # a mismatched draft layer
    assert changes[-1] == [0] and d.alarm == [True]
    assert d.recent[0] == pytest.approx(0.1)
    feed(d, [0.1] * 6)  # a lasting drop stays alarmed: the baseline is frozen
    assert d.alarm == [True] and d.baseline[0] == base
    changes = feed(d, [base - 0.05] * 2)  # back within drop / 2
    assert changes[-1] == [0] and d.alarm == [False]


def test_no_alarm_during_warm_up() -> None:
    d = DriftDetector(window=100, warmup=5)
    feed(d, [0.9, 0.1, 0.1, 0.1], per=100)
    assert d.alarm == [False]


@pytest.mark.parametrize(
    ("value", "allow", "want"),
    [
        ("9100", False, ("127.0.0.1", 9100)),
        ("localhost:0", False, ("127.0.0.1", 0)),
        ("[::1]:9100", False, ("::1", 9100)),
        ("0.0.0.0:9100", True, ("0.0.0.0", 9100)),
    ],
)
def test_metrics_address(value: str, allow: bool, want: tuple[str, int]) -> None:
    assert parse_metrics_address(value, allow_public=allow) == want


@pytest.mark.parametrize(
    ("value", "why"),
    [("0.0.0.0:9100", "not loopback"), ("x:1", "IP address"), ("1:99999", "port"), ("a", "PORT")],
)
def test_metrics_address_refused(value: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_metrics_address(value)


def scrape(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Sample name -> labels -> value, through prometheus_client's parser."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


async def test_scrape_after_a_short_run() -> None:
    config = RuntimeConfig(
        max_model_len=128, speculative=SpeculativeConfig(num_speculative_tokens=2, adaptive=False)
    )
    metrics = ServeMetrics()
    with trio.fail_after(300):
        async with open_runtime(config) as rt:
            remove = metrics.attach(rt)
            observed = ObservedRuntime(rt, [metrics])
            tokens = 0

            async def one(i: int) -> None:
                nonlocal tokens
                params = SamplingParams(max_tokens=6 + i, ignore_eos=True)
                async for delta in observed.generate(f"def f{i}(x):", params):
                    tokens += len(delta.token_ids)

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
            with pytest.raises(Exception, match="prompt"):
                async for _ in observed.generate("", SamplingParams()):
                    pass
            await rt.wait_idle()
            metrics.update(rt)
            remove()
    m = scrape(generate_latest(metrics.registry).decode())
    assert tokens == 6 + 7 + 8
    assert m["spectrio_generation_tokens_total"][()] == tokens
    assert m["spectrio_time_to_first_token_seconds_count"][()] == 3
    assert m["spectrio_request_latency_seconds_count"][()] == 3
    assert m["spectrio_inter_token_latency_seconds_count"][()] > 0
    assert m["spectrio_requests_refused_total"][()] == 1
    assert m["spectrio_up"][()] == 1
    assert m["spectrio_healthy"][()] == 1 and m["spectrio_open_requests"][()] == 0
    assert m["spectrio_record_sink_blocked_seconds"][()] == 0
    assert 0 <= m["spectrio_seconds_since_step"][()] < 60
    assert m["spectrio_requests_finished_total"][(("finish_reason", "length"),)] == 3
    assert m["spectrio_requests_running"][()] == 0
    assert m["spectrio_requests_waiting"][()] == 0
    used = m["spectrio_kv_blocks"][(("state", "used"),)]
    free = m["spectrio_kv_blocks"][(("state", "free"),)]
    assert used == 0 and free > 0
    assert m["spectrio_drafts_proposed_total"][(("position", "1"),)] > 0
    # fixed k = 2 drafts 2 a step, fewer only on a request's last steps
    by_k = {labels[0][1]: n for labels, n in m["spectrio_steps_by_k_total"].items()}
    assert by_k["2"] > 0 and set(by_k) <= {"0", "1", "2"}
    assert 1.0 <= m["spectrio_mean_accepted_length"][()] <= 3.0
    assert m["spectrio_acceptance_drift"][(("position", "1"),)] == 0
    assert m["spectrio_step_duration_seconds_count"][()] > 0
    assert m["spectrio_step_phase_seconds_count"][(("phase", "verify"),)] > 0


async def test_serve_with_metrics_and_record(tmp_path: Path) -> None:
    trace = tmp_path / "rec.jsonl"
    server = Server(
        tmp_path,
        "serve",
        "--run-dir",
        str(tmp_path / "run"),
        "--max-model-len",
        "128",
        "--metrics",
        "0",
        "--record",
        str(trace),
    )
    try:
        eps = await trio.to_thread.run_sync(server.wait_endpoints)
        assert eps["metrics"].startswith("http://127.0.0.1:")
        with trio.fail_after(120):
            async with open_client(eps["requests"], eps["outputs"]) as client:
                ids = [
                    await client.submit("def f(x):", SamplingParams(max_tokens=5), request_id="a"),
                    await client.submit([5, 6, 7], SamplingParams(max_tokens=4, seed=3)),
                ]
                got = await client.collect(ids)
            await trio.sleep(1.0)  # one metrics update interval
            text = await trio.to_thread.run_sync(
                lambda: urllib.request.urlopen(eps["metrics"], timeout=10).read().decode()
            )
    finally:
        server.stop()
    m = scrape(text)
    assert m["spectrio_time_to_first_token_seconds_count"][()] == 2
    total = sum(len(c.token_ids) for cs in got.values() for c in cs)
    assert m["spectrio_generation_tokens_total"][()] == total
    t = read_trace(trace)
    assert t.header.source == "serve" and t.header.runtime is not None
    assert {r.request_id for r in t.requests} == set(ids)
    assert t.results["a"].token_ids == [tk for c in got["a"] for tk in c.token_ids]
    assert t.request(ids[1]).prompt_ids == [5, 6, 7] and t.request(ids[1]).params.seed == 3
    assert all(r.ttft_s is not None for r in t.results.values())


def test_prefix_cache_metrics_come_from_the_runtime_stats() -> None:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

    from spectrio.core.messages import RuntimeStats
    from spectrio.runtime.metrics import _stats_metrics

    stats = RuntimeStats(
        running=0, waiting=0, num_kv_blocks=64, free_kv_blocks=64, num_steps=9,
        num_preemptions=0, drafts_proposed=0, drafts_accepted=0, accepted_per_position=[0],
        proposed_per_position=[0], finished={}, prefix_cache_queries=200,
        prefix_cache_hits=150, cached_kv_blocks=12, prefix_cache_evictions=3,
    )  # fmt: skip

    class Fixed:
        def collect(self) -> list[Metric]:
            return list(_stats_metrics(stats, DriftDetector()))

    registry = CollectorRegistry()
    registry.register(Fixed())  # type: ignore[arg-type]
    m = scrape(generate_latest(registry).decode())
    assert m["spectrio_prefix_cache_queries_tokens_total"][()] == 200
    assert m["spectrio_prefix_cache_hits_tokens_total"][()] == 150
    assert m["spectrio_prefix_cache_hit_rate"][()] == 0.75
    assert m["spectrio_prefix_cache_blocks"][()] == 12
    assert m["spectrio_prefix_cache_evictions_total"][()] == 3
