"""Per-destination output queues of the wire server: pure state, no sockets, no Trio.

A destination is one client connection (its step messages and replies travel back on
the connection that submitted the requests, schema 1.7) or the shared PUSH outputs
socket (requests submitted without ``stream``). Each has an :class:`Outbox`: the
messages not yet handed to its socket, in order. The server's socket owner tasks send
from the head; nothing here waits.

The invariants the server builds on:

* **Nothing is dropped while it can still be read.** A step message stays queued until
  the socket takes it. Only an outbox that is :meth:`Outbox.abandoned` (its destination
  is gone for good, or it stalled, nothing of it still runs, and it read nothing for
  :data:`DROP_AFTER` times ``stall_s`` more) is emptied, and every message dropped is
  counted.
* **Bounded in time.** An outbox is *stalled* when its oldest message has waited
  ``stall_s`` seconds: its destination reads nothing, or reads slower than its requests
  produce. The server then ends that destination's running requests (and only those),
  which frees their KV blocks.
* **Bounded in memory.** An outbox is stalled as well once it holds ``limit`` messages;
  its final messages (the abort step of the requests ended for it) are still queued, so
  at most ``limit`` plus one step per running request of it are kept.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

__all__ = ["DROP_AFTER", "RECONNECT_S", "Outbox", "OutboxStats"]

RECONNECT_S = 2.0
"""Seconds a connection that closed under a routing id of its client's choosing has to
come back (a transport reconnect takes libzmq about 0.1 s) before it counts as stalled."""

DROP_AFTER = 3
"""An outbox whose requests were ended keeps their messages this many times ``stall_s``
longer before they are dropped."""


@dataclass
class OutboxStats:
    """Counters of one outbox, for logs and tests."""

    queued: int = 0  # messages queued, ever
    sent: int = 0  # messages handed to the socket
    dropped: int = 0  # messages dropped with an abandoned outbox
    max_depth: int = 0  # most messages queued at once


@dataclass
class Outbox:
    """The undelivered messages of one destination, oldest first, each with the time it
    was queued. ``limit`` and ``stall_s`` bound it (module docstring)."""

    limit: int
    stall_s: float
    _queue: collections.deque[tuple[list[bytes], float]] = field(default_factory=collections.deque)
    stats: OutboxStats = field(default_factory=OutboxStats)
    stalled_at: float | None = None  # when the server ended this destination's requests
    gone: bool = False  # the destination can never read again (a closed connection)
    unreachable_since: float | None = None  # its connection is closed; it may come back
    progress_at: float | None = None  # when a message was last handed over after a stall

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, frames: list[bytes], now: float) -> None:
        """Queue one message (never refused: the bounds act on requests, not messages)."""
        if self.gone:
            self.stats.dropped += 1
            return
        self._queue.append((frames, now))
        self.stats.queued += 1
        self.stats.max_depth = max(self.stats.max_depth, len(self._queue))

    def head(self) -> list[bytes] | None:
        """The oldest undelivered message, or None."""
        return self._queue[0][0] if self._queue else None

    def sent(self, now: float | None = None) -> None:
        """The head was handed to the socket (at ``now``). Progress clears a stall once
        the queue is empty; until then it postpones the drop (:meth:`abandoned`)."""
        self._queue.popleft()
        self.stats.sent += 1
        self.unreachable_since = None
        if not self._queue:
            self.stalled_at = None
            self.progress_at = None
        elif self.stalled_at is not None and now is not None:
            self.progress_at = now

    def full(self) -> bool:
        """Whether it holds ``limit`` messages or more (a new request is refused)."""
        return len(self._queue) >= self.limit

    def waited(self, now: float) -> float:
        """Seconds the oldest message has waited (0 when empty)."""
        return now - self._queue[0][1] if self._queue else 0.0

    def unreachable(self, now: float) -> None:
        """Its connection is closed (a send found no peer); it may reconnect."""
        if self.unreachable_since is None:
            self.unreachable_since = now

    def stalled(self, now: float) -> bool:
        """Whether its destination has fallen behind for good: the oldest message has
        waited ``stall_s`` seconds, or ``limit`` messages are queued, or it is gone, or
        its connection closed and has not come back for :data:`RECONNECT_S`."""
        if self.gone:
            return True
        grace = min(RECONNECT_S, self.stall_s)
        if self.unreachable_since is not None and now - self.unreachable_since >= grace:
            return True
        return bool(self._queue) and (self.full() or self.waited(now) >= self.stall_s)

    def abandoned(self, now: float, running: int) -> bool:
        """Whether to drop what it holds: its destination is gone, or it stalled, none of
        its requests still runs, and it has made no progress for :data:`DROP_AFTER`
        times ``stall_s`` since its requests were ended (time for a client that resumes
        to read how they ended)."""
        if not self._queue:
            return False
        if self.gone:
            return True
        if running or self.stalled_at is None:
            return False
        since = max(self.stalled_at, self.progress_at or self.stalled_at)
        return now - since >= DROP_AFTER * self.stall_s

    def drop_all(self) -> int:
        """Empty it; returns how many messages were dropped (also counted)."""
        n = len(self._queue)
        self._queue.clear()
        self.stats.dropped += n
        self.stalled_at = None  # a later stall is a new one, with its own grace
        self.unreachable_since = None
        return n

    @property
    def handed_over(self) -> int:
        """Messages that left the outbox, sent or dropped."""
        return self.stats.sent + self.stats.dropped
