"""Regenerate ``tests/data/bundled_golden.json`` from the bundled checkpoint.

The golden continuation is what the reference generator (dense attention, one token at
a time, float64) emits for a fixed prompt. Run this, and commit the file, whenever the
bundled model changes: ``python tests/regen_golden.py``. Never edit the file by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

GOLDEN_PATH = Path(__file__).resolve().parent / "data" / "bundled_golden.json"
PROMPT = "def fib(n):"
NUM_TOKENS = 24


def main() -> int:
    from spectrio.models import load, reference

    loaded = load("bundled", dtype="float64")
    assert loaded.tokenizer is not None
    out = reference.greedy_generate(loaded.model, loaded.tokenizer.encode(PROMPT), NUM_TOKENS)
    GOLDEN_PATH.parent.mkdir(exist_ok=True)
    GOLDEN_PATH.write_text(
        json.dumps(
            {
                "prompt": PROMPT,
                "token_ids": out.token_ids,
                "text": loaded.tokenizer.decode(out.token_ids),
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {GOLDEN_PATH}: {out.token_ids}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
