"""MTP draft quality on held-out files: agreement with the target's own greedy tokens.

For random contexts cut from the held-out split, the target picks its greedy
continuation g1, g2, ... and the MTP layer drafts d2, d3, ... (substep j feeds its own
hidden state and token into substep j+1). Reported per substep:

- ``agreement``: share of contexts where d_j equals the target's g_j;
- ``accepted``: share where every draft up to j matched (what greedy verification keeps).

``num_model_steps = n`` uses substeps 1..n; ``mean_accept_len`` is the expected tokens
emitted per verify step with n drafts (accepted drafts plus the target's own token).

Run: ``python -m spectrio.tools.eval_mtp [--model bundled] [--contexts 512]``.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from tqdm import tqdm

from spectrio.models import load, reference
from spectrio.tools.corpus import corpus_files, read_texts
from spectrio.tools.logging_setup import configure_logging


def held_out_contexts(tokenizer: object, count: int, length: int, seed: int) -> np.ndarray:
    """``count`` windows of ``length`` tokens from the held-out files, at random offsets."""
    streams = [np.asarray(tokenizer.encode(t), dtype=np.int64) for t in read_texts(corpus_files("heldout"))]  # type: ignore[attr-defined]
    streams = [s for s in streams if s.size > length]
    weights = np.array([s.size - length for s in streams], dtype=np.float64)
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(streams), size=count, p=weights / weights.sum())
    return np.stack([
        streams[i][o : o + length]
        for i, o in ((i, int(rng.integers(0, streams[i].size - length))) for i in picks)
    ])


def evaluate(model_name: str, dtype: str, count: int, length: int, max_steps: int, batch: int, seed: int) -> dict[str, object]:
    loaded = load(model_name, dtype=dtype)
    contexts = held_out_contexts(loaded.tokenizer, count, length, seed)
    matches = []
    t0 = time.perf_counter()
    for start in tqdm(range(0, count, batch), desc="eval", unit="batch"):
        target, drafts = reference.greedy_mtp_drafts(loaded.model, contexts[start : start + batch].tolist(), max_steps)
        matches.append(drafts == target[:, 1:])
    hits = np.concatenate(matches)  # [count, max_steps]
    prefix = np.cumprod(hits, axis=1)
    by_steps = {}
    for n in range(1, max_steps + 1):
        by_steps[str(n)] = {
            "agreement": [round(float(x), 4) for x in hits[:, :n].mean(0)],
            "accepted": [round(float(x), 4) for x in prefix[:, :n].mean(0)],
            "mean_accept_len": round(1.0 + float(prefix[:, :n].sum(1).mean()), 4),
        }
    return {
        "model": str(loaded.path),
        "dtype": dtype,
        "contexts": count,
        "context_len": length,
        "seconds": round(time.perf_counter() - t0, 1),
        "num_model_steps": by_steps,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bundled")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    p.add_argument("--contexts", type=int, default=512)
    p.add_argument("--context-len", type=int, default=96)
    p.add_argument("--max-steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    configure_logging("warning")
    result = evaluate(args.model, args.dtype, args.contexts, args.context_len, args.max_steps, args.batch, args.seed)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
