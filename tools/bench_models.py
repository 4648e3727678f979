"""Model-level figures: checkpoint load time and the reference generator's speed.

Run: ``python -m spectrio.tools.bench_models [--model bundled] [--max-tokens 128]``.
Prints one JSON object; the reference generator is the oracle (dense attention, one
token at a time, batch 1), so its speed is the floor the pipeline is compared with.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

from spectrio.models import load, reference
from spectrio.tools.logging_setup import configure_logging


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bundled")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    configure_logging("warning")

    load(args.model)  # first load pays for imports and file cache; report the steady state too
    loads = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        loaded = load(args.model)
        loads.append(time.perf_counter() - t0)
    tok = loaded.tokenizer
    assert tok is not None
    prompts = ["def fib(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n"]
    result: dict[str, object] = {
        "machine": f"{platform.machine()} cores={os.cpu_count()}",
        "load_seconds_median": round(statistics.median(loads), 3),
        "params": sum(int(p.numel()) for p in loaded.model.parameters()),
    }
    for dtype in ("float32", "float64"):
        model = load(args.model, dtype=dtype).model
        tokens = 0
        t0 = time.perf_counter()
        for prompt in prompts:
            out = reference.greedy_generate(model, tok.encode(prompt), args.max_tokens)
            tokens += len(out.token_ids)
        result[f"reference_tokens_per_second_{dtype}"] = round(tokens / (time.perf_counter() - t0), 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
