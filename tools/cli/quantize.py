"""``spectrio quantize IN OUT --type TYPE``: a GGUF file from a GGUF file or a Hugging Face
folder, its weights in one of llama.cpp's types (docs/quantize.md)."""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import defaultdict
from typing import Any

_LAYER = re.compile(r"blk\.(\d+)\.(.+)")

TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
    "Q4_K_M", "Q5_K_M",
)  # fmt: skip
"""``spectrio.models.loading.gguf_quantize.QUANT_TYPES``, spelled out so that building the CLI's
parsers does not import ``gguf`` (``tests/test_quantize.py`` keeps the two equal)."""


def add_quantize_parser(sub: Any) -> None:
    p = sub.add_parser(
        "quantize",
        help="write a GGUF file (llama.cpp's format) in a quantized type, from a GGUF file "
        "or a Hugging Face folder",
        description="Write IN (a .gguf file, a Hugging Face folder, or a name: smollm2, "
        "bundled) as the GGUF file OUT with its weights in TYPE. Q4_K_M and Q5_K_M are "
        "llama.cpp's mixes; a tensor whose rows the type's block does not divide falls "
        "back to a type whose block does, and is named in the log. See docs/quantize.md.",
    )
    p.add_argument(
        "src", metavar="IN", help="a .gguf file, a Hugging Face folder, 'smollm2' or 'bundled'"
    )
    p.add_argument("out", metavar="OUT", help="the .gguf file to write (replaced if it exists)")
    p.add_argument(
        "--type", dest="qtype", required=True, choices=TYPES, metavar="TYPE",
        help=f"the weights' type: {', '.join(TYPES)}",
    )  # fmt: skip
    p.set_defaults(func=_quantize)


def _quantize(args: argparse.Namespace) -> int:
    import structlog
    from tqdm import tqdm

    from spectrio.errors import CheckpointError, ModelConfigError
    from spectrio.models.loading.gguf_write import TensorDone, write_gguf
    from spectrio.models.loading.loader import NAMED_MODELS, resolve_path

    log = structlog.get_logger("spectrio.tools.cli.quantize")
    t0 = time.perf_counter()
    bar = tqdm(desc="quantize", unit="tensor", disable=None, leave=False)

    def done(tensor: TensorDone) -> None:
        bar.update(1)
        bar.set_postfix_str(tensor.name, refresh=False)

    try:
        src = resolve_path(args.src) if args.src in NAMED_MODELS else args.src
        result = write_gguf(src, args.out, args.qtype, on_tensor=done)
    except (CheckpointError, ModelConfigError, OSError) as exc:
        # OSError: the output cannot be written (no space, no permission); it names the file
        bar.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    bar.close()
    for (wanted, used, row), names in _fallback_groups(result.fallbacks).items():
        log.warning(
            "type fell back: row length not a multiple of its block",
            wanted=wanted,
            used=used,
            row_length=row,
            tensors=_compact(names),
        )
    types = ", ".join(f"{n} {name}" for name, n in result.types.items())
    seconds = time.perf_counter() - t0
    print(
        f"{result.path}: {result.bytes / 1e6:.1f} MB, {result.target} ({types}) in {seconds:.1f} s"
    )
    return 0


def _fallback_groups(
    fallbacks: list[tuple[str, str, str, int]],
) -> dict[tuple[str, str, int], list[str]]:
    groups: dict[tuple[str, str, int], list[str]] = defaultdict(list)
    for name, wanted, used, row in fallbacks:
        groups[(wanted, used, row)].append(name)
    return dict(groups)


def _compact(names: list[str]) -> str:
    """Tensor names with their layers folded: ``blk.{0-2,5}.attn_v.weight``, one entry per
    part, so that a 30-layer model's fallbacks fit on a line."""
    layers: dict[str, list[int]] = defaultdict(list)
    other: list[str] = []
    for name in names:
        match = _LAYER.fullmatch(name)
        if match:
            layers[match.group(2)].append(int(match.group(1)))
        else:
            other.append(name)
    parts = other + [f"blk.{{{_ranges(sorted(ids))}}}.{part}" for part, ids in layers.items()]
    return ", ".join(parts)


def _ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
