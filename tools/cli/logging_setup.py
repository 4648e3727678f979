"""structlog configuration for the CLI and tools (never for the library).

Importing spectrio, or running a runtime, configures no logging: an application that
embeds spectrio keeps control of its own logs (structlog's and the standard library's).
Only entry points call :func:`configure_logging`.

Logs go to stderr, as console lines or one JSON object per line (``--log-format``).
While a tqdm progress bar is on the terminal, a log line is written through
``tqdm.write``, which clears the bar, writes the line and redraws the bar below it, so
the two never end up on one line.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any, Final, TextIO

import structlog

__all__ = ["LOG_FORMATS", "BarAwareLogger", "configure_logging", "split_logging_flags"]

LOG_FORMATS: Final = ("console", "json")


class BarAwareLogger:
    """A structlog logger that writes each rendered line to stderr (looked up per line,
    so a redirected stderr is honoured), through ``tqdm.write`` while a bar is shown."""

    def __init__(self, file: TextIO | None = None) -> None:
        self._file = file

    def msg(self, message: str) -> None:
        out = self._file if self._file is not None else sys.stderr
        tqdm_module = sys.modules.get("tqdm")  # never imported just to log
        bar = getattr(tqdm_module, "tqdm", None)
        if bar is not None and getattr(bar, "_instances", None):
            bar.write(message, file=out)
            return
        out.write(message + "\n")
        out.flush()

    log = debug = info = warn = warning = error = critical = exception = fatal = msg


def _bar_aware_factory(*args: Any) -> BarAwareLogger:
    return BarAwareLogger()


def configure_logging(level: str = "info", fmt: str = "console") -> None:
    """Log to stderr at ``level`` as ``fmt`` (``console`` or ``json``); context (request
    id, step, stage, rank) comes from binds. Raises ``ValueError`` for an unknown level
    or format."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    if fmt not in LOG_FORMATS:
        raise ValueError(f"unknown log format {fmt!r} (one of {', '.join(LOG_FORMATS)})")
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso"),
    ]
    if fmt == "json":
        processors.append(structlog.processors.format_exc_info)
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=_bar_aware_factory,
        cache_logger_on_first_use=False,
    )


_OPTIONS: Final = ("--log-level", "--log-format")


def split_logging_flags(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """``argv`` without ``--log-level X`` / ``--log-format X`` (also ``--opt=X``),
    wherever they are, before or after the command, and the values found (the last one
    wins). Nothing after ``--`` is touched. A flag without its value is left in place,
    for argparse to report."""
    rest: list[str] = []
    found: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest += argv[i:]
            break
        name, eq, value = arg.partition("=")
        if name in _OPTIONS:
            key = name[2:].replace("-", "_")
            if eq:
                found[key] = value
                i += 1
                continue
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                found[key] = argv[i + 1]
                i += 2
                continue
        rest.append(arg)
        i += 1
    return rest, found
