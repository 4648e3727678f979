"""Start-up and memory of one ``spectrio generate``, as a user meets them: wall time from
launch to the first streamed token and to exit, and the peak RSS, over alternated runs
(and llama.cpp's ``llama-simple`` on the same prompt beside it, given a build).

Run: ``python benchmarks/startup.py [--model smollm2] [--runs 3] [--max-tokens 32]
[--llama-bin DIR --gguf FILE]``. The first token is the first byte ``generate`` writes
after the prompt (it flushes stdout with each streamed delta). Run it once before
measuring: the first load of a GGUF file converts it into the cache folder
(``docs/models.md``). Prints one JSON object per run and the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

PROMPT = "Tell me about Paris."


def _run(cmd: list[str], skip: int) -> dict[str, float]:
    """Wall seconds to the first output byte after ``skip`` echoed bytes, to exit, and
    the child's peak RSS (RUSAGE_CHILDREN is a maximum over children: each run is
    started in a fresh grandchild so earlier runs do not mask it)."""
    wrapper = [
        "python",
        "-c",
        "import resource, subprocess, sys, time\n"
        "t0 = time.perf_counter()\n"
        "p = subprocess.Popen(sys.argv[2:], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)\n"
        "skip = int(sys.argv[1]); p.stdout.read(skip) if skip else None\n"
        "p.stdout.read(1); first = time.perf_counter() - t0\n"
        "p.stdout.read(); p.wait(); end = time.perf_counter() - t0\n"
        "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024\n"
        "print(first, end, peak)\n",
        str(skip),
        *cmd,
    ]
    out = subprocess.run(wrapper, capture_output=True, text=True, check=True).stdout.split()
    first, end, peak = (float(x) for x in out)
    return {"first_token_s": round(first, 3), "exit_s": round(end, 3), "peak_rss_mib": round(peak)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--llama-bin", type=Path, help="a llama.cpp build's bin folder")
    ap.add_argument("--gguf", type=Path, help="the GGUF file llama-simple runs")
    args = ap.parse_args()
    cases = {
        "spectrio": (
            ["spectrio", "generate", "--model", args.model, "--max-tokens",
             str(args.max_tokens), PROMPT],
            len(PROMPT.encode()),  # generate echoes the prompt before streaming
        ),
    }  # fmt: skip
    if args.llama_bin is not None and args.gguf is not None:
        cases["llama.cpp"] = (
            [str(args.llama_bin / "llama-simple"), "-m", str(args.gguf), "-n",
             str(args.max_tokens), PROMPT],
            0,
        )  # fmt: skip
    results: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    for i in range(args.runs):
        for name, (cmd, skip) in cases.items():
            row = _run(cmd, skip)
            results[name].append(row)
            print(json.dumps({"case": name, "run": i, **row}), flush=True)
    for name, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(json.dumps({"case": name, "median": med}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
