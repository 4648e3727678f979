"""``spectrio bench --plot``: one PNG with three panels per run of cases.

* inter-token latency histogram (gap between consecutive deltas of a request), one
  outline per case, log-scaled counts so the tail shows;
* acceptance per draft position (conditional: among steps whose earlier drafts were
  all accepted), one line per speculating case;
* a step timeline: per case, the device's busy intervals (draft, verify, sample in
  their own colours) over the first :data:`TIMELINE_SECONDS` of the measured window,
  so gaps between steps (bubbles) are visible; thin bars below and above them show the
  host's schedule and publish intervals, so overlap with the device shows too.

Matplotlib runs headless (Agg); nothing here is imported unless ``--plot`` is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen first)

from spectrio.core.timing import StepTiming  # noqa: E402

TIMELINE_SECONDS = 0.25
"""Width of the timeline window: long enough for tens of 2-10 ms steps, short enough
that a 100 us bubble is still a visible gap."""

PHASES = (("draft", "tab:orange"), ("verify", "tab:blue"), ("sample", "tab:green"))
HOST = (("schedule", "dimgray", -0.45), ("publish", "tab:purple", 0.3))  # name, colour, y


def _label(row: dict[str, Any]) -> str:
    k = "off" if row["k"] == 0 else row["k"]
    lp = "" if row["logprobs"] == "off" else f" lp={row['logprobs']}"
    return f"b={row['batch']} k={k}{lp}"


def timeline_bars(
    timings: Sequence[StepTiming], t0: float, window: float = TIMELINE_SECONDS
) -> dict[str, list[tuple[float, float]]]:
    """Per phase, ``(start_ms, width_ms)`` of every step interval that starts within
    ``window`` seconds of ``t0`` (pure: the figure's data)."""
    names = [name for name, _ in PHASES] + [name for name, _, _ in HOST]
    out: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for t in timings:
        if t.device_start - t0 > window:
            break
        spans = {
            "draft": (t.device_start, t.draft_end),
            "verify": (t.draft_end, t.verify_end),
            "sample": (t.verify_end, t.device_end),
            "schedule": (t.plan_start, t.planned_at),
            "publish": (t.publish_start, t.publish_end),
        }
        for name, (a, b) in spans.items():
            if b > a:
                out[name].append(((a - t0) * 1e3, (b - a) * 1e3))
    return out


def plot_rows(rows: Sequence[dict[str, Any]], path: str, title: str = "") -> None:
    """Write the figure for ``rows`` (``run_case`` results, ``_raw`` included) to ``path``."""
    fig, (ax_itl, ax_acc, ax_time) = plt.subplots(
        3, 1, figsize=(10, 4 + 3 + 0.4 * max(4, len(rows))), constrained_layout=True
    )
    for row in rows:
        itl = [g * 1e3 for tr in row["_raw"]["traces"] for g in tr.itls]
        if itl:
            ax_itl.hist(itl, bins=60, histtype="step", label=_label(row))
    ax_itl.set_xlabel("inter-token latency (ms, between deltas)")
    ax_itl.set_ylabel("deltas")
    ax_itl.set_yscale("log")
    ax_itl.set_title("inter-token latency")
    if any(row["_raw"]["traces"] for row in rows):
        ax_itl.legend(fontsize="small", ncol=2)

    speculating = [row for row in rows if row["acceptance_per_position"]]
    for row in speculating:
        rates = row["acceptance_per_position"]
        ax_acc.plot(range(1, len(rates) + 1), rates, marker="o", label=_label(row))
    ax_acc.set_xlabel("draft position")
    ax_acc.set_ylabel("accepted (given earlier drafts accepted)")
    ax_acc.set_ylim(0, 1.05)
    ax_acc.set_title("acceptance per draft position")
    if speculating:
        ax_acc.legend(fontsize="small", ncol=2)
        ax_acc.set_xticks(range(1, max(len(r["acceptance_per_position"]) for r in speculating) + 1))

    labels = []
    if not any(row["_raw"]["timings"] for row in rows):
        ax_time.text(
            0.5, 0.5, "no step timings from this runtime", ha="center", transform=ax_time.transAxes
        )
    for i, row in enumerate(rows):
        bars = timeline_bars(row["_raw"]["timings"], row["_raw"]["t0"])
        for name, colour in PHASES:
            ax_time.broken_barh(
                bars[name], (i - 0.3, 0.6), color=colour, label=name if i == 0 else None
            )
        for name, colour, y in HOST:
            ax_time.broken_barh(
                bars[name], (i + y, 0.15), color=colour, label=name if i == 0 else None
            )
        labels.append(_label(row))
    ax_time.set_yticks(range(len(rows)), labels)
    ax_time.set_xlabel(f"ms since the first arrival (first {TIMELINE_SECONDS * 1e3:.0f} ms)")
    ax_time.set_title("device busy intervals per step (gaps: idle)")
    if rows:
        ax_time.legend(fontsize="small", loc="upper right")
    if title:
        fig.suptitle(title, fontsize="small")
    fig.savefig(path, dpi=110)
    plt.close(fig)
