"""The ``spectrio`` console script, run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

from pipeline_helpers import oracle

from spectrio.models import load


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spectrio.tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_generate_json_matches_the_reference() -> None:
    proc = run_cli(
        "generate", "def fib(n):", "--max-tokens", "12", "--dtype", "float64", "--k", "3", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) >= {
        "text",
        "token_ids",
        "finish_reason",
        "num_steps",
        "mean_accept_len",
        "accepted_per_position",
    }
    tok = load("bundled").tokenizer
    assert tok is not None
    assert out["token_ids"] == oracle("float64", tok.encode("def fib(n):"), 12)
    assert out["text"] == tok.decode(out["token_ids"])
    assert len(out["accepted_per_position"]) == 3
    # The CLI rounds to 4 decimals; with adaptive k the step count varies run to run.
    assert out["mean_accept_len"] == round(len(out["token_ids"]) / out["num_steps"], 4)


def test_generate_streams_text_without_speculation() -> None:
    proc = run_cli("generate", "import os", "--max-tokens", "8", "--no-spec")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("import os")
    assert "mean accepted length 1.0" in proc.stderr


def test_bad_flags_are_clear_errors() -> None:
    proc = run_cli("generate", "x", "--k", "9")
    assert proc.returncode == 2 and "num_speculative_tokens" in proc.stderr
    proc = run_cli("generate", "x", "--max-tokens", "0")
    assert proc.returncode == 2 and "--max-tokens" in proc.stderr
    proc = run_cli("generate", "x", "--k", "2", "--num-model-steps", "3")
    assert proc.returncode == 2 and "num_model_steps" in proc.stderr


def test_serve_refuses_a_config_the_model_cannot_hold(tmp_path: object) -> None:
    """A model-dependent config error surfaces as one clear line and exit status 2, also
    from inside the server's task nurseries."""
    proc = run_cli("serve", "--run-dir", f"{tmp_path}/run", "--max-model-len", "4000")
    assert proc.returncode == 2, proc.stderr
    assert "error: max_model_len" in proc.stderr and "max_position_embeddings" in proc.stderr
    assert "Traceback" not in proc.stderr
