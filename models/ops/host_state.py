"""What a library import may change in its host process, saved and put back.

Importing Paddle (3.x) changes the host process behind Python's back:

* It installs C-level handlers for SIGTERM, SIGSEGV, SIGILL, SIGABRT, SIGBUS and SIGFPE
  (its fatal-error banner) with ``sigaction``. Python never learns of it:
  ``signal.getsignal`` still reports the host's handler, but a SIGTERM now kills the
  process with Paddle's banner instead of calling it, and ``faulthandler`` is switched off.
* It configures the root logger (level INFO and a stderr handler), so the host's later
  ``logging.basicConfig`` does nothing.

:func:`host_state_kept` saves both before the import and restores them after it. Signal
dispositions are saved and restored as whole ``struct sigaction`` values through libc
(on Linux), which puts back exactly what was there: Python's own trampoline (so the
host's Python handlers run again), ``faulthandler``'s handlers, ``SIG_IGN`` or
``SIG_DFL``. Elsewhere the Python-level handlers are re-installed with
:func:`signal.signal` (main thread only), which re-installs Python's trampoline.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["HostState", "host_state_kept"]


class _Sigaction(ctypes.Structure):
    """glibc's ``struct sigaction`` on Linux (x86-64 and aarch64 share the layout), with
    spare room at the end so a larger one could never be written past."""

    _fields_ = [
        ("handler", ctypes.c_void_p),
        ("mask", ctypes.c_ulong * 16),
        ("flags", ctypes.c_int),
        ("restorer", ctypes.c_void_p),
        ("_spare", ctypes.c_char * 64),
    ]


def _key(act: _Sigaction) -> tuple[object, ...]:
    """The fields of a disposition that the kernel keeps: the handler, the first word of
    the mask (the kernel's signal set is 64 bits; libc leaves the rest undefined), the
    flags and the restorer."""
    return (act.handler, act.mask[0], act.flags, act.restorer)


def _libc_sigaction() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sigaction
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_SIGACTION = _libc_sigaction()

# Every catchable signal; SIGKILL and SIGSTOP cannot be changed by anyone.
_SIGNALS = sorted(
    int(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)
)


@dataclass
class _Logger:
    level: int
    handlers: list[logging.Handler]
    disabled: bool
    manager_disable: int


class HostState:
    """A snapshot of the process state a library import may change: every signal's
    disposition and the root logger. :meth:`restore` puts back what differs."""

    def __init__(self) -> None:
        self._actions: dict[int, _Sigaction] = {}
        if _SIGACTION is not None:
            for signum in _SIGNALS:
                act = _Sigaction()
                if _SIGACTION(signum, None, ctypes.byref(act)) == 0:
                    self._actions[signum] = act
        self._python: dict[int, Any] = {}
        for signum in _SIGNALS:
            try:
                self._python[signum] = signal.getsignal(signum)
            except (OSError, ValueError):
                pass
        root = logging.getLogger()
        self._root = _Logger(
            root.level, list(root.handlers), root.disabled, logging.root.manager.disable
        )

    def changed_signals(self) -> list[int]:
        """Signals whose disposition differs from this snapshot now."""
        now = HostState()
        if self._actions:
            return [
                s
                for s, act in self._actions.items()
                if s not in now._actions or _key(now._actions[s]) != _key(act)
            ]
        return [s for s, h in self._python.items() if now._python.get(s) is not h]

    def restore(self) -> None:
        """Put back every signal disposition that changed, and the root logger."""
        changed = self.changed_signals()
        if self._actions:
            for signum in changed:
                _SIGACTION(signum, ctypes.byref(self._actions[signum]), None)
        elif threading.current_thread() is threading.main_thread():
            # No libc access: re-install the handlers Python knows of, which re-installs
            # Python's trampoline for the host's own handlers.
            for signum, handler in self._python.items():
                if callable(handler) or signum in (signal.SIGTERM, signal.SIGINT):
                    if handler is not None:
                        signal.signal(signum, handler)
        root = logging.getLogger()
        saved = self._root
        for handler in list(root.handlers):
            if handler not in saved.handlers:
                root.removeHandler(handler)
        for handler in saved.handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(saved.level)
        root.disabled = saved.disabled
        logging.root.manager.disable = saved.manager_disable


@contextmanager
def host_state_kept() -> Iterator[HostState]:
    """Run the block (a library import), then restore the signal dispositions and the
    root logger it changed."""
    state = HostState()
    try:
        yield state
    finally:
        state.restore()
