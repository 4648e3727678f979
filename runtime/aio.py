"""asyncio embedding: the same Runtime, run as a Trio guest on the asyncio event loop.

``trio.lowlevel.start_guest_run`` drives Trio from asyncio's loop on the same thread,
so asyncio code and Trio code hand each other work with plain non-blocking calls: an
asyncio stream hands its request to Trio with ``TrioToken.run_sync_soon``, and a Trio
task per request puts each :class:`Delta` into the stream's ``asyncio.Queue``.

The semantics are Trio's (:func:`spectrio.open_runtime`):

* leaving the ``async with`` block ends every running stream with a final delta
  (``finish_reason="abort"``, ``abort_reason="shutdown"``); a stream asked for after
  that raises ``RuntimeError``;
* a stage failure raises :class:`~spectrio.EngineDead` in every waiting task, as in
  Trio; a task waiting on a stream that can get no more output for another reason (the
  Trio run itself died) is cancelled the asyncio way, with ``asyncio.CancelledError``;
* ``generate`` and ``chat`` check and submit at once; ``abort`` returns a bool; ``wait_idle``,
  ``stats`` and ``step_timings`` are Trio's; one asyncio runtime runs per thread (guest
  mode allows one Trio run per thread), a second one raises ``SpectrioError``;
* leaving a stream's ``async with`` block, ``aclose()`` or cancelling its consumer aborts
  the request at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import trio

from spectrio.core.config import RuntimeConfig
from spectrio.core.messages import RuntimeStats
from spectrio.core.params import SamplingParams, check_cache_salt
from spectrio.core.timing import StepTiming
from spectrio.errors import SpectrioError
from spectrio.runtime.api import Delta, Runtime, open_runtime
from spectrio.runtime.health import Health
from spectrio.runtime.streams import abort_delta

T = TypeVar("T")

__all__ = ["AsyncioRequestStream", "AsyncioRuntime", "open_runtime_asyncio"]

_END = object()  # the Trio side is done with this stream: no more items
_GONE = object()  # the Trio run ended without ending this stream


@dataclasses.dataclass
class _Job:
    prompt: object
    params: object
    request_id: str
    queue: asyncio.Queue[Any]
    cache_salt: str = ""
    scope: trio.CancelScope = dataclasses.field(default_factory=trio.CancelScope)
    ended: bool = False  # the Trio side put its last item (_END or an exception)

    def end(self, last: object) -> None:
        self.ended = True
        self.queue.put_nowait(last)


class AsyncioRequestStream:
    """One request's output on the asyncio side, as :meth:`AsyncioRuntime.generate`
    returns it: an async iterator of :class:`Delta` and an async context manager whose
    exit, like :meth:`aclose`, aborts the request if it has not finished."""

    def __init__(
        self,
        bridge: AsyncioRuntime,
        prompt: object,
        params: object,
        request_id: str | None,
        *,
        chat: bool = False,
        cache_salt: str = "",
    ) -> None:
        self._job: _Job | None = None
        self._done = False
        self._bridge = bridge
        self._args = (prompt, params)
        self._chat = chat  # the prompt is a message list (AsyncioRuntime.chat)
        self._cache_salt = cache_salt
        self.request_id = uuid.uuid4().hex if request_id is None else request_id
        self._start()  # checked and submitted now, as the Trio API does

    @property
    def finished(self) -> bool:
        return self._done

    def _start(self) -> _Job:
        if self._job is None:
            self._job = self._bridge._submit(
                *self._args, self.request_id, chat=self._chat, cache_salt=self._cache_salt
            )
            self._bridge._streams.add(self)
        return self._job

    async def __aenter__(self) -> AsyncioRequestStream:
        self._start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def __aiter__(self) -> AsyncioRequestStream:
        return self

    async def __anext__(self) -> Delta:
        job = self._start()
        if self._done:
            raise StopAsyncIteration
        try:
            item = await job.queue.get()
        except BaseException:  # cancelled while waiting: the consumer is gone
            self.close()
            raise
        if isinstance(item, Delta):
            return item
        self._done = True
        self._bridge._streams.discard(self)
        if item is _END:
            raise StopAsyncIteration
        if item is _GONE:
            # No output will ever come: cancel the waiting task, as asyncio would.
            task = asyncio.current_task()
            assert task is not None
            task.cancel("the spectrio runtime stopped")
            await asyncio.sleep(0)
            raise asyncio.CancelledError("the spectrio runtime stopped")
        assert isinstance(item, BaseException)
        raise item

    def close(self) -> None:
        """Stop the stream now; if its request is running, it is aborted. Idempotent."""
        if self._done:
            return
        self._done = True
        self._bridge._streams.discard(self)
        if self._job is not None and not self._job.ended:
            self._bridge._cancel(self._job)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        # Dropped unfinished (no ``async with``, no aclose): abort the request.
        if not self._done and self._job is not None and not self._job.ended:
            self._bridge._cancel(self._job)


class AsyncioRuntime:
    """What :func:`open_runtime_asyncio` yields; ``generate`` returns an asyncio
    :class:`AsyncioRequestStream`."""

    def __init__(
        self, runtime: Runtime, jobs: trio.MemorySendChannel[_Job], token: trio.lowlevel.TrioToken
    ) -> None:
        self.runtime = runtime
        self._jobs = jobs
        self._token = token
        self._closed = False  # the bridge is being left: no new requests
        # Started and not ended; weak, so a stream dropped unfinished is finalised (and
        # its request aborted) by ``AsyncioRequestStream.__del__``.
        self._streams: weakref.WeakSet[AsyncioRequestStream] = weakref.WeakSet()

    def generate(
        self,
        prompt: str | Sequence[int] | Sequence[Mapping[str, object]],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str = "",
    ) -> AsyncioRequestStream:
        """Start a request; see :meth:`spectrio.Runtime.generate`. Use the stream as an
        async context manager (``async with rt.generate(...) as stream:``) so that leaving
        the block aborts the request at once. The request is checked and submitted when
        ``generate`` is called: :class:`~spectrio.InvalidRequest` for a bad request,
        :class:`~spectrio.EngineDead` if the engine failed, ``RuntimeError`` once the
        runtime is shut down."""
        return AsyncioRequestStream(self, prompt, params, request_id, cache_salt=cache_salt)

    def chat(
        self,
        messages: Sequence[Mapping[str, object]],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str = "",
    ) -> AsyncioRequestStream:
        """Start a chat request; see :meth:`spectrio.Runtime.chat` (the same rendering,
        stop tokens and refusals). ``generate`` given a list of messages does the same."""
        return AsyncioRequestStream(
            self, messages, params, request_id, chat=True, cache_salt=cache_salt
        )

    def _submit(
        self,
        prompt: object,
        params: object,
        request_id: str,
        *,
        chat: bool = False,
        cache_salt: str = "",
    ) -> _Job:
        if self.runtime._dead is not None:
            raise self.runtime._dead
        if self._closed:
            raise RuntimeError("the runtime is not running")
        # Checked here, on the caller's side, so a bad request raises where it is made; a
        # chat is rendered here too, and its job carries the rendered ids and stop tokens.
        ids, checked, rid = self.runtime._prepare(prompt, params, request_id, chat=chat)
        self.runtime._check_not_running(rid)
        job = _Job(ids, checked, rid, asyncio.Queue(), check_cache_salt(cache_salt))
        try:
            self._token.run_sync_soon(self._enqueue, job)
        except trio.RunFinishedError:
            raise RuntimeError("the runtime is not running") from None
        return job

    def _enqueue(self, job: _Job) -> None:  # in Trio
        try:
            self._jobs.send_nowait(job)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            _end_at_shutdown(job)

    def _cancel(self, job: _Job) -> None:
        try:
            self._token.run_sync_soon(job.scope.cancel)
        except trio.RunFinishedError:
            pass  # nothing is running any more

    def _orphan(self) -> None:
        """The Trio run is over: every stream it did not end gets :data:`_GONE`."""
        for stream in list(self._streams):
            job = stream._job
            if job is not None and not job.ended:
                job.end(_GONE)

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn()`` in the Trio run and await its result (or exception) in asyncio."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()

        async def call() -> None:
            try:
                value = await fn()
            except BaseException as exc:
                if not future.done():
                    future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
            else:
                if not future.done():
                    future.set_result(value)

        try:
            self._token.run_sync_soon(lambda: trio.lowlevel.spawn_system_task(call))
        except trio.RunFinishedError:
            raise RuntimeError("the runtime is not running") from None
        return await future

    async def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Abort a request; the same contract and result as :meth:`spectrio.Runtime.abort`
        (False for an unknown or finished request, and once the runtime has stopped)."""
        try:
            return await self._call(lambda: self.runtime.abort(request_id, reason))
        except RuntimeError:
            return False

    async def wait_idle(self) -> None:
        """:meth:`spectrio.Runtime.wait_idle`: until nothing is queued, running or in flight."""
        await self._call(self.runtime.wait_idle)

    def stats(self) -> RuntimeStats:
        """:meth:`spectrio.Runtime.stats` (Trio runs on this thread: a plain call)."""
        return self.runtime.stats()

    def step_timings(self) -> list[StepTiming]:
        """:meth:`spectrio.Runtime.step_timings`."""
        return self.runtime.step_timings()

    def health(self) -> Health:
        """:meth:`spectrio.Runtime.health`: whether the pipeline is making progress."""
        return self.runtime.health()


def _end_at_shutdown(job: _Job) -> None:
    """A request handed over while the bridge shut down ends as running ones do."""
    job.queue.put_nowait(abort_delta(job.request_id, "shutdown"))
    job.end(_END)


async def _run_job(rt: Runtime, job: _Job) -> None:
    if rt._closed:
        _end_at_shutdown(job)
        return
    try:
        with job.scope:
            async with rt.generate(
                job.prompt,  # type: ignore[arg-type]
                job.params,  # type: ignore[arg-type]
                request_id=job.request_id,
                cache_salt=job.cache_salt,
            ) as stream:
                async for delta in stream:
                    job.queue.put_nowait(delta)
        job.end(_END)
    except Exception as exc:  # handed to the asyncio caller, who re-raises it
        job.end(exc)


@asynccontextmanager
async def open_runtime_asyncio(
    config: RuntimeConfig | None = None, *, encoded_channels: bool = False
) -> AsyncIterator[AsyncioRuntime]:
    """asyncio counterpart of :func:`spectrio.open_runtime`, with the same semantics.

    On exit every running stream gets its final delta (``finish_reason="abort"``,
    ``abort_reason="shutdown"``) and then ends; the Trio run is then over."""
    loop = asyncio.get_running_loop()
    thread = threading.get_ident()
    if thread in _BRIDGED_THREADS:
        raise SpectrioError(
            "a spectrio asyncio runtime already runs in this thread: Trio's guest mode runs "
            "one Trio run per thread, so share that runtime (or open one in another thread)"
        )
    _BRIDGED_THREADS.add(thread)
    try:
        async with _bridge(loop, config, encoded_channels) as aio_rt:
            yield aio_rt
    finally:
        _BRIDGED_THREADS.discard(thread)


_BRIDGED_THREADS: set[int] = set()


@asynccontextmanager
async def _bridge(
    loop: asyncio.AbstractEventLoop, config: RuntimeConfig | None, encoded_channels: bool
) -> AsyncIterator[AsyncioRuntime]:
    ready: asyncio.Future[tuple[AsyncioRuntime, trio.Event]] = loop.create_future()
    done: asyncio.Future[Any] = loop.create_future()
    bridge: list[AsyncioRuntime] = []

    async def trio_main() -> None:
        async with open_runtime(config, encoded_channels=encoded_channels) as rt:
            jobs_tx, jobs_rx = trio.open_memory_channel[_Job](math.inf)
            stop = trio.Event()
            bridge.append(AsyncioRuntime(rt, jobs_tx, trio.lowlevel.current_trio_token()))
            ready.set_result((bridge[0], stop))
            async with trio.open_nursery() as nursery:

                async def serve() -> None:
                    async for job in jobs_rx:
                        nursery.start_soon(_run_job, rt, job)

                nursery.start_soon(serve)
                await stop.wait()
                # As open_runtime's exit does, but before the job tasks are gone: every
                # stream gets its final abort delta, which its job task forwards.
                rt._shutdown("shutdown")
                jobs_tx.close()  # jobs still queued are refused: the runtime is closed
                nursery.cancel_scope.deadline = trio.current_time() + 10.0

    def on_done(outcome: Any) -> None:
        if not ready.done():
            try:
                outcome.unwrap()
                ready.set_exception(RuntimeError("the runtime stopped before it started"))
            except BaseException as exc:  # start-up failure surfaces to the caller
                ready.set_exception(exc)
        if bridge:
            bridge[0]._closed = True
            bridge[0]._orphan()
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
        aio_rt._closed = True
        try:
            aio_rt._token.run_sync_soon(stop.set)
        except trio.RunFinishedError:
            pass  # the run already ended (it failed); its outcome says why
        (await done).unwrap()
