"""A wake-up for tasks that re-check a condition whenever something may have changed."""

from __future__ import annotations

import trio

__all__ = ["Notifier"]


class Notifier:
    """Every task waiting in :meth:`wait` wakes at the next :meth:`notify`; a task that
    starts waiting after it waits for the one after. (A ``trio.Event`` is set once:
    this one sets its event and replaces it.) Waiters re-check their own condition, so a
    notify with nobody waiting is simply lost."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        await self._event.wait()
