"""The running pipeline, :class:`Runtime`: its stages' assembly (the scheduler actor, the
device worker, the publisher), the streams it feeds, aborts, pause and shutdown. Its
introspection is :mod:`.monitoring`, its request checks :mod:`.request_checks`, and what
callers read :mod:`.streams`; :func:`spectrio.runtime.api.open_runtime` builds one."""

from __future__ import annotations

import collections
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import suppress

import structlog
import trio

from spectrio.core.acceptance import Acceptance
from spectrio.core.channels import ChannelSender, open_channel
from spectrio.core.config import ConfigError, RuntimeConfig
from spectrio.core.messages import (
    AbortRequest,
    Control,
    PublishedStep,
    SeqResult,
    StepResult,
)
from spectrio.core.notifier import Notifier
from spectrio.core.params import (
    SamplingParams,
)
from spectrio.core.timing import StepTiming
from spectrio.errors import CheckpointError, EngineDead
from spectrio.models import LoadedModel
from spectrio.models.text.chat import ChatTemplate, chat_template_for
from spectrio.process_memory import peak_rss_bytes, rss_bytes
from spectrio.runtime.device_worker import DeviceWorker
from spectrio.runtime.kv_sizing import (
    check_checkpoint,
    check_draft,
    draft_kv_layers,
    num_kv_blocks,
)
from spectrio.runtime.monitoring import RuntimeMonitoring, _callable_name, _SinkEntry, _SinkWait
from spectrio.runtime.request_checks import RuntimeRequests
from spectrio.runtime.streams import Delta, OpenRequest, RequestStream, abort_delta
from spectrio.runtime.timing_cache import KeptTimings
from spectrio.runtime.tp import TPGroup, make_workspace
from spectrio.stages.device.grammar import GrammarCompiler
from spectrio.stages.device.sampler import Sampler
from spectrio.stages.device.workspace import Workspace
from spectrio.stages.output.publisher import run_publisher
from spectrio.stages.planning.block_manager import BlockManager
from spectrio.stages.planning.scheduler import Scheduler
from spectrio.stages.planning.scheduler_actor import (
    ControlClosed,
    Resume,
    SchedulerActor,
    run_scheduler,
)

log = structlog.get_logger("spectrio.runtime")


class Runtime(RuntimeMonitoring, RuntimeRequests):
    """A running pipeline. Create it with :func:`open_runtime`."""

    def __init__(
        self,
        config: RuntimeConfig,
        loaded: LoadedModel,
        encoded_channels: bool,
        group: TPGroup | None = None,
        draft: LoadedModel | None = None,
    ) -> None:
        """``draft``: the loaded ``speculative.draft_model``, when one is named."""
        self.config = config
        self.draft = draft
        self._group = group
        self.loaded = loaded
        if loaded.tokenizer is None:
            raise ConfigError(f"model: {loaded.path} has no tokenizer.json")
        self.tokenizer = loaded.tokenizer
        self.chat_template, self._no_chat = _chat_template(loaded)
        # The template's end-of-turn tokens, found once: every chat request stops on them.
        #: the template's end-of-turn tokens (with EOS): a chat request stops at them
        self.chat_stop_ids = (
            [] if self.chat_template is None else self.chat_template.stop_token_ids()
        )
        cfg = loaded.config
        check_checkpoint(config, cfg)
        check_draft(config, cfg, draft, loaded.tokenizer)
        num_blocks = num_kv_blocks(config, cfg, None if draft is None else draft.config)
        # Structured output's compiler: requests are checked with it, the device worker's
        # grammar book builds its matchers with it. Its vocabulary index is built on the
        # first constrained request (spectrio serve builds it before serving): a runtime
        # that never constrains never pays for it, nor does its first token.
        self.grammar = GrammarCompiler(self.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
        self.blocks = BlockManager(
            num_blocks, config.block_size, enable_caching=config.enable_prefix_caching
        )
        self.workspace: Workspace = make_workspace(
            loaded.model,
            num_blocks,
            config.block_size,
            config.speculative,
            None if draft is None else draft.model,
            grammar=self.grammar,
        )
        # The scheduler's one owner; the runtime goes through it for everything.
        self._actor = SchedulerActor(Scheduler(config, self.blocks))
        self._kept_timings = KeptTimings(config, loaded.path, loaded.head_path)
        self._kept_timings.restore(self._actor)
        self.sampler = Sampler(cfg.vocab_size, self.tokenizer)
        self.worker = DeviceWorker(self.workspace, self.sampler, group=group)
        self._watch_scope = trio.CancelScope()
        self._observers: list[Callable[[PublishedStep], None]] = []
        self._sinks: list[_SinkEntry] = []
        self._encoded = encoded_channels
        self._control: ChannelSender[Control] | None = None
        self._events_tx: trio.MemorySendChannel[object] | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        # request id -> the sequence and stream of the request delivered to under that id
        self._requests: dict[str, OpenRequest] = {}
        # seq id -> (request id, stream, reason) of an abort handed to the scheduler actor
        # whose stream waits for its final ``abort`` delta (sent when the actor applies it)
        self._aborting: dict[
            int, tuple[str, trio.MemorySendChannel[Delta | SeqResult | EngineDead], str]
        ] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._dead: EngineDead | None = None
        self._died = trio.Event()
        self._changed = Notifier()  # whenever the pipeline may be idle
        self._stopped = trio.Event()  # every stage has ended
        self._paused = False
        self._timings: collections.deque[StepTiming] = collections.deque(maxlen=4096)
        self._unpublished: dict[int, StepTiming] = {}
        self.num_steps = 0  # pipeline steps published
        # Health (all times time.monotonic()): the requests accepted whose final result
        # has not been delivered (by sequence id), when the last step was delivered, when
        # the runtime last went from no open request to some (or resumed), and the sink
        # the publisher awaits now.
        self._open_seqs: set[int] = set()
        self._last_step_at: float | None = None
        self._active_since: float | None = None
        self._awaiting: _SinkWait | None = None
        self._sink_episodes = itertools.count(1)
        self._warned_episode = 0  # the last episode the watchdog logged
        self._health_scope = trio.CancelScope()

    # ---- assembly ---------------------------------------------------------------------

    async def _start(self, nursery: trio.Nursery) -> None:
        """Start the stages: the publisher, the scheduler actor, the device worker thread,
        and a task that forwards the control channel into the scheduler's event stream
        (its end becomes :class:`ControlClosed`)."""
        enc = self._encoded
        control_tx, control_rx = open_channel(Control, math.inf, enc)
        events_tx, events_rx = trio.open_memory_channel[object](math.inf)
        published_tx, published_rx = open_channel(StepResult, 1, enc)
        self._control, self._events_tx = control_tx, events_tx
        self._token = trio.lowlevel.current_trio_token()
        self.worker.start()

        async def pump_results() -> None:
            # Off the device's critical path: a Trio worker thread waits for results.
            while True:
                item = await trio.to_thread.run_sync(
                    self.worker.next_result, abandon_on_cancel=True
                )
                if item is None:  # the worker ended
                    return
                events_tx.send_nowait(item)

        async def forward_control() -> None:
            async for msg in control_rx:
                events_tx.send_nowait(msg)
            events_tx.send_nowait(ControlClosed())

        async def publisher() -> None:
            await self._guard(
                "publisher",
                run_publisher(
                    published_rx,
                    self._deliver,
                    self._publish,
                    prepare=self._actor.published,
                ),
            )

        async def scheduler() -> None:
            try:
                await self._guard(
                    "scheduler",
                    run_scheduler(
                        self._actor,
                        events_rx,
                        self.worker.submit,
                        published_tx,
                        on_idle_check=self._notify,
                        on_result=self._on_result,
                        on_aborted=self._on_aborted,
                        paused=lambda: self._paused,
                    ),
                )
            finally:
                published_tx.close()
                self.worker.stop()
                # A group's worker may be stuck in a collective with a dead peer: once the
                # engine is dead, wait for it only briefly (it is a daemon thread).
                wait = 30.0 if self._group is None or self._dead is None else 3.0
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(self.worker.join, wait)

        async def run_all() -> None:
            try:
                async with trio.open_nursery() as inner:
                    inner.start_soon(publisher)
                    inner.start_soon(forward_control)
                    inner.start_soon(pump_results)
                    inner.start_soon(scheduler)
            finally:
                self._watch_scope.cancel()
                self._health_scope.cancel()
                self._end_aborting()
                self._stopped.set()
                self._notify()

        nursery.start_soon(run_all)
        nursery.start_soon(self._watchdog)
        if self._group is not None and self._group.spawned:
            nursery.start_soon(self._watch_followers, self._group)
        cfg = self.loaded.config
        draft_layers = draft_kv_layers(
            self.config, cfg, None if self.draft is None else self.draft.config
        )
        kv_bytes = self.blocks.num_blocks * self.config.kv_bytes_per_block(
            cfg.num_hidden_layers + draft_layers,
            cfg.num_key_value_heads // self.config.tensor_parallel_size,
            cfg.head_dim,
        )
        log.info(
            "runtime started",
            num_kv_blocks=self.blocks.num_blocks,
            kv_cache_tokens=self.blocks.num_blocks * self.blocks.block_size,
            kv_cache_mib=round(kv_bytes / 2**20, 1),
            rss_mib=round(rss_bytes() / 2**20),
            peak_rss_mib=round(peak_rss_bytes() / 2**20),
            encoded=enc,
            overlap=self.config.enable_overlap,
            speculative=self.config.speculative.method,
            k=self.config.speculative.num_draft_tokens,
        )

    async def _guard(self, stage: str, body: Awaitable[None]) -> None:
        """Run a stage; if it raises, the engine is dead: every waiting caller gets
        :class:`EngineDead` naming the stage and the cause, and the other stages end."""
        try:
            await body
        except EngineDead as exc:
            self._fail(exc)
        except Exception as exc:
            log.exception("stage failed", stage=stage)
            self._fail(EngineDead(stage, exc))
            if self._control is not None:
                self._control.close()

    def _fail(self, exc: EngineDead) -> None:
        if self._dead is not None:
            return
        self._dead = exc
        self._died.set()
        self._closed = True
        for entry in self._requests.values():
            entry.stream.send_nowait(exc)
        for _, stream, _ in self._aborting.values():
            stream.send_nowait(exc)
        self._requests.clear()
        self._aborting.clear()
        self._open_seqs.clear()
        if self._control is not None:
            self._control.close()
        self._notify()

    def _on_result(self, result: StepResult, timing: StepTiming) -> None:
        self._unpublished[result.step] = timing

    async def wait_dead(self) -> EngineDead:
        """Wait until the engine dies (a stage or a tensor-parallel rank failed); returns
        its :class:`EngineDead`. A server uses it to stop at once rather than at the next
        request."""
        await self._died.wait()
        assert self._dead is not None
        return self._dead

    def _notify(self) -> None:
        """Wake ``wait_idle`` callers to re-check."""
        self._changed.notify()

    def _deliver(self, result: StepResult) -> None:
        timing = self._unpublished.pop(result.step, None)
        if timing is not None:
            timing.publish_start = time.perf_counter()
            self._timings.append(timing)
        self.num_steps += 1
        self._last_step_at = time.monotonic()
        for r in result.results:
            if r.finish_reason is not None:
                self._open_seqs.discard(r.seq_id)
            entry = self._requests.get(r.request_id)
            if entry is None or entry.seq_id != r.seq_id:  # ended, or its id reused since
                continue
            if r.token_ids or r.finish_reason or r.prompt_logprobs:
                entry.stream.send_nowait(r)
        self._notify()  # pause() waits for the last step in flight to be delivered

    def add_record_observer(self, observer: Callable[[PublishedStep], None]) -> Callable[[], None]:
        """Call ``observer`` with every step's packed record (:class:`PublishedStep`, layout in
        :mod:`spectrio.wire.record`) from now on. It runs in the publisher's task and must not
        block; an exception it raises is logged and otherwise ignored. Returns a function that
        removes the observer."""
        self._observers.append(observer)

        def remove() -> None:
            if observer in self._observers:
                self._observers.remove(observer)

        return remove

    def add_record_sink(
        self, sink: Callable[[PublishedStep], Awaitable[None]], *, name: str | None = None
    ) -> Callable[[], None]:
        """Await ``sink`` with every step's record from now on. Unlike an observer, a sink
        may take its time: the publisher waits for it, so a slow sink applies backpressure
        to the whole pipeline (nothing is dropped). A sink must return promptly once
        removed. Returns a function that removes it.

        ``name`` (default: the callable's ``__qualname__``) is how :meth:`health` and the
        watchdog's log lines name the sink while the publisher awaits it: a sink that
        holds the publisher longer than ``config.sink_warn_s`` is logged, and longer
        than ``config.stall_timeout_s`` makes the runtime unhealthy."""
        entry = _SinkEntry(sink, _callable_name(sink) if name is None else name)
        self._sinks.append(entry)

        def remove() -> None:
            for i, held in enumerate(self._sinks):
                if held is entry:
                    del self._sinks[i]
                    return

        return remove

    async def _publish(self, published: PublishedStep) -> None:
        for entry in list(self._sinks):
            wait = _SinkWait(entry.name, time.monotonic(), next(self._sink_episodes))
            self._awaiting = wait
            try:
                await entry.sink(published)
            finally:
                self._awaiting = None
                if self._warned_episode == wait.episode:
                    log.info(
                        "record sink let the publisher go",
                        sink=wait.name,
                        held_s=round(time.monotonic() - wait.since, 3),
                    )
        for observer in list(self._observers):
            try:
                observer(published)
            except Exception:
                log.exception("record observer failed", step=published.step)
        if self._timings and self._timings[-1].step == published.step:
            self._timings[-1].publish_end = time.perf_counter()

    def _release(self, request_id: str, seq_id: int, reason: str | None) -> None:
        """Forget a request's stream; with a ``reason``, abort it in the pipeline (its
        KV blocks are freed at the next plan). Does nothing if ``request_id`` now names
        another submission than ``seq_id``."""
        entry = self._requests.get(request_id)
        if entry is None or entry.seq_id != seq_id:
            return
        del self._requests[request_id]
        if reason is not None:
            self._send_abort(seq_id, reason)

    def _send_abort(self, seq_id: int, reason: str) -> bool:
        """Hand the abort to the scheduler actor over the control channel, behind the
        request's submission: the actor, the request state's one owner, applies it (its
        blocks are freed, no token of it computed by a step in flight is published from
        then on) and reports it in the next step. False when the pipeline is closing."""
        self._open_seqs.discard(seq_id)
        if self._control is None:
            return False
        try:
            self._control.send_nowait(AbortRequest(seq_id=seq_id, reason=reason))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return False  # the pipeline is closing: every stream gets its ending there
        return True

    def _on_aborted(self, seq_id: int, counted: Acceptance | None) -> None:
        """The scheduler actor applied an abort: its stream, if it waits, gets the final
        ``abort`` delta with the request's acceptance over its life."""
        entry = self._aborting.pop(seq_id, None)
        if entry is not None:
            request_id, stream, reason = entry
            stream.send_nowait(abort_delta(request_id, reason, counted))
        self._notify()

    def _end_aborting(self) -> None:
        """The stages ended: a stream still waiting for its abort to be applied gets its
        final delta now, without counts."""
        for request_id, stream, reason in self._aborting.values():
            stream.send_nowait(abort_delta(request_id, reason, None))
        self._aborting.clear()

    def _is_idle(self) -> bool:
        sched = self._actor.view()
        pending = 0
        if self._control is not None:
            pending = self._control.statistics().current_buffer_used
        if self._events_tx is not None:
            pending += self._events_tx.statistics().current_buffer_used
        return not (sched.has_work or sched.num_in_flight or pending or self._aborting)

    async def wait_idle(self) -> None:
        """Wait until no request is queued or running and no step is in flight, so every
        finished or aborted request's blocks are back in the pool. Cancellation is safe.
        Raises :class:`EngineDead` if the engine failed."""
        while True:
            if self._dead is not None:
                raise self._dead
            if self._is_idle() or self._stopped.is_set():
                return
            await self._changed.wait()

    @property
    def paused(self) -> bool:
        """True between :meth:`pause` and :meth:`resume`."""
        return self._paused

    async def pause(self) -> None:
        """Stop planning steps, and return once every step in flight has been delivered
        to its streams: the device is then idle until :meth:`resume`. Requests, aborts and
        ``close`` are still accepted while paused (a new request waits, an abort frees its
        blocks at once); nothing is lost. Pausing twice is the same as once. Raises
        :class:`EngineDead` if the engine failed.

        For a host that shares the machine between runtimes (``spectrio bench
        --interleave`` passes the CPU between the cases it compares): their steps then
        never run at the same time."""
        self._paused = True
        while self._actor.num_in_flight or self._unpublished:
            if self._dead is not None:
                raise self._dead
            if self._stopped.is_set():
                return
            await self._changed.wait()

    def resume(self) -> None:
        """Plan steps again after :meth:`pause`. Resuming a runtime that is not paused
        does nothing."""
        if not self._paused:
            return
        self._paused = False
        self._active_since = time.monotonic()  # a pause is no stall: count from now
        if self._events_tx is not None:
            with suppress(trio.ClosedResourceError, trio.BrokenResourceError):
                self._events_tx.send_nowait(Resume())

    async def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Abort a request: its stream ends with ``finish_reason="abort"`` and its KV
        blocks are freed. Once this returns, no further token of the request is delivered
        or published (tokens of steps in flight are dropped); the next published step
        stamps its slot ``-9`` with finish reason ``"abort"``. Returns False for an
        unknown or finished request."""
        entry = self._requests.get(request_id)
        if entry is None:
            return False
        seq_id = self._end_with_abort(request_id, entry, reason)
        while seq_id in self._aborting and not self._stopped.is_set():
            await self._changed.wait()  # until the actor has applied it
        return True

    def generate(
        self,
        prompt: str | Sequence[int] | Sequence[Mapping[str, object]],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str = "",
    ) -> RequestStream:
        """Start a request and return its :class:`RequestStream`: iterate it for one
        :class:`Delta` per step that emitted tokens. ``prompt`` is text, token ids, or a
        list of chat messages (dicts with ``role`` and ``content``), which runs as
        :meth:`chat` does.

        ``cache_salt`` isolates the request in the prefix cache: it shares cached KV
        blocks only with requests of the same salt (docs/embedding.md, *Prefix
        caching*). The default, empty, shares with every other unsalted request.

        Use it as an async context manager, so that leaving the block (``break``, an
        exception, cancellation) aborts the request at once and frees its KV blocks::

            async with rt.generate(prompt, params) as stream:
                async for delta in stream:
                    ...

        ``async for delta in rt.generate(...)`` works too, but a stream left unfinished
        and still referenced (``break`` out of a loop over a variable) keeps generating
        until ``await stream.aclose()`` or until it is garbage-collected.

        ``delta.text`` holds complete characters only. With ``params.stop`` strings, the
        last ``max(len(stop)) - 1`` characters are held back until the next step (or the
        finish), so text a stop string later cuts is never streamed. ``delta.logprobs``
        has one entry per token when ``params.logprobs`` is set (text, hold-back and the
        final delta's statistics: :mod:`spectrio.stages.output.output_processor`).

        The request is checked and submitted here, when ``generate`` is called: that
        raises :class:`InvalidRequest` for a bad prompt, parameters or request id (floats
        and bools are not token ids), :class:`EngineDead` if the engine failed, and
        ``RuntimeError`` once the runtime has shut down. If the engine fails while the
        stream runs, iterating it raises :class:`EngineDead`.
        """
        return RequestStream(self, prompt, params, request_id, cache_salt=cache_salt)

    def chat(
        self,
        messages: Sequence[Mapping[str, object]],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str = "",
    ) -> RequestStream:
        """Start a chat request: ``messages`` (dicts with a string ``role`` and a string
        ``content``; other keys reach the template) rendered by the model's chat template,
        and the assistant's answer streamed as :meth:`generate` streams a continuation.
        ``rt.generate(messages, params)`` does the same.

        The output equals :meth:`generate` on the rendered token ids
        (:meth:`chat_prompt`) with the template's end-of-turn tokens (``<|im_end|>``,
        ``<|eot_id|>``, ...) as stop tokens, which end the answer as EOS does: the
        last delta has ``finish_reason="stop"`` and the end-of-turn token as its last
        token id, and its text is not in ``delta.text``.

        Checked and submitted here, like :meth:`generate`: a malformed message list,
        a model without a chat template (``exc.code == "no_chat_template"``) or a
        template that refuses the messages raises :class:`InvalidRequest` on field
        ``messages``. Cancellation, closing and ``cache_salt`` behave as for
        :meth:`generate`."""
        return RequestStream(self, messages, params, request_id, chat=True, cache_salt=cache_salt)

    def _shutdown(self, reason: str) -> None:
        """End every stream with a final abort delta (``abort_reason=reason``) and abort
        its request; refuse new requests from now on. Calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        for rid, entry in list(self._requests.items()):
            self._end_with_abort(rid, entry, reason)

    def _end_with_abort(self, request_id: str, entry: OpenRequest, reason: str) -> int:
        """Abort a request and stop delivering to its stream, which gets its final
        ``abort`` delta once the scheduler actor has applied the abort (at once when the
        pipeline is closing). Returns its sequence id."""
        del self._requests[request_id]
        if self._send_abort(entry.seq_id, reason):
            self._aborting[entry.seq_id] = (request_id, entry.stream, reason)
        else:
            entry.stream.send_nowait(abort_delta(request_id, reason, None))
        return entry.seq_id


def _chat_template(loaded: LoadedModel) -> tuple[ChatTemplate | None, str]:
    """The model's compiled chat template, or None and the rule a chat request then
    breaks. A template that does not compile refuses chats only: prompts still run."""
    name = loaded.path.name
    try:
        template = chat_template_for(loaded)
    except CheckpointError as exc:
        log.warning("the model's chat template does not compile", model=name, error=str(exc))
        return None, f"model {name!r}: {exc}; so messages cannot be rendered"
    if template is None:
        return None, (
            f"model {name!r} has no chat template (tokenizer_config.json's chat_template, "
            "chat_template.jinja or the GGUF's tokenizer.chat_template), so messages cannot "
            "be rendered; send a prompt instead"
        )
    return template, ""
