"""Issue 13, "A CLI like its peers": runtime flags generated from the config dataclasses
(one flag and one help text per field), the ``--config`` merge rule (flags win, field by
field), ``generate`` and ``client`` taking the same sampling flags, and the logging flags
before or after the command."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from spectrio import ConfigError, RuntimeConfig, SamplingParams, SpeculativeConfig
from spectrio.runtime.config_file import load_config, merge_tables
from spectrio.tools.cli.commands import build_parser
from spectrio.tools.cli.logging_setup import BarAwareLogger, split_logging_flags
from spectrio.tools.cli.runtime_flags import (
    RUNTIME_FLAGS,
    add_runtime_flags,
    parse_runtime_flags,
    runtime_flag_specs,
)
from spectrio.tools.cli.sampling_flags import add_sampling_flags, sampling_params


def config_fields() -> set[str]:
    spec = {f"speculative.{f.name}" for f in dataclasses.fields(SpeculativeConfig)}
    return {f.name for f in dataclasses.fields(RuntimeConfig) if f.name != "speculative"} | spec


def option_strings(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in p._actions for s in a.option_strings}


def test_every_config_field_has_exactly_one_flag_and_one_help() -> None:
    assert [s.path for s in RUNTIME_FLAGS].count("model") == 1
    assert {s.path for s in RUNTIME_FLAGS} == config_fields()
    assert len(RUNTIME_FLAGS) == len(config_fields())
    p = argparse.ArgumentParser()
    add_runtime_flags(p)
    actions = [a for a in p._actions if a.dest.startswith("runtime.")]
    # one argparse action per field, each with its own help, none shared
    assert sorted(a.dest for a in actions) == sorted("runtime." + f for f in config_fields())
    assert all(a.help and len(a.help) > 10 for a in actions)
    assert len({a.help for a in actions}) == len(actions)
    flags = [s for a in actions for s in a.option_strings]
    assert len(flags) == len(set(flags))
    assert "--config" in option_strings(p)


def test_a_field_without_a_flag_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import spectrio.tools.cli.runtime_flags as rf

    monkeypatch.setattr(rf, "RUNTIME_FLAGS", rf.RUNTIME_FLAGS[1:])
    with pytest.raises(RuntimeError, match=r"fields without a flag \['model'\]"):
        rf.runtime_flag_specs()


@pytest.mark.parametrize(
    "argv,field,value",
    [
        (["--model", "synthetic:step_ms=1"], "model", "synthetic:step_ms=1"),
        (["--dtype", "float64"], "dtype", "float64"),
        (["--max-num-seqs", "4"], "max_num_seqs", 4),
        (["--max-num-batched-tokens", "199"], "max_num_batched_tokens", 199),
        (["--max-model-len", "64"], "max_model_len", 64),
        (["--block-size", "8"], "block_size", 8),
        (["--num-kv-blocks", "4096"], "num_kv_blocks", 4096),
        (["--kv-cache-memory-bytes", "1000000"], "kv_cache_memory_bytes", 1000000),
        (["--role", "decode"], "role", "decode"),
        (["--graph-capture-sizes", "5", "10"], "graph_capture_sizes", (5, 10)),
        (["--tensor-parallel-size", "1"], "tensor_parallel_size", 1),
        (["--overlap"], "enable_overlap", True),
        (["--no-prefix-caching"], "enable_prefix_caching", False),
        (["--runtime-seed", "7"], "seed", 7),
        (["--threads", "3"], "num_threads", 3),
        (["--threads", "none"], "num_threads", None),
        (["--stall-timeout-s", "2.5"], "stall_timeout_s", 2.5),
        (["--no-spec"], "speculative.method", None),
        (["--k", "3"], "speculative.num_speculative_tokens", 3),
        (["--num-model-steps", "1"], "speculative.num_model_steps", 1),
        (["--no-adaptive"], "speculative.adaptive", False),
        (["--timing-cache", "off"], "speculative.timing_cache", "off"),
        (["--spec-method", "ngram"], "speculative.method", "ngram"),
        (["--prompt-lookup-max", "6"], "speculative.prompt_lookup_max", 6),
        (["--prompt-lookup-min", "1"], "speculative.prompt_lookup_min", 1),
        # a draft model's fields go with its method (they are refused with any other)
        (
            ["--spec-method", "draft_model", "--draft-model", "bundled"],
            "speculative.draft_model",
            "bundled",
        ),
        (["--spec-method", "draft_model", "--draft-layers", "2"], "speculative.draft_layers", 2),
    ],
)
def test_each_flag_sets_its_field(argv: list[str], field: str, value: object) -> None:
    config = parse_runtime_flags(argv)
    head, _, name = field.rpartition(".")
    got = getattr(config.speculative if head else config, name)
    assert got == value
    spec = SpeculativeConfig(method="draft_model") if name.startswith("draft_") else None
    assert config == dataclasses.replace(  # and nothing else changed
        RuntimeConfig(),
        **(
            {"speculative": dataclasses.replace(spec or SpeculativeConfig(), **{name: value})}
            if head
            else {name: value}
        ),
    )


def test_the_flags_cover_every_field() -> None:
    """The table above exercises every field (so no flag is left untested)."""
    params = test_each_flag_sets_its_field.pytestmark[0].args[1]  # type: ignore[attr-defined]
    assert {f for _, f, _ in params} == config_fields()


def test_no_flags_give_the_default_config() -> None:
    assert parse_runtime_flags([]) == RuntimeConfig()
    for spec, _, _ in runtime_flag_specs():
        assert spec.help  # the default is shown from the field, not written twice
        assert "default" not in spec.help


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def test_config_file_is_merged_with_flags_and_flags_win(tmp_path: Path) -> None:
    cfg = write(
        tmp_path / "c.toml",
        """
        max_num_seqs = 8
        max_num_batched_tokens = 64
        dtype = "float64"
        [speculative]
        num_speculative_tokens = 3
        adaptive = false
        """,
    )
    file_only = parse_runtime_flags(["--config", str(cfg)])
    assert file_only == load_config(cfg)
    assert file_only.max_num_seqs == 8 and file_only.speculative.num_speculative_tokens == 3

    merged = parse_runtime_flags(["--config", str(cfg), "--k", "2", "--max-model-len", "256"])
    # the flags' fields changed; every other field is the file's, in both tables
    assert merged == dataclasses.replace(
        file_only,
        max_model_len=256,
        speculative=dataclasses.replace(file_only.speculative, num_speculative_tokens=2),
    )
    assert merged.speculative.adaptive is False and merged.dtype == "float64"
    # flag order does not matter: --config may come last
    assert parse_runtime_flags(["--k", "2", "--max-model-len", "256", "--config", str(cfg)]) == (
        merged
    )


def test_spec_flags_override_the_files_method_both_ways(tmp_path: Path) -> None:
    off = write(tmp_path / "off.toml", "[speculative]\nmethod = 'mtp'\n")
    assert parse_runtime_flags(["--config", str(off), "--no-spec"]).speculative.method is None
    on = write(tmp_path / "on.json", json.dumps({"speculative": {"method": None}}))
    assert parse_runtime_flags(["--config", str(on)]).speculative.method is None
    assert parse_runtime_flags(["--config", str(on), "--spec"]).speculative.method == "mtp"


def test_the_merged_config_is_validated_as_a_whole(tmp_path: Path) -> None:
    """16 sequences of k + 1 = 5 tokens fit 80 batched tokens; --k 5 makes it 96."""
    cfg = write(tmp_path / "c.toml", "max_num_seqs = 16\nmax_num_batched_tokens = 80\n")
    assert parse_runtime_flags(["--config", str(cfg)]).max_num_batched_tokens == 80
    with pytest.raises(ConfigError, match="max_num_batched_tokens: must be >= .* 16 \\* 6"):
        parse_runtime_flags(["--config", str(cfg), "--k", "5"])
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        parse_runtime_flags(["--config", str(cfg), "--k", "9"])


def test_merge_tables_replaces_keys_and_merges_the_speculative_table() -> None:
    base = {"model": "a", "max_num_seqs": 8, "speculative": {"method": "mtp", "adaptive": False}}
    over = {"model": "b", "speculative": {"num_speculative_tokens": 3}}
    assert merge_tables(base, over) == {
        "model": "b",
        "max_num_seqs": 8,
        "speculative": {"method": "mtp", "adaptive": False, "num_speculative_tokens": 3},
    }
    assert merge_tables(base, {}) == base and merge_tables({}, over) == over
    assert base["speculative"] == {"method": "mtp", "adaptive": False}  # inputs untouched


def subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_generate_and_client_take_the_same_sampling_flags() -> None:
    def sampling(p: argparse.ArgumentParser) -> set[str]:
        return {s for s, a in option_strings(p).items() if a.dest.startswith("sampling.")}

    gen, client = sampling(subparser("generate")), sampling(subparser("client"))
    assert gen == client
    assert {
        "--temperature",
        "--top-k",
        "--top-p",
        "--min-p",
        "--seed",
        "--stop",
        "--repetition-penalty",
        "--frequency-penalty",
        "--presence-penalty",
        "--logprobs",
        "--max-tokens",
    } <= gen


def test_sampling_flags_build_sampling_params() -> None:
    p = argparse.ArgumentParser()
    add_sampling_flags(p)
    args = p.parse_args(
        "--temperature 0.7 --top-k 5 --top-p 0.9 --min-p 0.05 --seed 3 --stop ab --stop cd "
        "--stop-token-ids 1 2 --repetition-penalty 1.1 --frequency-penalty 0.5 "
        "--presence-penalty -0.5 --logprobs 2 --logprobs-mode processed --ignore-eos "
        "--max-tokens 9 --min-tokens 1".split()
    )
    assert sampling_params(args) == SamplingParams(
        max_tokens=9,
        min_tokens=1,
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        min_p=0.05,
        seed=3,
        stop=["ab", "cd"],
        stop_token_ids=[1, 2],
        ignore_eos=True,
        repetition_penalty=1.1,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        logprobs=2,
        logprobs_mode="processed",
    )
    assert sampling_params(p.parse_args([])) == SamplingParams()


def test_logging_flags_are_found_before_or_after_the_command() -> None:
    assert split_logging_flags(["--log-level", "info", "serve", "--k", "3"]) == (
        ["serve", "--k", "3"],
        {"log_level": "info"},
    )
    assert split_logging_flags(["serve", "--log-format=json", "--log-level", "debug"]) == (
        ["serve"],
        {"log_format": "json", "log_level": "debug"},
    )
    # after "--" nothing is touched; a flag without a value is left for argparse
    assert split_logging_flags(["generate", "--", "--log-level", "x"])[0] == [
        "generate",
        "--",
        "--log-level",
        "x",
    ]
    assert split_logging_flags(["serve", "--log-level"]) == (["serve", "--log-level"], {})


def test_a_log_line_goes_above_an_active_progress_bar() -> None:
    from tqdm import tqdm

    out = io.StringIO()
    with tqdm(total=10, file=out, ascii=True, desc="bar") as bar:
        bar.update(3)
        BarAwareLogger(out).msg("a log line")
        bar.update(3)
    text = out.getvalue()
    # the log line is a line of its own: what precedes it on its line was erased by a
    # carriage return, and nothing of the bar follows it before the newline
    line = next(seg for seg in text.split("\n") if "a log line" in seg)
    assert line.split("\r")[-1] == "a log line"
    # without a bar, a plain line
    plain = io.StringIO()
    BarAwareLogger(plain).msg("x")
    assert plain.getvalue() == "x\n"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spectrio.tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_json_logs_on_stderr_with_the_level_after_the_command(tmp_path: Path) -> None:
    """``--log-level`` and ``--log-format`` after the subcommand; the log lines are JSON
    on stderr and stdout holds only the command's JSON output."""
    proc = run_cli(
        "generate",
        "def f(x):",
        "--max-tokens",
        "3",
        "--json",
        "--log-format",
        "json",
        "--log-level",
        "debug",
        "--max-model-len",
        "64",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["token_ids"]) == 3 and out["total_drafts"] is not None
    logs = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    assert logs and all({"event", "level", "timestamp"} <= set(line) for line in logs)
    assert any(line["level"] == "info" for line in logs)  # below the default (warning)
    quiet = run_cli("generate", "x", "--max-tokens", "2", "--max-model-len", "64")
    assert quiet.returncode == 0 and "runtime started" not in quiet.stderr
    bad = run_cli("generate", "x", "--log-format", "xml")
    assert bad.returncode == 2 and "unknown log format" in bad.stderr


LIBRARY_ONLY = """
import logging, structlog
calls = []
structlog.configure = lambda *a, **k: calls.append(("structlog.configure", a, k))
logging.basicConfig = lambda *a, **k: calls.append(("logging.basicConfig", a, k))
handlers = list(logging.getLogger().handlers)
import trio
import spectrio
from spectrio import RuntimeConfig, SamplingParams, open_runtime
import spectrio.wire.server, spectrio.wire.client, spectrio.tools.measurement.trace_format

async def main():
    async with open_runtime(RuntimeConfig(max_model_len=64)) as rt:
        async for _ in rt.generate("def f(x):", SamplingParams(max_tokens=3)):
            pass

trio.run(main)
assert calls == [], calls
assert logging.getLogger().handlers == handlers, logging.getLogger().handlers
print("clean")
"""


def test_the_library_never_configures_logging() -> None:
    """Importing spectrio and running a runtime calls neither ``structlog.configure`` nor
    ``logging.basicConfig``, and adds no root handler: the embedding application's
    logging stays as it set it up."""
    proc = subprocess.run(
        [sys.executable, "-c", LIBRARY_ONLY], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("clean")


def test_no_spec_wins_over_spec_method() -> None:
    """``--spec-method`` picks the draft method; ``--no-spec`` still turns speculation
    off, whichever order they come in."""
    assert parse_runtime_flags(["--no-spec", "--spec-method", "ngram"]).speculative.method is None
    assert parse_runtime_flags(["--spec-method", "ngram", "--no-spec"]).speculative.method is None
    assert parse_runtime_flags(["--spec", "--spec-method", "ngram"]).speculative.method == "ngram"
