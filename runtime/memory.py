"""What the process holds in memory, for the start-up report and the bench summary."""

from __future__ import annotations

import resource
import sys

__all__ = ["peak_rss_bytes", "rss_bytes"]


def rss_bytes() -> int:
    """Resident set size now (``VmRSS``); 0 where ``/proc`` is unavailable."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_rss_bytes() -> int:
    """The most this process has ever held resident (``ru_maxrss``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS: bytes; Linux: KiB
