"""``spectrio bench``: its pure summaries, and whole runs on the synthetic device (small and
fast; no figures here, the numbers are only checked for consistency)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import trio

from spectrio import RuntimeConfig, open_runtime
from spectrio.core.timing import StepTiming
from spectrio.models.doubles.synthetic import true_chain
from spectrio.tools.measurement import bench, bench_run, bench_workload, latency
from spectrio.tools.measurement.bench_plot import timeline_bars
from spectrio.tools.measurement.replay import replay_runtime
from spectrio.tools.measurement.trace_format import config_from_fields, read_trace

SYNTH = "synthetic:step_ms=0.3,per_row_us=2,accept=0.9,0.5,0.2"

ROW_KEYS = {
    "batch", "k", "logprobs", "dtype", "overlap", "request_rate", "interleave", "requests",
    "max_tokens",
    "tokens", "seconds", "tokens_per_second", "requests_per_second", "tokens_per_second_runs",
    "samples", "tokens_per_second_pooled", "tokens_per_second_se",
    "ttft_ms", "itl_ms", "tpot_ms", "mean_accept_len", "mean_accepted",
    "acceptance_per_position", "accepted_per_position", "drafts_proposed", "drafts_accepted",
    "pipeline_steps", "timing_cache_warm", "steps_by_k", "efficiency", "bubble", "model_share",
    "overhead_share",
    "breakdown_ms",
    "record_bytes_per_step", "fixed_bytes_same_batch", "fixed_bytes_512",
}  # fmt: skip


def test_poisson_arrivals_are_seeded_and_at_the_rate() -> None:
    assert bench_workload.poisson_arrivals(3, None) == [0.0, 0.0, 0.0]
    a = bench_workload.poisson_arrivals(4000, 50.0, seed=1)
    assert a == bench_workload.poisson_arrivals(4000, 50.0, seed=1)
    assert a != bench_workload.poisson_arrivals(4000, 50.0, seed=2)
    assert a[0] == 0.0 and all(y >= x for x, y in zip(a, a[1:], strict=False))
    assert abs(np.mean(np.diff(a)) - 1 / 50) < 0.002
    with pytest.raises(ValueError, match="positive"):
        bench_workload.poisson_arrivals(2, 0.0)


def test_round_order_groups_batches_and_rotates_each_group() -> None:
    cases: list[tuple[int, int | str, int | None]] = [
        (1, 0, None), (1, 2, None), (1, "auto", None), (16, 0, None), (16, "auto", None),
    ]  # fmt: skip
    orders = [bench_workload.round_order(cases, r) for r in range(6)]
    assert orders[0] == cases
    assert orders[1] == [
        (1, 2, None), (1, "auto", None), (1, 0, None), (16, "auto", None), (16, 0, None),
    ]  # fmt: skip
    for order in orders:
        assert sorted(order, key=str) == sorted(cases, key=str)
        assert [c[0] for c in order] == [1, 1, 1, 16, 16]
    # Over as many rounds as a group has cases, each case runs once in every position.
    assert {o[2] for o in orders[:3]} == {(1, 0, None), (1, 2, None), (1, "auto", None)}
    assert {o[4] for o in orders[:2]} == {(16, 0, None), (16, "auto", None)}


def test_percentiles_and_latencies() -> None:
    assert latency.percentiles([]) == {"p50": None, "p90": None, "p99": None, "mean": None}
    got = latency.percentiles([float(x) for x in range(1, 101)])
    assert got == {"p50": 50.5, "p90": 90.1, "p99": 99.01, "mean": 50.5}
    tr = bench_run.RequestTrace(arrival=1.0)
    tr.add(1.5, 1)
    tr.add(1.6, 0)  # a delta without tokens (e.g. the final one) is no token event
    tr.add(1.7, 3)
    tr.add(2.0, 1)
    assert tr.ttft == pytest.approx(0.5)
    assert tr.itls == pytest.approx([0.2, 0.3])
    assert tr.tpot == pytest.approx(0.5 / 4)
    lat = bench_run.latency_summary([tr, bench_run.RequestTrace(arrival=0.0)])
    assert lat["ttft_ms"]["p50"] == pytest.approx(500.0)
    assert lat["itl_ms"]["mean"] == pytest.approx(250.0)


def _timing(step: int, start: float, device: float, gap_after: float = 0.0) -> StepTiming:
    return StepTiming(
        step=step,
        num_seqs=1,
        num_rows=1,
        num_drafts=0,
        plan_start=start - 0.002,
        planned_at=start - 0.001,
        device_start=start,
        draft_end=start + device * 0.1,
        verify_end=start + device * 0.9,
        device_end=start + device,
        model_seconds=device * 0.8,
        publish_start=start + device,
        publish_end=start + device + 0.0005,
    )


def test_timing_summary_keys() -> None:
    # Three 10 ms steps with 1 ms gaps over a 32 ms wall.
    steps = [_timing(i, 0.011 * i, 0.010) for i in range(3)]
    got = bench_run.timing_summary(steps, 0.032)
    assert got["efficiency"] == pytest.approx(0.030 / 0.032, abs=1e-4)
    assert got["bubble"] == pytest.approx(0.002 / 0.032, abs=1e-4)
    assert got["overhead_share"] == pytest.approx(1 - 0.024 / 0.032, abs=1e-4)
    assert got["breakdown_ms"] == pytest.approx(
        {"schedule": 1.0, "draft": 1.0, "verify": 8.0, "sample": 1.0, "publish": 0.5, "idle": 1.0}
    )
    empty = bench_run.timing_summary([], 1.0)
    assert empty["efficiency"] is None and set(empty["breakdown_ms"]) == set(bench_run.BREAKDOWN)
    bars = timeline_bars(steps, 0.0, window=0.015)
    assert [round(x, 3) for x, _ in bars["verify"]] == [1.0, 12.0]
    assert [(round(x, 3), round(w, 3)) for x, w in bars["schedule"]] == [(-2.0, 1.0), (9.0, 1.0)]
    assert [round(w, 3) for _, w in bars["publish"]] == [0.5, 0.5]


def test_device_summary_leaves_pauses_out_of_the_gaps() -> None:
    # Steps at 0, 11 and 32 ms, 10 ms each; paused from 21.5 to 31.5 ms: the second gap is
    # 1 ms of idle plus 10 ms of pause, and only the idle counts.
    steps = [_timing(0, 0.0, 0.010), _timing(1, 0.011, 0.010), _timing(2, 0.032, 0.010)]
    got = bench_run.timing_summary(steps, 0.032, pauses=[(0.0215, 0.0315)])
    assert got["bubble"] == pytest.approx(0.002 / 0.032, abs=1e-4)
    assert got["breakdown_ms"]["idle"] == pytest.approx(1.0)
    assert bench_run.timing_summary(steps, 0.032)["breakdown_ms"]["idle"] == pytest.approx(6.0)


async def test_interleaved_cases_take_turns_and_stay_lossless() -> None:
    """Three cases of batch 2 side by side: every request's tokens come, no two cases'
    steps overlap in time, each case steps in several turns, and the output is the same
    whatever the speculation (greedy is lossless)."""
    prompts = bench_workload.bench_prompts(6, 6, SYNTH)
    with trio.fail_after(120):
        rows = await trio.to_thread.run_sync(
            lambda: trio.run(
                functools.partial(
                    bench_run.run_interleaved,
                    SYNTH,
                    "float32",
                    [0, 2, "auto"],
                    2,
                    prompts,
                    16,
                    0.005,
                    k_max=3,
                    num_requests=6,
                )
            ),
            abandon_on_cancel=True,
        )
    assert [r["k"] for r in rows] == [0, 2, "auto"]
    intervals = []
    for r in rows:
        assert r["interleave"] == 0.005 and r["tokens"] == 6 * 16 and r["requests"] == 6
        assert r["ttft_ms"]["p50"] is None and r["itl_ms"]["p50"] is None
        assert r["tokens_per_second"] == pytest.approx(r["tokens"] / r["seconds"], rel=0.01)
        # One sample per turn: together they are the case's tokens and its own seconds.
        assert len(r["samples"]) >= 2
        assert sum(t for t, _ in r["samples"]) == r["tokens"]
        assert sum(s for _, s in r["samples"]) == pytest.approx(r["seconds"], abs=1e-3)
        timings = r["_raw"]["timings"]
        assert len(timings) == r["pipeline_steps"]
        intervals += [(t.device_start, t.device_end, r["k"]) for t in timings]
        assert r["outputs"] == rows[0]["outputs"]
        by_k = r["steps_by_k"]
        assert sum(by_k.values()) <= r["pipeline_steps"]
        if r["k"] != "auto":  # a fixed k drafts that many, or none on a request's last steps
            assert set(by_k) <= {"0", "1", str(r["k"])} and by_k[str(r["k"])] > 0
        else:
            assert set(by_k) <= {"0", "1", "2", "3"} and sum(by_k.values()) > 0
    intervals.sort()
    for (_, e0, _), (s1, _, _) in zip(intervals, intervals[1:], strict=False):
        assert e0 <= s1, "two cases stepped at the same time"
    switches = sum(a[2] != b[2] for a, b in zip(intervals, intervals[1:], strict=False))
    assert switches >= 6  # turns, not one case after another


async def _main(argv: list[str], seconds: float) -> int:
    """``bench.main`` (which runs ``trio.run`` per case) in a worker thread, under a
    deadline: abandoned on timeout, so a hung pipeline fails the test instead of hanging."""
    with trio.fail_after(seconds):
        return await trio.to_thread.run_sync(bench.main, argv, abandon_on_cancel=True)


async def test_bench_json_plot_and_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    argv = [
        "--model", SYNTH, "--batch", "1", "8", "--k", "0", "3", "--max-tokens", "24",
        "--prompt-tokens", "12", "--json", str(out), "--plot", str(png), "--progress", "off",
    ]  # fmt: skip
    assert await _main(argv, 120) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == bench.SCHEMA and doc["args"]["model"] == SYNTH
    rows = doc["rows"]
    assert [(r["batch"], r["k"]) for r in rows] == [(1, 0), (1, 3), (8, 0), (8, 3)]
    for r in rows:
        assert set(r) == ROW_KEYS
        assert r["tokens"] == r["requests"] * 24 == r["batch"] * 24
        # One run: one sample, the run itself, and no error to give.
        assert r["samples"] == [[r["tokens"], pytest.approx(r["seconds"], abs=1e-4)]]
        assert r["tokens_per_second_pooled"] == pytest.approx(r["tokens_per_second"], abs=0.2)
        assert r["tokens_per_second_se"] is None
        assert r["requests_per_second"] == pytest.approx(r["requests"] / r["seconds"], rel=0.02)
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"]
        assert r["itl_ms"]["p50"] <= r["itl_ms"]["p90"] <= r["itl_ms"]["p99"]
        assert set(r["breakdown_ms"]) == set(bench_run.BREAKDOWN)
        assert 0 < r["efficiency"] <= 1.0 and 0 <= r["bubble"] < 1.0
        assert r["overhead_share"] == pytest.approx(1 - r["model_share"], abs=1e-3)
        assert all(v is not None and v >= 0 for v in r["breakdown_ms"].values())
        if r["k"] == 0:
            assert r["mean_accept_len"] == 1.0 and r["acceptance_per_position"] == []
        else:
            assert len(r["acceptance_per_position"]) == 3
            assert r["mean_accept_len"] > 1.5
            assert r["drafts_accepted"] <= r["drafts_proposed"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "tok/s" in table and "acceptance per draft position" in table
    by_batch = {r["batch"]: r["tokens_per_second"] for r in rows if r["k"] == 0}
    gains = doc["speedups"]
    assert [(g["batch"], g["best_k"], g["auto_over_better"]) for g in gains] == [
        (1, 3, None),
        (8, 3, None),
    ]
    for g in gains:
        k3 = next(r for r in rows if r["batch"] == g["batch"] and r["k"] == 3)
        assert g["best_over_none"] == pytest.approx(k3["tokens_per_second"] / by_batch[g["batch"]])
        assert f"batch={g['batch']}: k=3 {g['best_over_none']:.2f}×" in table


async def test_bench_says_which_adaptive_runs_started_from_kept_step_times(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first adaptive run starts cold and keeps its step times; the second starts from
    them (the test's own cache folder, conftest), and the bench says so."""
    out = tmp_path / "out.json"
    argv = [
        "--model", SYNTH, "--batch", "8", "--k", "auto", "--max-tokens", "64",
        "--prompt-tokens", "6", "--repeat", "2", "--json", str(out), "--progress", "off",
    ]  # fmt: skip
    assert await _main(argv, 120) == 0
    printed = capsys.readouterr().out
    assert "adaptive runs started from kept step times" in printed
    assert "batch=8: 1/2" in printed, printed
    (row,) = json.loads(out.read_text())["rows"]
    assert row["k"] == "auto" and isinstance(row["timing_cache_warm"], bool)


async def test_bench_request_rate(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    argv = [
        "--model", SYNTH, "--batch", "4", "--k", "2", "--max-tokens", "8", "--prompt-tokens",
        "6", "--num-requests", "12", "--request-rate", "400", "--json", str(out),
        "--progress", "off",
    ]  # fmt: skip
    assert await _main(argv, 60) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["requests"] == 12 and row["request_rate"] == 400.0 and row["tokens"] == 96
    # 12 arrivals at 400/s span about 27 ms; the run cannot end before the last arrival.
    assert row["seconds"] >= bench_workload.poisson_arrivals(12, 400.0)[-1]


async def test_bench_waves_keep_the_batch_full(tmp_path: Path) -> None:
    """Three waves at batch 2: six requests, two running at a time."""
    out = tmp_path / "out.json"
    argv = [
        "--model", SYNTH, "--batch", "2", "--k", "0", "--max-tokens", "8", "--prompt-tokens",
        "6", "--waves", "3", "--json", str(out), "--progress", "off",
    ]  # fmt: skip
    assert await _main(argv, 60) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["requests"] == 6 and row["tokens"] == 48
    # A step emits one token per running request: 48 tokens take 24 steps with two
    # requests in every step (one prefill and seven decode steps each), 48 with one; the
    # first request may get a step to itself before the second is admitted.
    assert 24 <= row["pipeline_steps"] <= 26


async def test_bench_min_requests_lengthen_small_batches(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    argv = [
        "--model", SYNTH, "--batch", "1", "4", "--k", "0", "--max-tokens", "4",
        "--prompt-tokens", "6", "--waves", "2", "--min-requests", "5", "--json", str(out),
        "--progress", "off",
    ]  # fmt: skip
    assert await _main(argv, 60) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["requests"], r["tokens"]) for r in rows] == [(1, 5, 20), (4, 8, 32)]


async def test_bench_requests_per_batch_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One --num-requests count per --batch, in its order (so each batch size can run
    about as long), interleaved too."""
    out = tmp_path / "out.json"
    argv = [
        "--model", SYNTH, "--batch", "4", "1", "--k", "0", "2", "--max-tokens", "4",
        "--prompt-tokens", "6", "--num-requests", "9", "3", "--interleave", "0.05",
        "--json", str(out), "--progress", "off",
    ]  # fmt: skip
    assert await _main(argv, 60) == 0
    assert "requests=9 at batch 4, 3 at batch 1" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["k"], r["requests"], r["tokens"]) for r in rows] == [
        (4, 0, 9, 36), (4, 2, 9, 36), (1, 0, 3, 12), (1, 2, 3, 12)
    ]  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [
        ["--agreement"],
        ["--request-rate", "0"],
        ["--batch", "0"],
        ["--k", "x"],
        ["--waves", "0"],
        ["--waves", "2", "--num-requests", "4"],
        ["--interleave", "0"],
        ["--min-requests", "0"],
        ["--min-requests", "4", "--num-requests", "4"],
        ["--batch", "1", "4", "--num-requests", "2", "3", "4"],
        ["--num-requests", "0"],
        ["--batch", "4", "4"],
        ["--interleave", "0.1", "--request-rate", "5"],
        ["--k", "ngram:0"],
        ["--k", "eagle:2"],
        ["--k", "ngram:x"],
        ["--constraint", "choice:a"],
        ["--constraint", "regex"],
        ["--constraint", "json_schema:{not json"],
        ["--constraint", "json_schema:@/no/such/file.json"],
    ],
)
def test_bench_rejects_bad_options(extra: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--model", SYNTH, "--progress", "off", *extra])
    assert exc.value.code == 2


def test_bench_synthetic_prompts_are_seeded_ids_in_vocab() -> None:
    a = bench_workload.bench_prompts(5, 7, SYNTH, seed=3)
    assert a == bench_workload.bench_prompts(5, 7, SYNTH, seed=3)
    assert len(a) == 5 and all(len(p) == 7 and 1 <= min(p) and max(p) < 512 for p in a)


def test_bench_held_out_prompts_take_a_second_pass_after_the_first() -> None:
    """Batch 64 with 12 waves needs 768 prompts of 48 tokens; one pass over the held-out
    split holds 412. The second pass starts between the first's prompts, which come first
    and unchanged (so a smaller count gives the same prompts as before)."""
    many = bench_workload.bench_prompts(600, 48, "bundled")
    assert many[:100] == bench_workload.bench_prompts(100, 48, "bundled")
    assert all(len(p) == 48 for p in many)
    assert len({tuple(p) for p in many}) >= 590  # a few windows of text repeat
    with pytest.raises(RuntimeError, match=r"holds \d+ prompts of 48 tokens, not the"):
        bench_workload.bench_prompts(10**6, 48, "bundled")
    assert bench_workload.PROMPT_STRIDE // 2 > 48  # the passes' windows do not overlap


def test_bench_repeat_prompts_end_with_their_own_start() -> None:
    plain = bench_workload.bench_prompts(4, 48, "bundled")
    repeat = bench_workload.bench_prompts(4, 48, "bundled", workload="repeat")
    assert [p[:48] for p in repeat] == plain
    assert all(p[48:] == p[:12] for p in repeat)
    with pytest.raises(ValueError, match="workload"):
        bench_workload.bench_prompts(4, 48, "bundled", workload="copy")


def test_bench_runs_ngram_on_the_repeat_workload(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The n-gram proposer through the bench: the repeat workload's prompts hold what the
    greedy continuation copies, so lookup drafts are made and accepted."""
    out_json = tmp_path / "b.json"
    argv = [
        "--batch", "2", "--k", "0", "3", "--spec-method", "ngram", "--prompts", "repeat",
        "--max-tokens", "24", "--prompt-tokens", "64", "--num-requests", "2", "--progress",
        "off", "--json", str(out_json),
    ]  # fmt: skip
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    assert "spec_method=ngram prompts=repeat" in printed
    doc = json.loads(out_json.read_text())
    rows = {r["k"]: r for r in doc["rows"]}
    assert rows[0]["drafts_accepted"] == 0
    assert rows[3]["drafts_accepted"] > 0
    # The memory floor of the model's forward, probed in the same run.
    memory = doc["memory"]
    assert memory["read_gb_s"] > 0 and memory["forward_weight_bytes"] > 0
    assert memory["floor_us_1row"] == pytest.approx(
        memory["forward_weight_bytes"] / (memory["read_gb_s"] * 1e9) * 1e6, rel=0.01
    )
    assert "memory floor:" in printed


def test_bench_compares_methods_in_one_run(tmp_path: Path) -> None:
    """``METHOD:K`` cases draft with their own method beside the ``--spec-method`` ones,
    each with its own drafts (the output is the same: greedy and lossless)."""
    out_json = tmp_path / "b.json"
    argv = [
        "--batch", "2", "--k", "0", "2", "ngram:3", "--prompts", "repeat",
        "--max-tokens", "24", "--prompt-tokens", "64", "--num-requests", "2", "--progress",
        "off", "--json", str(out_json),
    ]  # fmt: skip
    assert bench.main(argv) == 0
    rows = {r["k"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert set(rows) == {0, 2, "ngram:3"}
    assert rows[2]["drafts_accepted"] > 0 and rows["ngram:3"]["drafts_accepted"] > 0
    # n-gram lookup proposes only where a suffix repeats; MTP drafts every step
    assert rows["ngram:3"]["drafts_proposed"] != rows[2]["drafts_proposed"]
    assert bench_workload.spec_config("ngram:auto", 5).method == "ngram"
    assert bench_workload.spec_config("ngram:auto", 5).adaptive
    assert bench_workload.spec_config("mtp:2", 5, method="ngram").method == "mtp"


async def test_bench_save_trace_replays_to_the_same_tokens(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    argv = [
        "--model", SYNTH, "--batch", "3", "--k", "2", "--max-tokens", "10", "--prompt-tokens",
        "5", "--num-requests", "5", "--request-rate", "500", "--save-trace", str(path),
        "--progress", "off",
    ]  # fmt: skip
    assert await _main(argv, 60) == 0
    trace = read_trace(path)
    assert trace.header.source == "bench" and trace.header.model == SYNTH
    prompts = bench_workload.bench_prompts(5, 5, SYNTH)
    assert [r.prompt_ids for r in trace.requests] == prompts
    assert [r.arrival_s for r in trace.requests] == pytest.approx(
        bench_workload.poisson_arrivals(5, 500.0), abs=1e-6
    )
    results = trace.ordered_results()
    assert [r.token_ids for r in results] == [true_chain(p, 10) for p in prompts]
    assert all(r.finish_reason == "length" and r.ttft_s is not None for r in results)
    assert trace.summary is not None and trace.summary.stats["tokens"] == 50
    # The recorded configuration replays in-process to the same tokens.
    config = config_from_fields(trace.header.runtime or {})
    assert isinstance(config, RuntimeConfig) and config.model == SYNTH
    with trio.fail_after(60):
        async with open_runtime(config) as rt:
            run = await replay_runtime(rt, trace.requests, speed=float("inf"))
    assert sorted((r.request_id, r.token_ids) for r in run.results) == sorted(
        (r.request_id, r.token_ids) for r in results
    )


def test_trace_paths_per_run() -> None:
    assert bench.trace_path(None, 1, 0, None, 0, False) is None
    assert bench.trace_path("a/run.jsonl", 16, 3, None, 0, True) == "a/run.jsonl"
    assert bench.trace_path("a/run.jsonl", 16, "auto", 5, 1, False) == (
        "a/run.b16.kauto.lp5.r1.jsonl"
    )


async def test_bench_shared_prefix_runs_cache_on_and_off_beside_a_control(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--shared-prefix``: four runs per case (shared or control prompts, cache on or
    off); only the shared prompts with the cache on hit, and every run emits every token."""
    out = tmp_path / "out.json"
    argv = [
        "--model", SYNTH, "--batch", "2", "--k", "2", "--max-tokens", "6", "--prompt-tokens",
        "20", "--shared-prefix", "40", "--num-requests", "6", "--multi-turn", "3",
        "--json", str(out), "--progress", "off",
    ]  # fmt: skip
    assert await _main(argv, 120) == 0
    rows = json.loads(out.read_text())["rows"]
    got = {(r["workload"], r["caching"]): r for r in rows}
    workloads = ("shared", "control", "multiturn")
    assert set(got) == {(w, c) for w in workloads for c in (True, False)}
    turns = got.pop(("multiturn", True)), got.pop(("multiturn", False))
    # two conversations of three turns: a turn resends the one before
    assert all(r["tokens"] == 36 and r["requests"] == 6 for r in turns)
    assert turns[0]["prefix_cache_hit_rate"] > 0.3 and turns[1]["prefix_cache_hits"] == 0
    assert all(r["tokens"] == 36 and r["requests"] == 6 for r in got.values())
    assert got[("shared", True)]["prefix_cache_hit_rate"] > 0.3
    assert all(r["prefix_cache_hits"] == 0 for k, r in got.items() if k != ("shared", True))
    printed = capsys.readouterr().out
    assert "cache on vs off" in printed and "shared batch=2 k=2" in printed


def test_bench_chat_prompts_are_held_out_messages_through_the_template(
    smollm2_gguf: Path,
) -> None:
    """``--prompts chat``: each prompt is one user turn of a held-out message, rendered by
    the model's own template with the assistant's turn opened; a model without a
    template is refused."""
    from spectrio.models.loading.loader import load_text_side
    from spectrio.models.text.chat import build_chat_template
    from spectrio.tools.training.chat_prompts import heldout_chat_prompts

    prompts = bench_workload.bench_prompts(3, 48, str(smollm2_gguf), workload="chat")
    cfg, tok, source = load_text_side(smollm2_gguf)
    template = build_chat_template(source, tok, cfg)
    assert template is not None and tok is not None
    for ids, message in zip(prompts, heldout_chat_prompts(3), strict=True):
        text = tok.raw.decode(ids, skip_special_tokens=False)
        assert text.endswith(f"<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="has no chat template"):
        bench_workload.bench_prompts(3, 48, "bundled", workload="chat")


def test_bench_runs_structured_output(tmp_path: Path) -> None:
    """``--constraint``: every request under a JSON schema, ending where its grammar ends
    (at most --max-tokens), with and without drafts (issue 60)."""
    out = tmp_path / "bench.json"
    schema = '{"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}'
    code = bench.main(
        ["--model", "bundled", "--batch", "2", "--k", "0", "2", "--max-tokens", "12",
         "--constraint", f"json_schema:{schema}", "--json", str(out), "--progress", "off"]
    )  # fmt: skip
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["k"] for r in rows] == [0, 2]
    assert all(0 < r["tokens"] <= 2 * 12 for r in rows), rows
