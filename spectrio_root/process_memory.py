"""The process's memory: what it holds (the start-up report, the bench summary) and
handing freed memory back to the system. In the top-level package, as
:mod:`spectrio.cache_dir` is, because ``models`` (below everything) uses it too."""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys
from typing import Any

__all__ = ["peak_rss_bytes", "rss_bytes", "trim_freed_memory"]


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


_libc: Any = None


def trim_freed_memory() -> None:
    """Ask glibc to give freed heap pages back to the system (``malloc_trim(0)``); a
    no-op elsewhere. Needed after freeing many mid-sized buffers: once one large block
    has been freed, glibc serves blocks of that size from its heap instead of separate
    mappings, and keeps them resident after ``free`` until trimmed."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
        except OSError:
            _libc = False
    trim = getattr(_libc, "malloc_trim", None) if _libc else None
    if trim is not None:
        trim(0)
