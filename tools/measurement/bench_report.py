"""The report of ``spectrio bench``: a case's runs folded into its row, the agreement
with the reference, the text table, the machine's name and the memory floor."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from spectrio.models import load, reference
from spectrio.tools.measurement.bench_run import BREAKDOWN
from spectrio.tools.measurement.bench_speedup import Z_95, pooled_rate


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median tokens per second, with every run's figure and every
    run's samples attached, and the samples' pooled rate and its standard error."""
    ordered = sorted(runs, key=lambda r: float(r["tokens_per_second"]))
    row = dict(ordered[len(ordered) // 2])
    row["tokens_per_second_runs"] = [r["tokens_per_second"] for r in runs]
    row["samples"] = [s for r in runs for s in r["samples"]]
    rate, se = pooled_rate(row["samples"])
    row["tokens_per_second_pooled"] = round(rate, 1)
    row["tokens_per_second_se"] = None if se is None else round(se, 2)
    return row


def agreement(
    model: str, prompts: list[list[int]], outputs: list[list[int]], max_tokens: int
) -> float:
    loaded = load(model, dtype="float32")
    same = total = 0
    for prompt, got in zip(prompts, outputs, strict=False):
        want = reference.greedy_generate(loaded.model, prompt, max_tokens).token_ids
        n = min(len(want), len(got))
        first_diff = next((i for i in range(n) if want[i] != got[i]), n)
        same += first_diff
        total += len(want)
    return same / total if total else 1.0


def json_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row as ``--json`` writes it (no outputs, no raw traces)."""
    return {k: v for k, v in row.items() if k not in ("outputs", "_raw")}


def format_cell(value: object, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec)


def summary_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as an aligned text table, one line per case."""
    cols: list[tuple[str, int, Any]] = [
        ("batch", 5, lambda r: r["batch"]),
        ("k", 4, lambda r: "off" if r["k"] == 0 else r["k"]),
        ("lp", 4, lambda r: r["logprobs"]),
        ("tok/s", 9, lambda r: r["tokens_per_second"]),
        ("req/s", 8, lambda r: format_cell(r["requests_per_second"], ".2f")),
        ("ttft50", 8, lambda r: format_cell(r["ttft_ms"]["p50"], ".1f")),
        ("ttft99", 8, lambda r: format_cell(r["ttft_ms"]["p99"], ".1f")),
        ("itl50", 7, lambda r: format_cell(r["itl_ms"]["p50"], ".2f")),
        ("itl99", 7, lambda r: format_cell(r["itl_ms"]["p99"], ".2f")),
        ("acc_len", 7, lambda r: r["mean_accept_len"]),
        ("eff", 6, lambda r: format_cell(r["efficiency"], ".1%")),
        ("bubble", 6, lambda r: format_cell(r["bubble"], ".1%")),
        ("ovh", 6, lambda r: format_cell(r["overhead_share"], ".1%")),
        *[
            (f"{name[:5]}ms", 8, lambda r, n=name: format_cell(r["breakdown_ms"][n], ".3f"))
            for name in BREAKDOWN
        ],
        ("steps", 6, lambda r: r["pipeline_steps"]),
        ("rec B", 8, lambda r: r["record_bytes_per_step"]),
    ]
    lines = [" ".join(f"{name:>{w}}" for name, w, _ in cols)]
    for r in rows:
        lines.append(" ".join(f"{str(get(r)):>{w}}" for _, w, get in cols))
    accept = [
        f"batch={r['batch']} k={r['k']}: "
        + " ".join(f"{x:.3f}" for x in r["acceptance_per_position"])
        for r in rows
        if r["acceptance_per_position"]
    ]
    pooled = [
        f"batch={r['batch']} k={r['k']}: {r['tokens_per_second_pooled']:.1f}"
        f" ± {Z_95 * se:.1f} ({len(r['samples'])} samples)"
        for r in rows
        if (se := r.get("tokens_per_second_se")) is not None
    ]
    if pooled:
        lines.append("tokens/s pooled over every turn or run, ± its 95% interval:")
        lines += ["  " + p for p in pooled]
    if accept:
        lines.append("acceptance per draft position (conditional):")
        lines += ["  " + a for a in accept]
    chosen = [
        f"batch={r['batch']}: "
        + " ".join(f"k={k} {n / total:.0%}" for k, n in r["steps_by_k"].items())
        + (" (started from kept step times)" if r.get("timing_cache_warm") else " (cold)")
        for r in rows
        if r["k"] == "auto" and (total := sum(r["steps_by_k"].values()))
    ]
    if chosen:
        lines.append("adaptive k, share of decoding steps:")
        lines += ["  " + c for c in chosen]
    return "\n".join(lines)


class _Floor(msgspec.Struct, frozen=True):
    """The bench's ``memory`` keys of the floor (module docstring)."""

    read_gb_s: float
    read_method: str
    forward_weight_bytes: int
    floor_us_1row: float


def _block_bytes(model: str, dtype: str) -> int | None:
    """The weight bytes a forward reads when the runtime serves ``model`` (a GGUF file)
    from its quantized blocks; None when it serves float weights."""
    from spectrio.models.loading.loader import blocks_enabled, resolve_path

    if dtype != "float32" or not blocks_enabled() or model.startswith("synthetic"):
        return None
    path = resolve_path(model)
    if not path.is_file():
        return None
    from spectrio.models.loading.block_serving import served_weight_bytes
    from spectrio.models.loading.gguf_file import GGUFFile

    gguf = GGUFFile(path)
    return served_weight_bytes(gguf, gguf.config)


def memory_floor(model: str, dtype: str) -> _Floor:
    """The memory floor of ``model``'s forward, its bandwidth probed now."""
    from spectrio.core.config import RuntimeConfig
    from spectrio.models.loading.loader import model_config
    from spectrio.models.ops.memory_floor import floor_us, forward_bytes, read_bandwidth

    cfg = model_config(model)
    width = np.dtype(dtype).itemsize
    weights = forward_bytes(
        cfg, [], weight_bytes=width, kv_bytes=width, weights_total=_block_bytes(model, dtype)
    )
    probe = read_bandwidth(threads=RuntimeConfig().resolve_num_threads())
    return _Floor(
        read_gb_s=probe.best_gb_s,
        read_method=probe.method,
        forward_weight_bytes=weights,
        floor_us_1row=round(floor_us(weights, probe), 1),
    )


def machine_name() -> str:
    cores = os.cpu_count()
    return f"{platform.machine()} {platform.processor() or ''} cores={cores}".strip()
