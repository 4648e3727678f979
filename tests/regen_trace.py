"""Regenerate the committed trace and its expected output from the bundled checkpoint.

``tests/data/trace_small_prompts.jsonl`` is the source (prompts and params, edited by
hand). This script imports it into ``tests/data/trace_small.jsonl`` (token ids from the
bundled tokenizer) and replays that in float64 into ``tests/data/trace_small_expected.jsonl``,
whose header records the runtime configuration ``tests/test_trace_replay.py`` replays
with. Run it, and commit both files, whenever the bundled model changes::

    python tests/regen_trace.py

Never edit the two generated files by hand.
"""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
PROMPTS = DATA / "trace_small_prompts.jsonl"
TRACE = DATA / "trace_small.jsonl"
EXPECTED = DATA / "trace_small_expected.jsonl"
REPLAY_FLAGS = ["--dtype", "float64", "--k", "2", "--max-model-len", "128", "--speed", "inf"]


def main() -> int:
    from spectrio.tools.cli.commands import main as cli

    code = cli(["trace", "import", str(PROMPTS), "-o", str(TRACE)])
    if code == 0:
        code = cli(["replay", str(TRACE), "--out", str(EXPECTED), *REPLAY_FLAGS])
    return code


if __name__ == "__main__":
    raise SystemExit(main())
