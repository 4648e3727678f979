"""asyncio embedding: the same Runtime, run as a Trio guest on the asyncio event loop.

``trio.lowlevel.start_guest_run`` drives Trio from asyncio's loop on the same thread,
so asyncio code and Trio code hand each other work with plain non-blocking calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from spectrio.runtime.api import Delta, Runtime, open_runtime
from spectrio.runtime.config import RuntimeConfig
from spectrio.runtime.params import SamplingParams

_END = object()


@dataclasses.dataclass
class _Job:
    prompt: str | Sequence[int]
    params: SamplingParams | None
    request_id: str | None
    queue: asyncio.Queue[Any]
    scope: trio.CancelScope = dataclasses.field(default_factory=trio.CancelScope)


class AsyncioRuntime:
    """What :func:`open_runtime_asyncio` yields; ``generate`` is an asyncio async iterator."""

    def __init__(self, runtime: Runtime, jobs: trio.MemorySendChannel[_Job], token: trio.lowlevel.TrioToken) -> None:
        self.runtime = runtime
        self._jobs = jobs
        self._token = token

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> AsyncIterator[Delta]:
        """Stream deltas. Breaking out or being cancelled aborts the request in the runtime."""
        job = _Job(prompt, params, request_id, asyncio.Queue())
        self._token.run_sync_soon(self._jobs.send_nowait, job)
        finished = False
        try:
            while True:
                item = await job.queue.get()
                if item is _END:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
        finally:
            if not finished:
                self._token.run_sync_soon(job.scope.cancel)

    async def abort(self, request_id: str) -> None:
        self._token.run_sync_soon(lambda: trio.lowlevel.spawn_system_task(self.runtime.abort, request_id))


async def _run_job(rt: Runtime, job: _Job) -> None:
    try:
        with job.scope:
            async for delta in rt.generate(job.prompt, job.params, request_id=job.request_id):
                job.queue.put_nowait(delta)
        job.queue.put_nowait(_END)
    except Exception as exc:  # handed to the asyncio caller, who re-raises it
        job.queue.put_nowait(exc)


@asynccontextmanager
async def open_runtime_asyncio(
    config: RuntimeConfig | None = None, *, encoded_channels: bool = False
) -> AsyncIterator[AsyncioRuntime]:
    """asyncio counterpart of :func:`spectrio.open_runtime`."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[tuple[AsyncioRuntime, trio.Event]] = loop.create_future()
    done: asyncio.Future[Any] = loop.create_future()

    async def trio_main() -> None:
        async with open_runtime(config, encoded_channels=encoded_channels) as rt:
            jobs_tx, jobs_rx = trio.open_memory_channel[_Job](math.inf)
            stop = trio.Event()
            ready.set_result((AsyncioRuntime(rt, jobs_tx, trio.lowlevel.current_trio_token()), stop))
            async with trio.open_nursery() as nursery:

                async def serve() -> None:
                    async for job in jobs_rx:
                        nursery.start_soon(_run_job, rt, job)

                nursery.start_soon(serve)
                await stop.wait()
                nursery.cancel_scope.cancel()

    def on_done(outcome: Any) -> None:
        if not ready.done():
            try:
                outcome.unwrap()
                ready.set_exception(RuntimeError("the runtime stopped before it started"))
            except BaseException as exc:  # start-up failure surfaces to the caller
                ready.set_exception(exc)
        done.set_result(outcome)

    trio.lowlevel.start_guest_run(
        trio_main,
        run_sync_soon_threadsafe=loop.call_soon_threadsafe,
        done_callback=on_done,
        host_uses_signal_set_wakeup_fd=True,
    )
    aio_rt, stop = await ready
    try:
        yield aio_rt
    finally:
        aio_rt._token.run_sync_soon(stop.set)
        (await done).unwrap()
