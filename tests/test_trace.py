"""The trace format (docs/trace.md): reading, writing, import, the result builder, the
summary and the diff. Pure: no model runs here (test_trace_replay.py runs them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from spectrio.core.params import SamplingParams
from spectrio.tools.measurement.diff import diff_traces, first_divergence
from spectrio.tools.measurement.latency import percentiles
from spectrio.tools.measurement.trace_command import import_prompts, load_tokenizer
from spectrio.tools.measurement.trace_format import (
    TRACE_VERSION,
    TraceError,
    TraceResult,
    TraceWriter,
    parse_lines,
    read_trace,
)
from spectrio.tools.measurement.trace_record import ResultBuilder
from spectrio.tools.measurement.trace_summary import summarize

DATA = Path(__file__).resolve().parent / "data"
HEADER = '{"kind": "header", "format": "spectrio-trace", "version": "1.0"}'
REQ = '{"kind": "request", "request_id": "%s", "arrival_s": 0.5, "prompt_ids": [1, 2]}'


def test_writer_output_reads_back_identically(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    params = SamplingParams(max_tokens=5, temperature=0.7, seed=3, stop=["x"])
    with TraceWriter(path, source="test", model="bundled", runtime={"dtype": "float64"}) as w:
        w.add_request("a", [5, 6, 7], params, arrival_s=0.25, prompt_text="hi")
        w.add_request("b", [8], SamplingParams(), arrival_s=1.0)
        w.add_result(TraceResult(request_id="b", token_ids=[1], text="x", finish_reason="stop"))
        w.add_summary(2.0, {"tokens": 1})
    t = read_trace(path)
    assert t.header.version == TRACE_VERSION and t.header.source == "test"
    assert t.header.runtime == {"dtype": "float64"}
    assert [r.request_id for r in t.requests] == ["a", "b"]
    assert t.requests[0].params == params and t.requests[0].prompt_text == "hi"
    assert t.requests[0].arrival_s == 0.25
    assert list(t.results) == ["b"] and t.results["b"].finish_reason == "stop"
    assert t.summary is not None and t.summary.wall_s == 2.0
    # every params field is written, so a changed default never changes a replay
    line = json.loads(path.read_text().splitlines()[1])
    assert set(line["params"]) == set(SamplingParams.__struct_fields__)


def test_append_continues_a_trace_and_renames_reused_ids(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, source="serve", append=True) as w:
        w.add_request("a", [1], SamplingParams(), arrival_s=0)
    with TraceWriter(path, source="serve", append=True) as w:
        rid = w.unique_id("a")
        assert rid == "a~2"
        w.add_request(rid, [1], SamplingParams(), arrival_s=0)
        with pytest.raises(TraceError, match="already"):
            w.add_request("a", [1], SamplingParams(), arrival_s=0)
    t = read_trace(path)
    assert [r.request_id for r in t.requests] == ["a", "a~2"]
    assert sum(1 for line in path.read_text().splitlines() if '"header"' in line) == 1


@pytest.mark.parametrize(
    ("lines", "why"),
    [
        ([], "empty file"),
        ([REQ % "a"], "first line must be the header"),
        ([HEADER, HEADER], "second header"),
        ([HEADER.replace("1.0", "2.0")], "version 2.0"),
        ([HEADER.replace("spectrio-trace", "other")], "format 'other'"),
        ([HEADER, REQ % "a", REQ % "a"], "appears twice"),
        (
            [
                HEADER,
                '{"kind": "result", "request_id": "z", "token_ids": [], "text": "", '
                '"finish_reason": null}',
            ],
            "unknown request",
        ),
        ([HEADER, "{not json"], "malformed"),
        ([HEADER, '{"kind": "nope"}'], "Invalid value 'nope'"),
        ([HEADER, REQ.replace("[1, 2]", '"text"') % "a"], "Expected `array`"),
        ([HEADER, (REQ % "a")[:-1] + ', "params": {"temprature": 1}}'], "unknown field"),
        ([HEADER, (REQ % "a").replace("0.5", "-1")], "arrival_s"),
    ],
)
def test_bad_traces_are_refused_with_file_and_line(lines: list[str], why: str) -> None:
    with pytest.raises(TraceError, match=why) as info:
        parse_lines(lines, "f.jsonl")
    assert str(info.value).startswith("f.jsonl")


def test_a_newer_minor_version_with_extra_fields_is_read() -> None:
    t = parse_lines(
        [
            HEADER.replace("1.0", "1.7")[:-1] + ', "future": 1}',
            (REQ % "a")[:-1] + ', "priority": 3}',
        ]
    )
    assert t.requests[0].prompt_ids == [1, 2]


def test_missing_file_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "nope.jsonl")


def test_import_tokenizes_checks_and_spaces_arrivals() -> None:
    tok = load_tokenizer("bundled")
    lines = [
        '{"prompt": "def fib(n):", "params": {"max_tokens": 4, "seed": 1}}',
        '{"prompt": [3, 4, 5], "request_id": "ids"}',
        '{"prompt": "x", "arrival_s": 0.0}',
    ]
    reqs = import_prompts(lines, tok, rate=10.0, seed=1)
    by_id = {r.request_id: r for r in reqs}
    assert by_id["r0"].prompt_ids == tok.encode("def fib(n):")
    assert by_id["r0"].prompt_text == "def fib(n):" and by_id["r0"].params.seed == 1
    assert by_id["ids"].prompt_ids == [3, 4, 5] and by_id["ids"].prompt_text is None
    assert by_id["r2"].arrival_s == 0.0  # given explicitly
    assert 0 < by_id["r0"].arrival_s < by_id["ids"].arrival_s  # Poisson, cumulative
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    again = import_prompts(lines, tok, rate=10.0, seed=1)
    assert [r.arrival_s for r in again] == [r.arrival_s for r in reqs]  # seeded


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ('{"prompt": ""}', "prompt: must not be empty"),
        ('{"prompt": [1, 999999]}', "vocabulary"),
        ('{"prompt": "a", "params": {"top_p": 0}}', "top_p"),
        ('{"prompt": "a", "params": {"temprature": 1}}', "unknown field"),
        ('{"prompt": "a", "extra": 1}', "unknown field"),
        ('{"params": {}}', "missing required field `prompt`"),
    ],
)
def test_import_refuses_bad_lines(line: str, why: str) -> None:
    with pytest.raises(TraceError, match=why) as info:
        import_prompts(['{"prompt": "ok"}', line], load_tokenizer("bundled"), name="p.jsonl")
    assert str(info.value).startswith("p.jsonl:2:")


class D(msgspec.Struct):
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    num_drafts: int = 0
    num_accepted: int = 0


def test_result_builder_times_and_acceptance() -> None:
    b = ResultBuilder("r", start=10.0)
    b.add(D([1], "a", num_drafts=0), 10.5)
    b.add(D([2, 3, 4], "bcd", num_drafts=3, num_accepted=2), 10.75)
    b.add(D([], "", finish_reason="length"), 10.8)  # no tokens: not a chunk for ITL
    r = b.result()
    assert r.token_ids == [1, 2, 3, 4] and r.text == "abcd" and r.finish_reason == "length"
    assert r.ttft_s == 0.5 and r.itl_s == [0.25] and r.e2e_s == pytest.approx(0.8)
    assert r.step_tokens == [1, 3] and r.step_drafts == [0, 3] and r.step_accepted == [0, 2]
    s = summarize([r], wall_s=2.0)
    assert s["tokens"] == 4 and s["tokens_per_second"] == 2.0
    assert s["accepted_per_position"] == [1.0, 1.0, 0.0]
    assert s["mean_accept_len"] == 2.0
    assert s["ttft_ms"]["p50"] == 500.0
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0)  # (0.8 - 0.5) / 3


def test_percentiles_interpolate() -> None:
    assert percentiles([0.001, 0.002, 0.003, 0.004, 0.005], scale=1e3) == {
        "p50": 3.0,
        "p90": 4.6,
        "p99": 4.96,
        "mean": 3.0,
    }
    assert percentiles([]) == dict.fromkeys(("p50", "p90", "p99", "mean"))


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], [4]) == 0


def _run(results: dict[str, list[int]], reasons: dict[str, str] | None = None) -> list[str]:
    lines = [HEADER] + [REQ % rid for rid in results]
    for rid, ids in results.items():
        reason = (reasons or {}).get(rid, "length")
        lines.append(
            json.dumps(
                {
                    "kind": "result",
                    "request_id": rid,
                    "token_ids": ids,
                    "text": "",
                    "finish_reason": reason,
                    "ttft_s": 0.01,
                    "step_tokens": [len(ids)],
                    "step_drafts": [2],
                    "step_accepted": [1],
                }
            )
        )
    return lines


def test_diff_finds_the_first_diverging_token_with_its_text() -> None:
    tok = load_tokenizer("bundled")
    ids = tok.encode("def fib(n):\n    return n")
    changed = list(ids)
    changed[5] = tok.encode(" x")[0]
    a = parse_lines(_run({"same": ids, "diff": ids, "gone": ids}))
    b = parse_lines(_run({"same": ids, "diff": changed, "new": ids}))
    report = diff_traces(a, b, tok.decode, width=3)
    assert report.compared == 4 and report.identical == 1
    by_id = {d.request_id: d for d in report.divergences}
    d = by_id["diff"]
    assert (d.index, d.token_a, d.token_b) == (5, ids[5], changed[5])
    assert d.context_a == tok.decode(ids[2:5]) + f"[[{tok.decode([ids[5]])}]]" + tok.decode(
        ids[6:9]
    )
    assert "[[ x]]" in d.context_b
    assert by_id["gone"].missing == "b" and by_id["new"].missing == "a"
    assert report.deltas["ttft_p50_ms"]["delta"] == 0.0


def test_diff_counts_a_different_finish_reason() -> None:
    a = parse_lines(_run({"r": [1, 2]}))
    b = parse_lines(_run({"r": [1, 2]}, {"r": "stop"}))
    (d,) = diff_traces(a, b).divergences
    assert d.index == 2 and d.token_a is None and (d.finish_a, d.finish_b) == ("length", "stop")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spectrio.tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_diff_cli_strict_exit_status_and_json(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(_run({"r": [10, 11, 12]})) + "\n")
    b.write_text("\n".join(_run({"r": [10, 11, 13]})) + "\n")
    same = _cli("diff", str(a), str(a), "--strict")
    assert same.returncode == 0 and "1/1 requests identical" in same.stdout
    loose = _cli("diff", str(a), str(b))
    assert loose.returncode == 0 and "first divergence at token 2" in loose.stdout
    strict = _cli("diff", str(a), str(b), "--strict", "--json")
    assert strict.returncode == 1
    out = json.loads(strict.stdout)
    assert out["share_identical"] == 0.0 and out["divergences"][0]["index"] == 2
    bad = _cli("diff", str(a), str(tmp_path / "missing.jsonl"))
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and bad.stdout == ""


def test_import_cli_writes_a_trace(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):", "params": {"max_tokens": 3}}\n')
    out = tmp_path / "t.jsonl"
    proc = _cli("trace", "import", str(prompts), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    t = read_trace(out)
    assert t.header.source == "import" and t.requests[0].params.max_tokens == 3
    prompts.write_text('{"prompt": "def f(x):", "params": {"max_tokens": 0}}\n')
    proc = _cli("trace", "import", str(prompts), "-o", str(out))
    assert proc.returncode == 2 and "max_tokens" in proc.stderr and "p.jsonl:1" in proc.stderr


def test_the_committed_trace_is_readable() -> None:
    t = read_trace(DATA / "trace_small.jsonl")
    expected = read_trace(DATA / "trace_small_expected.jsonl")
    assert [r.request_id for r in t.requests] == [r.request_id for r in expected.requests]
    assert set(expected.results) == {r.request_id for r in t.requests}
    assert expected.header.runtime is not None and expected.header.runtime["dtype"] == "float64"
