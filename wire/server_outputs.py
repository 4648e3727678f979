"""The wire server's output side: each published step sliced to its destinations and
queued in their outboxes, the sockets' owner tasks that send them, the supervisor that
ends the requests of a destination that stopped reading, the drain at shutdown and the
engine's death step (``docs/wire.md``, *Transport*)."""

from __future__ import annotations

import collections
from collections.abc import Sequence

import trio

from spectrio.core.messages import PublishedStep
from spectrio.core.record import unpack
from spectrio.errors import EngineDead
from spectrio.wire.codec import (
    encode_step,
    slice_step,
)
from spectrio.wire.outbox import RECONNECT_S, Outbox
from spectrio.wire.schema import (
    Error,
    ErrorCode,
)
from spectrio.wire.server_state import (
    DEFAULT_FINISH_S,
    MAX_ENDED,
    PUSH,
    RETRY_S,
    STALL_REASON,
    ServerState,
    _cancel_when_set,
    _label,
    death_step,
    engine_dead_reason,
    log,
)
from spectrio.wire.zmq_transport import TrioSocket


class OutputSide(ServerState):
    """Steps out to the consumers (module docstring)."""

    async def on_step(self, published: PublishedStep) -> None:
        """Record sink: queue the step for every destination with a request in it. Never
        waits (module docstring: no consumer holds another)."""
        self._route_step(published)

    def _route_step(self, published: PublishedStep, errors: Sequence[Error] = ()) -> None:
        """Slice ``published`` to each destination's requests and queue one message for
        each; the whole step goes to the tap. ``errors`` name requests the step ends with
        an error (the engine's death); requests ended for stalled outputs get theirs."""
        record = unpack(published.record)  # once, for the counter and every slice
        seqnos = self._counter.advance(published, record)
        self._last_step = max(self._last_step, published.step)
        errs = {e.request_id: e for e in errors}
        slots: dict[bytes, list[int]] = {}
        for i, (rid, reason) in enumerate(
            zip(published.request_ids, published.finish_reasons, strict=True)
        ):
            dest = self._dest.get(rid)
            if dest is None:
                continue  # not a wire request: HTTP or in-process
            slots.setdefault(dest, []).append(i)
            if reason is not None or rid in errs:  # its final slot
                del self._dest[rid]
                stalled = self._stalled.pop(rid, None)
                if stalled is not None:
                    errs.setdefault(rid, stalled)
        now = trio.current_time()
        for dest, mine in slots.items():
            part = slice_step(published, mine, record)
            frames = encode_step(
                part,
                [seqnos[i] for i in mine],
                [errs[r] for r in part.request_ids if r in errs],
            )
            box = self._outbox(dest)
            box.push(frames, now)
            self.stats.max_backlog = max(self.stats.max_backlog, len(box))
        if self._tap_enabled:
            try:
                self._tap_tx.send_nowait(encode_step(published, seqnos, list(errs.values())))
            except trio.WouldBlock:
                self.stats.tap_dropped += 1
        if slots:
            self._wake()

    @property
    def backlog(self) -> int:
        """Messages queued for any destination and not yet handed to its socket."""
        return sum(len(box) for box in self._outboxes.values())

    def outbox(self, dest: bytes = PUSH) -> Outbox | None:
        """The outbox of a destination (a client's routing id; PUSH by default), for tests
        and diagnostics."""
        return self._outboxes.get(dest)

    async def run_outputs(self, sock: TrioSocket) -> None:
        """The PUSH socket's owner task: hand its outbox's messages over, oldest first."""
        box = self._outboxes[PUSH]
        while True:
            frames = box.head()
            if frames is None:
                await self._changed.wait()
                continue
            if sock.try_send_multipart(frames):
                box.sent(trio.current_time())
                self.stats.steps_published += 1
                self._wake()
                await trio.lowlevel.checkpoint()
                continue
            with trio.move_on_after(RETRY_S):  # no reader, or its queue is full
                await self._changed.wait()

    async def run_tap(self, sock: TrioSocket) -> None:
        async for frames in self._tap_rx:
            await sock.send_multipart(frames)  # PUB never blocks; it drops at its HWM

    async def run_supervisor(self) -> None:
        """End the requests of destinations that stopped reading, and forget destinations
        with nothing left (the bounds of :class:`~spectrio.wire.outbox.Outbox`)."""
        tick = min(0.25, self._stall_s / 4)
        while True:
            with trio.move_on_after(tick):
                await self._supervise.wait()
            self._supervise = trio.Event()
            await self._supervise_once(trio.current_time())

    async def _supervise_once(self, now: float) -> None:
        running: collections.Counter[bytes] = collections.Counter(self._dest.values())
        for dest, box in list(self._outboxes.items()):
            if box.stalled(now):
                ended = [
                    r
                    for r, d in self._dest.items()
                    if d == dest and r in self._running and r not in self._stalled
                ]
                if box.stalled_at is None or ended:
                    await self._end_stalled(dest, box, ended, now)
            if box.abandoned(now, running[dest]):
                dropped = box.drop_all()
                self.stats.steps_dropped += dropped
                log.warning(
                    "wire outputs dropped: nobody read them",
                    destination=_label(dest),
                    messages=dropped,
                )
                self._wake()
            if dest != PUSH and running[dest] == 0 and (box.gone or not box):
                del self._outboxes[dest]
                self._owners.pop(dest, None)

    async def _end_stalled(self, dest: bytes, box: Outbox, ended: list[str], now: float) -> None:
        """Abort the running requests of a destination that stopped reading; each one's
        final step carries an ``output_stalled`` error, and its owner can read the error
        by aborting it later (:meth:`_abort`)."""
        if box.stalled_at is None:
            box.stalled_at = now
        if box.gone:
            reason = "the connection that submitted it closed"
        elif box.unreachable_since is not None:
            reason = f"its connection closed and did not come back for {RECONNECT_S:g} s"
        elif box.full():
            reason = f"{len(box)} of its step messages were not read"
        else:
            reason = f"its step messages were not read for {box.waited(now):.1f} s"
        if ended:
            log.warning(
                "wire outputs stalled: ending their requests",
                destination=_label(dest),
                requests=len(ended),
                reason=reason,
            )
        for rid in ended:
            error = self._error(ErrorCode.OUTPUT_STALLED, f"ended: {reason}", rid)
            self._stalled[rid] = error
            self._ended[rid] = (self._running[rid], error)
            while len(self._ended) > MAX_ENDED:
                self._ended.popitem(last=False)
            self.stats.requests_stalled += 1
            await self.runtime.abort(rid, STALL_REASON)

    async def _all_handed_over(self) -> None:
        """Wait until every destination that reads has an empty queue (sent, or dropped):
        one that stalled, closed or is gone would hold the wait, and the sockets' linger
        that the readers' last messages need, until the deadline."""
        while True:
            now = trio.current_time()
            if not any(len(box) and not box.stalled(now) for box in self._outboxes.values()):
                return
            with trio.move_on_after(0.1):  # a queue may stall without any event
                await self._changed.wait()

    async def drain(
        self,
        grace_s: float,
        *,
        cut: trio.Event | None = None,
        finish_s: float = DEFAULT_FINISH_S,
    ) -> bool:
        """Shut down without losing an accepted request. Stop admitting requests (new
        submits, and prompts still being tokenized, get ``unavailable``); let the running
        ones finish for up to ``grace_s`` seconds, or until ``cut`` is set (a second
        signal); then, within ``finish_s`` more seconds whatever happens, abort the rest
        with reason ``shutdown``, wait for the runtime to publish their abort step and hand
        every queued message to its socket (the PUSH socket, or the client's connection),
        which keeps unsent messages for what remains of ``finish_s`` when it closes.
        Returns True when every request finished on its own and everything was handed
        over; cancel :func:`serve` afterwards."""
        self.close()
        self._prompts.cancel_all()
        with trio.move_on_after(grace_s):
            async with trio.open_nursery() as grace:
                if cut is not None:
                    grace.start_soon(_cancel_when_set, cut, grace.cancel_scope)
                while self._running:
                    await self._finished.wait()
                grace.cancel_scope.cancel()
        deadline = trio.current_time() + finish_s
        cut_ids = sorted(self._running)
        with trio.move_on_at(deadline):
            for rid in cut_ids:
                await self.runtime.abort(rid, "shutdown")
            await self.runtime.wait_idle()  # the abort step carries -9 for each of them
            while self._running:
                await self._finished.wait()
            await self._all_handed_over()
        self._linger_s = max(0.0, deadline - trio.current_time())
        clean = not cut_ids and not self._running and not self.backlog
        log.info(
            "drained" if clean else "drained with aborts",
            aborted=len(cut_ids),
            running=len(self._running),
            backlog=self.backlog,
        )
        return clean

    async def watch_engine(self, finish_s: float = DEFAULT_FINISH_S) -> None:
        """When the engine dies, tell every consumer: :meth:`publish_engine_death`."""
        await self.publish_engine_death(await self.runtime.wait_dead(), finish_s)

    async def publish_engine_death(
        self, exc: EngineDead, finish_s: float = DEFAULT_FINISH_S
    ) -> None:
        """The engine is dead: stop taking requests (``unavailable``, the reason naming the
        stage), and publish one last step in which every request still open ends with
        ``finish_reason="abort"`` (a ``-9`` slot) and an ``unavailable`` error in the
        envelope's ``errors``, whose reason starts with ``engine_dead``. Returns once that
        step is handed to every destination's socket, or after ``finish_s`` seconds; the
        sockets then keep it for what remains of them when they close."""
        self._dead = exc
        deadline = trio.current_time() + finish_s
        self._prompts.cancel_all()  # prompts being tokenized get unavailable
        with trio.move_on_at(deadline):
            while self._running:  # every stream has the death; wait for them to see it
                await self._finished.wait()
            # Streams that saw the death, and requests whose abort step never went out.
            ids = sorted(set(self._lost) | set(self._dest))
            if ids:
                reason = engine_dead_reason(exc)
                errors = [
                    Error(code=ErrorCode.UNAVAILABLE, reason=reason, request_id=r) for r in ids
                ]
                self._route_step(death_step(self._last_step + 1, ids), errors)
                self.stats.errors[ErrorCode.UNAVAILABLE.value] = self.stats.errors.get(
                    ErrorCode.UNAVAILABLE.value, 0
                ) + len(ids)
            log.error("engine dead: open requests aborted", requests=len(ids), cause=str(exc))
            await self._all_handed_over()
        self._closing = True
        self._wake()
        self._linger_s = max(0.0, deadline - trio.current_time())
        self.death_published.set()
