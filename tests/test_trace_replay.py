"""Record -> replay -> diff on the real pipeline (issue 13, "Determinism").

The committed trace (``tests/data/trace_small.jsonl``: greedy and seeded requests, one
ended by a stop string) replays in float64, in-process and against a ``spectrio serve``
process, to exactly its committed expected output, twice. When the bundled model
changes, ``python tests/regen_trace.py`` regenerates both files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import trio
from test_serve_process import Server

from spectrio.runtime.api import open_runtime
from spectrio.tools.measurement.diff import diff_traces
from spectrio.tools.measurement.replay import replay_runtime, replay_wire, submit_times
from spectrio.tools.measurement.trace_command import load_tokenizer
from spectrio.tools.measurement.trace_format import (
    Trace,
    config_from_fields,
    read_trace,
    runtime_fields,
)

DATA = Path(__file__).resolve().parent / "data"
EXPECTED = DATA / "trace_small_expected.jsonl"


def run_of(results: list[object], base: Trace) -> Trace:
    return Trace(base.header, base.requests, {r.request_id: r for r in results})  # type: ignore[attr-defined]


def expected() -> Trace:
    t = read_trace(EXPECTED)
    assert t.header.runtime is not None and len(t.results) == len(t.requests) == 5
    return t


async def test_in_process_replay_matches_the_committed_output_twice() -> None:
    want = expected()
    config = config_from_fields(want.header.runtime or {})
    with trio.fail_after(300):
        async with open_runtime(config) as rt:
            runs = [await replay_runtime(rt, want.requests, speed=float("inf")) for _ in range(2)]
            # Paced: arrivals 0.3 s apart at speed 2 take at least 0.15 s per gap.
            spaced = [
                msgspec.structs.replace(r, arrival_s=0.3 * i) for i, r in enumerate(want.requests)
            ]
            paced = await replay_runtime(rt, spaced, speed=2.0)
    tok = load_tokenizer("bundled")
    for run in [*runs, paced]:
        report = diff_traces(want, run_of(run.results, want), tok.decode)
        assert report.divergences == [] and report.share_identical == 1.0
    assert paced.wall_s >= 0.15 * (len(spaced) - 1)
    s = runs[0].summary()
    assert s["requests"] == 5 and s["finish_reasons"] == {"length": 4, "stop": 1}
    assert s["ttft_ms"]["p50"] > 0 and s["itl_ms"]["p50"] > 0 and s["tokens_per_second"] > 0
    assert s["accepted_per_position"] and s["mean_accept_len"] >= 1.0
    # Per-request totals from the final delta agree with the request's per-step counts.
    for r in runs[0].results:
        assert runs[0].drafts[r.request_id] == (
            sum(r.step_drafts),
            sum(min(a, d) for a, d in zip(r.step_accepted, r.step_drafts, strict=True)),
        )
    assert s["drafts_proposed"] == sum(sum(r.step_drafts) for r in runs[0].results) > 0
    assert 0 <= s["drafts_accepted"] <= s["drafts_proposed"]

    # An injected change is found at the right token, with both tokens.
    results = dict(want.results)
    victim = results["seeded-t08"]
    ids = list(victim.token_ids)
    ids[4] = (ids[4] + 1) % 1000
    results["seeded-t08"] = msgspec.structs.replace(victim, token_ids=ids)
    changed = Trace(want.header, want.requests, results)
    report = diff_traces(changed, run_of(runs[0].results, want), tok.decode)
    (d,) = report.divergences
    assert (d.request_id, d.index, d.token_a, d.token_b) == (
        "seeded-t08",
        4,
        ids[4],
        victim.token_ids[4],
    )
    assert report.share_identical == 0.8


def test_submit_times() -> None:
    reqs = expected().requests
    assert submit_times(reqs, 1.0) == [r.arrival_s for r in reqs]
    assert submit_times(reqs, 2.0) == [r.arrival_s / 2 for r in reqs]
    assert submit_times(reqs, float("inf")) == [0.0] * len(reqs)


def test_cli_replay_then_strict_diff(tmp_path: Path) -> None:
    out = tmp_path / "run.jsonl"
    cli = [sys.executable, "-m", "spectrio.tools.cli"]
    proc = subprocess.run(
        [
            *cli,
            "replay",
            str(EXPECTED),
            "--same-config",
            "--speed",
            "inf",
            "-o",
            str(out),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["requests"] == 5 and summary["tokens"] > 0
    run = read_trace(out)
    assert run.header.source == "replay" and run.summary is not None
    assert run.header.runtime == expected().header.runtime
    diff = subprocess.run(
        [*cli, "diff", str(EXPECTED), str(out), "--strict"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert diff.returncode == 0, diff.stdout + diff.stderr
    assert "5/5 requests identical" in diff.stdout


async def test_replay_against_a_server_matches_the_committed_output_twice(
    tmp_path: Path,
) -> None:
    want = expected()
    cfg = tmp_path / "runtime.json"
    cfg.write_text(json.dumps(want.header.runtime))
    assert runtime_fields(config_from_fields(want.header.runtime or {})) == want.header.runtime
    server = Server(tmp_path, "serve", "--config", str(cfg), "--run-dir", str(tmp_path / "run"))
    try:
        eps = await trio.to_thread.run_sync(server.wait_endpoints)
        with trio.fail_after(300):
            for _ in range(2):
                run = await replay_wire(
                    want.requests, eps["requests"], eps["outputs"], speed=float("inf")
                )
                report = diff_traces(want, run_of(run.results, want))
                assert report.divergences == [], report.divergences
                assert all(r.ttft_s is not None and r.ttft_s > 0 for r in run.results)
                # Each request's final step message carried its speculation totals.
                assert set(run.drafts) == {r.request_id for r in want.requests}
                assert all(0 <= a <= p for p, a in run.drafts.values())
                s = run.summary()
                assert s["drafts_proposed"] > 0 and s["draft_acceptance"] is not None
                assert s["mean_accept_len"] >= 1.0
    finally:
        server.stop()


def test_a_trace_carries_no_host_local_setting() -> None:
    """The timing cache's folder belongs to the recording host: a trace leaves it out, and
    a replay with --same-config uses the replaying host's default."""
    from spectrio.core.config import RuntimeConfig, SpeculativeConfig

    cfg = RuntimeConfig(speculative=SpeculativeConfig(timing_cache="/home/alice/cache"))
    fields = runtime_fields(cfg)
    assert "timing_cache" not in fields["speculative"]
    back = config_from_fields(json.loads(json.dumps(fields)))
    assert back.speculative.timing_cache == "auto"
    assert runtime_fields(back) == fields
