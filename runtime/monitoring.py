"""What a :class:`~spectrio.runtime.engine.Runtime` tells about itself: counters and
gauges (``stats``, ``metrics``, ``step_timings``), its health and the watchdog that logs
its changes, and the watch on tensor-parallel followers. A mixin of the runtime: its
methods read the runtime's state and change none of it (the watchers fail the engine
through the runtime)."""

from __future__ import annotations

import collections
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import msgspec
import structlog
import trio

from spectrio.core.config import RuntimeConfig
from spectrio.core.messages import (
    PublishedStep,
    RuntimeStats,
)
from spectrio.core.timing import StepTiming, device_summary
from spectrio.errors import EngineDead
from spectrio.runtime.health import Health, judge_health
from spectrio.runtime.timing_cache import KeptTimings
from spectrio.runtime.tp import TPGroup
from spectrio.stages.planning.block_manager import BlockManager
from spectrio.stages.planning.scheduler import Scheduler
from spectrio.stages.planning.scheduler_actor import (
    SchedulerActor,
    StageFailure,
)

log = structlog.get_logger("spectrio.runtime")

_WATCHDOG_POLL_S = 0.5  # the watchdog's longest look interval (shorter for small thresholds)


class _SinkEntry(NamedTuple):
    """A record sink and the name the watchdog and :meth:`Runtime.health` give it."""

    sink: Callable[[PublishedStep], Awaitable[None]]
    name: str


class _SinkWait(NamedTuple):
    """One await of one sink by the publisher: an episode for the watchdog."""

    name: str
    since: float  # time.monotonic() when the await began
    episode: int


def _callable_name(fn: object) -> str:
    """A callable's ``__qualname__`` (a bound method's is ``Class.method``), else its repr."""
    name = getattr(fn, "__qualname__", None)
    return name if isinstance(name, str) and name else repr(fn)


class RuntimeMonitoring:
    """The runtime's introspection and watchers (module docstring). The attributes are
    the runtime's (:class:`~spectrio.runtime.engine.Runtime` sets them)."""

    config: RuntimeConfig
    blocks: BlockManager
    num_steps: int
    _actor: SchedulerActor
    _kept_timings: KeptTimings
    _events_tx: trio.MemorySendChannel[object] | None
    _dead: EngineDead | None
    _awaiting: _SinkWait | None
    _warned_episode: int
    _watch_scope: trio.CancelScope
    _health_scope: trio.CancelScope
    _timings: collections.deque[StepTiming]
    _stopped: trio.Event
    _paused: bool
    _open_seqs: set[int]
    _last_step_at: float | None
    _active_since: float | None

    def _fail(self, exc: EngineDead) -> None:
        raise NotImplementedError  # the runtime's: every waiting caller gets ``exc``

    async def _watch_followers(self, group: TPGroup) -> None:
        """Poll the follower processes this runtime started: one that exits fails the
        engine at once (every waiting caller gets :class:`EngineDead` naming its rank)
        and ends the scheduler, whatever the device thread is blocked on."""
        with self._watch_scope:
            while True:
                dead = group.dead_rank()
                if dead is not None:
                    rank, what = dead
                    log.error("tensor-parallel follower died", rank=rank, detail=what)
                    exc = EngineDead(f"rank {rank}", what)
                    self._fail(exc)
                    if self._events_tx is not None:
                        try:
                            self._events_tx.send_nowait(StageFailure(f"rank {rank}", exc))
                        except (trio.ClosedResourceError, trio.BrokenResourceError):
                            pass
                    return
                await trio.sleep(0.2)

    async def _watchdog(self) -> None:
        """Until the stages end: log, once per episode, a record sink that has held the
        publisher for longer than ``config.sink_warn_s`` (a warning naming the sink; an
        info line when it lets go, from :meth:`_publish`), and each change of
        :meth:`health` between healthy and not (a warning with the reason; an info line
        when healthy again)."""
        interval = min(_WATCHDOG_POLL_S, self.config.sink_warn_s / 2)
        wlog = log.bind(task="watchdog", stall_timeout_s=self.config.stall_timeout_s)
        unhealthy: str | None = None  # the cause last logged
        with self._health_scope:
            while True:
                await trio.sleep(interval)
                wait = self._awaiting
                if wait is not None and wait.episode != self._warned_episode:
                    held = time.monotonic() - wait.since
                    if held > self.config.sink_warn_s:
                        self._warned_episode = wait.episode
                        wlog.warning(
                            "record sink holds the publisher",
                            sink=wait.name,
                            held_s=round(held, 3),
                            warn_s=self.config.sink_warn_s,
                        )
                health = self.health()
                if not health.ok and health.cause != unhealthy:
                    unhealthy = health.cause
                    wlog.warning(
                        "runtime unhealthy",
                        cause=health.cause,
                        reason=health.reason,
                        open_requests=health.open_requests,
                    )
                elif health.ok and unhealthy is not None:
                    unhealthy = None
                    wlog.info("runtime healthy again", open_requests=health.open_requests)

    # ---- introspection ----------------------------------------------------------------

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler actor's state, for tests and research tools to read; the runtime
        itself only talks to the actor."""
        return self._actor.scheduler

    @property
    def timing_cache_buckets(self) -> list[int]:
        """The batch buckets whose step times the adaptive policy started from (kept by
        an earlier run); empty: it started cold."""
        return self._kept_timings.buckets

    @property
    def num_drafts_proposed(self) -> int:
        """Drafts proposed so far (the scheduler's count: :meth:`stats`)."""
        return self._actor.view().acceptance.proposed

    @property
    def num_drafts_accepted(self) -> int:
        """Drafts accepted so far (the scheduler's count: :meth:`stats`)."""
        return self._actor.view().acceptance.accepted

    def stats(self) -> RuntimeStats:
        """Counters and gauges of the runtime now."""
        sched = self._actor.view()
        acceptance = sched.acceptance  # counted where results are folded in
        k = self.config.speculative.effective_num_model_steps
        return RuntimeStats(
            running=sched.running,
            waiting=sched.waiting,
            num_kv_blocks=self.blocks.num_blocks,
            free_kv_blocks=self.blocks.num_free_blocks,
            num_steps=self.num_steps,
            num_preemptions=sched.num_preemptions,
            drafts_proposed=acceptance.proposed,
            drafts_accepted=acceptance.accepted,
            accepted_per_position=(acceptance.accepted_at + [0] * k)[:k],
            proposed_per_position=(acceptance.proposed_at + [0] * k)[:k],
            finished=sched.finished,
            steps_by_k=sched.steps_by_k,
            prefix_cache_queries=self.blocks.stats.queries,
            prefix_cache_hits=self.blocks.stats.hits,
            cached_kv_blocks=self.blocks.num_cached_blocks,
            prefix_cache_evictions=self.blocks.stats.evictions,
        )

    def health(self) -> Health:
        """Whether this runtime's requests can progress now (rules:
        :mod:`spectrio.runtime.health`): not while the engine is dead or the stages have
        ended, nor while the publisher has awaited one record sink for longer than
        ``config.stall_timeout_s``, nor while requests are open and no step has
        completed for that long (counted from the later of the last step and the moment
        the runtime went from no open request to some, or resumed; never while paused).
        ``open_requests`` counts every front's requests (HTTP, wire, embedding) accepted
        and not yet given their final result. Cheap, and safe to call at any time on
        the runtime's Trio thread."""
        wait = self._awaiting
        return judge_health(
            now=time.monotonic(),
            stall_timeout_s=self.config.stall_timeout_s,
            open_requests=len(self._open_seqs),
            last_step_at=self._last_step_at,
            active_since=self._active_since,
            sink=None if wait is None else wait.name,
            sink_since=None if wait is None else wait.since,
            dead=None if self._dead is None else str(self._dead),
            stopped=self._stopped.is_set(),
            paused=self._paused,
        )

    def metrics(self) -> dict[str, object]:
        """A plain snapshot of what ``spectrio serve --metrics`` exports that the runtime
        itself knows: :meth:`stats` as a dict, plus the mean accepted tokens per step and
        the acceptance rate overall and per draft position, and the last steps' device
        figures (``device_summary`` over the timings ring)."""
        stats = self.stats()
        snapshot: dict[str, object] = msgspec.structs.asdict(stats)
        snapshot["acceptance_rate"] = (
            stats.drafts_accepted / stats.drafts_proposed if stats.drafts_proposed else None
        )
        snapshot["acceptance_per_position"] = [
            a / p if p else None
            for a, p in zip(stats.accepted_per_position, stats.proposed_per_position, strict=True)
        ]
        snapshot["prefix_cache_hit_rate"] = stats.prefix_cache_hit_rate
        timings = self.step_timings()
        if timings:
            wall = timings[-1].device_end - timings[0].device_start
            snapshot["device"] = device_summary(timings, wall)
        return snapshot

    def step_timings(self) -> list[StepTiming]:
        """The published steps' timings, oldest first: the last 4,096 steps (a ring, so a
        long-running server does not grow; read it at least that often)."""
        return list(self._timings)
