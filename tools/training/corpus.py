"""The training corpus: the Python standard library's own ``.py`` sources.

It exists on every machine with CPython. Files are split deterministically by a
hash of their path relative to the stdlib root: about 10% are held out and never
trained on. Test suites and installed third-party packages are excluded because
their presence varies between installations.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from spectrio.models import TextTokenizer

EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
HELD_OUT_BUCKETS = 10  # one bucket in ten is held out


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str) -> bool:
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "little") % HELD_OUT_BUCKETS == 0


def corpus_files(split: str, root: Path | None = None) -> list[Path]:
    """Sorted files of ``split`` ("train" or "heldout")."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = root or stdlib_root()
    want_held_out = split == "heldout"
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts):
            continue
        if is_held_out(rel.as_posix()) == want_held_out:
            out.append(path)
    return out


def read_texts(files: list[Path]) -> Iterator[str]:
    for path in files:
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def held_out_contexts(
    tokenizer: TextTokenizer | None, count: int, length: int, seed: int
) -> np.ndarray:
    """``count`` windows of ``length`` tokens from the held-out files, at random offsets."""
    assert tokenizer is not None, "held-out contexts need the checkpoint's tokenizer"
    texts = read_texts(corpus_files("heldout"))
    streams = [np.asarray(tokenizer.encode(t), dtype=np.int64) for t in texts]
    streams = [s for s in streams if s.size > length]
    weights = np.array([s.size - length for s in streams], dtype=np.float64)
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(streams), size=count, p=weights / weights.sum())
    return np.stack(
        [
            streams[i][o : o + length]
            for i, o in ((i, int(rng.integers(0, streams[i].size - length))) for i in picks)
        ]
    )
