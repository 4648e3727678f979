"""The public embedding API: ``open_runtime``, ``Runtime.generate`` and ``Runtime.chat``."""

from __future__ import annotations

import collections
import gc
import itertools
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from functools import partial
from typing import NamedTuple

import msgspec
import structlog
import trio

from spectrio.core.acceptance import Acceptance
from spectrio.core.channels import ChannelSender, open_channel
from spectrio.core.config import ConfigError, RuntimeConfig
from spectrio.core.messages import (
    AbortRequest,
    Control,
    NewRequest,
    PublishedStep,
    RuntimeStats,
    SeqResult,
    StepResult,
    TokenLogprob,
)
from spectrio.core.notifier import Notifier
from spectrio.core.params import (
    InvalidRequest,
    SamplingParams,
    check_cache_salt,
    check_messages,
    check_params,
    check_prompt,
    check_request_id,
    with_chat_stops,
)
from spectrio.core.timing import StepTiming, device_summary
from spectrio.errors import CheckpointError, EngineDead
from spectrio.models import LoadedModel, load
from spectrio.models.chat import ChatTemplate, chat_template_for, is_messages
from spectrio.models.paddle_setup import MKL_CPU_TYPE, configure_paddle
from spectrio.process_memory import peak_rss_bytes, rss_bytes
from spectrio.runtime.device_worker import DeviceWorker
from spectrio.runtime.health import Health, judge_health
from spectrio.runtime.kv_sizing import (
    check_checkpoint,
    check_draft,
    draft_kv_layers,
    num_kv_blocks,
)
from spectrio.runtime.timing_cache import KeptTimings
from spectrio.runtime.tp import TPGroup, make_workspace
from spectrio.stages.block_manager import BlockManager
from spectrio.stages.output_processor import RequestText
from spectrio.stages.publisher import run_publisher
from spectrio.stages.sampling import Sampler
from spectrio.stages.scheduler import (
    ControlClosed,
    Resume,
    SchedulerActor,
    StageFailure,
    run_scheduler,
)
from spectrio.stages.scheduling import Scheduler
from spectrio.stages.workspace import Workspace

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


class Delta(msgspec.Struct, kw_only=True):
    """New output of one request from one step."""

    request_id: str
    token_ids: list[int]  # tokens emitted this step
    text: str  # their text (complete characters only)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_drafts: int = 0  # drafts proposed for this request this step
    num_accepted: int = 0  # of which accepted
    abort_reason: str | None = None
    # On the final delta: drafts proposed and accepted over the request's whole life.
    total_drafts: int | None = None
    total_accepted: int | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when asked for
    # On the final delta: acceptance per draft position over the request's whole life (the
    # scheduler's count; :class:`~spectrio.stages.output_processor.RequestStats` reads it).
    acceptance: Acceptance | None = None
    # On the final delta of a finished request: prompt tokens whose KV came from the
    # prefix cache (0 with the cache off).
    cached_tokens: int | None = None
    # On the request's first delta, when params.prompt_logprobs is set: one entry per
    # prompt token after the first (prompt tokens 1 .. P-1, in order; the first has no
    # context, so no logprob), each with that many top alternatives. None on later deltas.
    prompt_logprobs: list[TokenLogprob] | None = None


class Runtime:
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
        self.blocks = BlockManager(
            num_blocks, config.block_size, enable_caching=config.enable_prefix_caching
        )
        self.workspace: Workspace = make_workspace(
            loaded.model,
            num_blocks,
            config.block_size,
            config.speculative,
            None if draft is None else draft.model,
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
        self._streams: dict[str, trio.MemorySendChannel[Delta | SeqResult | EngineDead]] = {}
        self._seq_ids: dict[str, int] = {}
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
        for stream in self._streams.values():
            stream.send_nowait(exc)
        self._streams.clear()
        self._seq_ids.clear()
        self._open_seqs.clear()
        if self._control is not None:
            self._control.close()
        self._notify()

    def _on_result(self, result: StepResult, timing: StepTiming | None) -> None:
        if timing is not None:
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
            stream = self._streams.get(r.request_id)
            if stream is not None and (r.token_ids or r.finish_reason or r.prompt_logprobs):
                stream.send_nowait(r)
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

    # ---- requests ---------------------------------------------------------------------

    def _prepare(
        self, prompt: object, params: object, request_id: object, *, chat: bool = False
    ) -> tuple[list[int], SamplingParams, str]:
        """Check a request with the rules of :mod:`spectrio.core.params` (the wire
        codec runs the same ones). Returns the prompt's token ids, the parameters and the
        request id (a fresh one for ``None``). A message list (``chat``, or a prompt that
        :func:`~spectrio.models.chat.is_messages`) is rendered by :meth:`chat_prompt`.
        Raises :class:`InvalidRequest`."""
        params = check_params(
            SamplingParams() if params is None else params, self.loaded.config.vocab_size
        )
        rid = uuid.uuid4().hex if request_id is None else check_request_id(request_id)
        if chat or is_messages(prompt):
            ids, params = self.chat_prompt(prompt, params)
            return ids, params, rid
        ids = check_prompt(
            prompt,
            vocab_size=self.loaded.config.vocab_size,
            max_model_len=self.config.max_model_len,
            tokenize=self.tokenizer.encode_prompt,
            max_token_bytes=self.tokenizer.max_token_bytes,
        )
        return ids, params, rid

    def chat_prompt(
        self,
        messages: object,
        params: SamplingParams | None = None,
        *,
        tokenize: Callable[[str], Sequence[int]] | None = None,
    ) -> tuple[list[int], SamplingParams]:
        """What a chat request runs: ``messages`` rendered by the model's chat template
        (ending where the assistant's answer begins) and tokenized (``tokenize``, by
        default the model's tokenizer), and ``params`` with the template's end-of-turn
        tokens added to ``stop_token_ids`` (:func:`~spectrio.core.params.with_chat_stops`:
        as EOS, so not with ``ignore_eos``). :meth:`chat` runs exactly these token ids.

        Raises :class:`InvalidRequest` on field ``messages``: a malformed list
        (:func:`~spectrio.core.params.check_messages`), a model without a chat template
        (code ``no_chat_template``; a template is never guessed), a template that refuses
        the messages, or a rendered prompt that is empty or too long. Safe to call from
        another thread (the wire server renders in its tokenizer thread)."""
        params = check_params(
            SamplingParams() if params is None else params, self.loaded.config.vocab_size
        )
        checked = check_messages(messages)
        if self.chat_template is None:
            raise InvalidRequest("messages", self._no_chat, code="no_chat_template")
        text = self.chat_template.render(checked)
        try:
            ids = check_prompt(
                text,
                vocab_size=self.loaded.config.vocab_size,
                max_model_len=self.config.max_model_len,
                tokenize=self.tokenizer.encode if tokenize is None else tokenize,
                max_token_bytes=self.tokenizer.max_token_bytes,
            )
        except InvalidRequest as exc:  # the prompt is the rendered messages: say so
            raise InvalidRequest(
                "messages", f"rendered by the chat template, {exc.rule}", code=exc.code
            ) from None
        return ids, with_chat_stops(params, self.chat_stop_ids)

    def _submit(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, cache_salt: str = ""
    ) -> tuple[int, trio.MemoryReceiveChannel[Delta | SeqResult | EngineDead]]:
        """Hand a checked request to the scheduler; returns its sequence id and stream."""
        if self._dead is not None:
            raise self._dead
        if self._closed or self._control is None:
            raise RuntimeError("the runtime is not running")
        self._check_not_running(request_id)
        spec = (
            self.config.speculative.enabled
            if params.speculative is None
            else (params.speculative and self.config.speculative.enabled)
        )
        stops = list(params.stop_token_ids)
        if not params.ignore_eos:  # every EOS of a config that lists several
            stops += [t for t in self.loaded.config.eos_token_ids if t not in stops]
        seq_id = next(self._ids)
        send, receive = trio.open_memory_channel[Delta | SeqResult | EngineDead](math.inf)
        self._streams[request_id] = send
        self._seq_ids[request_id] = seq_id
        if not self._open_seqs:  # work arrives after idleness: the stall clock starts now
            self._active_since = time.monotonic()
        self._open_seqs.add(seq_id)
        self._control.send_nowait(
            NewRequest(
                seq_id=seq_id,
                request_id=request_id,
                prompt_ids=prompt_ids,
                params=params,
                eos_token_ids=stops,
                speculative=spec,
                cache_salt=cache_salt,
            )
        )
        return seq_id, receive

    def _check_not_running(self, request_id: str) -> None:
        if request_id in self._streams:
            raise InvalidRequest(
                "request_id", "must not be the id of a running request", got=request_id
            )

    def _release(self, request_id: str, seq_id: int, reason: str | None) -> None:
        """Forget a request's stream; with a ``reason``, abort it in the pipeline (its
        KV blocks are freed at the next plan). Does nothing if ``request_id`` now names
        another submission than ``seq_id``."""
        if self._seq_ids.get(request_id, seq_id) != seq_id:
            return
        self._streams.pop(request_id, None)
        if reason is None:
            self._seq_ids.pop(request_id, None)
        else:
            self._send_abort(request_id, reason)

    def _send_abort(self, request_id: str, reason: str) -> Acceptance | None:
        """Abort in the scheduler now (its blocks are freed, and no token of it computed by
        a step in flight is published), then wake the scheduler actor, which reports the
        abort in the next step."""
        seq_id = self._seq_ids.pop(request_id, None)
        if seq_id is not None:
            self._open_seqs.discard(seq_id)
        if seq_id is None or self._control is None:
            return None
        counted = self._actor.abort(AbortRequest(seq_id=seq_id, reason=reason))
        if self._events_tx is not None:
            with suppress(trio.ClosedResourceError, trio.BrokenResourceError):
                self._events_tx.send_nowait(Resume())
        return counted

    def _is_idle(self) -> bool:
        sched = self._actor.view()
        pending = 0
        if self._control is not None:
            pending = self._control.statistics().current_buffer_used
        if self._events_tx is not None:
            pending += self._events_tx.statistics().current_buffer_used
        return not (sched.has_work or sched.num_in_flight or pending)

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
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        self._end_with_abort(request_id, stream, reason)
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
        final delta's statistics: :mod:`spectrio.stages.output_processor`).

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
        for rid, stream in list(self._streams.items()):
            self._end_with_abort(rid, stream, reason)

    def _end_with_abort(
        self, request_id: str, stream: trio.MemorySendChannel[Delta | SeqResult], reason: str
    ) -> None:
        """Abort a request in the scheduler and give its stream the final ``abort`` delta."""
        counted = self._send_abort(request_id, reason)
        stream.send_nowait(
            Delta(
                request_id=request_id,
                token_ids=[],
                text="",
                finished=True,
                finish_reason="abort",
                abort_reason=reason,
                total_drafts=None if counted is None else counted.proposed,
                total_accepted=None if counted is None else counted.accepted,
                acceptance=counted,
            )
        )


class RequestStream:
    """The output of one request, as :meth:`Runtime.generate` returns it: an async
    iterator of :class:`Delta`, and an async context manager whose exit (like
    :meth:`aclose`) aborts the request if it has not finished."""

    def __init__(
        self,
        runtime: Runtime,
        prompt: object,
        params: object,
        request_id: str | None,
        *,
        chat: bool = False,
        cache_salt: str = "",
    ) -> None:
        self._receive: trio.MemoryReceiveChannel[Delta | SeqResult | EngineDead] | None = None
        self._done = False  # finished, or closed by the consumer
        self._rt = runtime
        self._prompt, self._params = prompt, params
        self._chat = chat  # the prompt is a message list (Runtime.chat)
        self._cache_salt = check_cache_salt(cache_salt)
        # Known from the start, so a caller can abort by id; checked when the stream starts.
        self._request_id: str = uuid.uuid4().hex if request_id is None else request_id
        self._token = trio.lowlevel.current_trio_token()
        self._seq_id = -1
        self._text: RequestText | None = None  # the request's text, once started
        # prompt_logprobs gathered chunk by chunk until the first delta carries them; None
        # when not asked for, or once handed out
        self._prompt_lps: list[TokenLogprob] | None = None
        self._start()  # checked and submitted now: errors reach the caller of generate()

    @property
    def request_id(self) -> str:
        """The request's id: the one given to :meth:`Runtime.generate`, or a fresh one."""
        return self._request_id

    @property
    def finished(self) -> bool:
        """Whether the stream has ended (its final delta was returned, or it was closed)."""
        return self._done

    def _start(self) -> None:
        if self._receive is not None or self._done:
            return
        ids, params, rid = self._rt._prepare(
            self._prompt, self._params, self._request_id, chat=self._chat
        )
        self._seq_id, self._receive = self._rt._submit(ids, params, rid, self._cache_salt)
        self._params, self._prompt = params, None
        self._text = RequestText(self._rt.tokenizer, params.stop)
        if params.prompt_logprobs is not None:
            self._prompt_lps = []

    async def __aenter__(self) -> RequestStream:
        try:
            await trio.lowlevel.checkpoint()
        except BaseException:  # a cancelled entry: the request goes at once
            self.close()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        self._start()
        if self._done:
            raise StopAsyncIteration
        assert self._receive is not None
        while True:
            try:
                item = await self._receive.receive()
            except BaseException:  # cancelled while waiting: the consumer is gone
                self.close()
                raise
            delta = self._on_item(item)
            if delta is not None:
                return delta

    def _take_prompt_logprobs(self) -> list[TokenLogprob] | None:
        """The prompt logprobs gathered so far, once: for the first delta handed out."""
        out, self._prompt_lps = self._prompt_lps, None
        return out

    def _on_item(self, item: Delta | SeqResult | EngineDead) -> Delta | None:
        """The delta for one item of the request's channel; None for a step that only
        scored prompt tokens (a prefill chunk): its logprobs wait for the first delta."""
        rid = self._request_id
        if isinstance(item, EngineDead):
            self._done = True
            raise item
        if isinstance(item, Delta):  # aborted or shut down; the abort is already sent
            self._done = True
            self._rt._release(rid, self._seq_id, None)
            lps = self._take_prompt_logprobs()
            return item if lps is None else msgspec.structs.replace(item, prompt_logprobs=lps)
        if item.prompt_logprobs and self._prompt_lps is not None:
            self._prompt_lps += item.prompt_logprobs
        if not item.token_ids and item.finish_reason is None:
            return None
        done = item.finish_reason is not None
        if done:
            self._done = True
            self._rt._release(rid, self._seq_id, None)
        assert self._text is not None
        text = self._text.push(item.token_ids, finished=done, text_len=item.text_len)
        return Delta(
            request_id=rid,
            token_ids=item.token_ids,
            text=text,
            finished=done,
            finish_reason=item.finish_reason,
            num_drafts=item.num_drafts,
            num_accepted=item.num_accepted,
            logprobs=item.logprobs,
            total_drafts=item.total_drafts,
            total_accepted=item.total_accepted,
            acceptance=item.acceptance,
            cached_tokens=item.cached_tokens,
            prompt_logprobs=self._take_prompt_logprobs(),
        )

    def close(self, reason: str = "consumer went away") -> None:
        """Stop the stream now: if its request has not finished, abort it (its KV blocks
        are freed at the next plan). Later iteration ends at once. Idempotent."""
        if self._done:
            return
        self._done = True
        if self._receive is not None:
            self._rt._release(self._request_id, self._seq_id, reason)

    async def aclose(self) -> None:
        """:meth:`close`, as the async iterator protocol names it."""
        self.close()
        await trio.lowlevel.cancel_shielded_checkpoint()

    def __del__(self) -> None:
        # A stream dropped unfinished (no ``async with``, no aclose) aborts its request.
        # The finaliser may run at any point, so the abort is handed to the Trio loop.
        if self._done or self._receive is None:
            return
        try:
            self._token.run_sync_soon(
                self._rt._release, self._request_id, self._seq_id, "consumer went away"
            )
        except trio.RunFinishedError:
            pass


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


@asynccontextmanager
async def open_runtime(
    config: RuntimeConfig | None = None,
    *,
    encoded_channels: bool = False,
    warmup: bool = True,
    shutdown_timeout: float = 30.0,
    loaded: LoadedModel | None = None,
) -> AsyncIterator[Runtime]:
    """Load the model, run the warm-up pass over ``config.warmup_num_tokens()`` tokens,
    start the five stages, and yield the running :class:`Runtime`.

    ``loaded``: a checkpoint already loaded (:func:`spectrio.models.load`) to run instead
    of loading ``config.model``; one rank only, in ``config.dtype``. Runtimes may share
    one: their steps then take turns on it (the model's ``step_lock``), since a forward
    pass stages its inputs in buffers the model owns. ``spectrio bench --interleave``
    runs the cases it compares on one copy of the weights (why: its ``run_interleaved``).

    On exit, requests still streaming end with ``finish_reason="abort"`` (reason
    ``"shutdown"``); the control channel closes, the scheduler lets the steps in flight
    return, and the stages end on their channels' end. A stage that does not end within
    ``shutdown_timeout`` seconds is cancelled. If the engine died (a stage failed),
    leaving the block raises its :class:`EngineDead`.
    """
    config = config or RuntimeConfig()
    threads = configure_paddle(config.resolve_num_threads())
    log.info("paddle configured", threads=threads, mkl_cpu_type=MKL_CPU_TYPE)
    group: TPGroup | None = None
    if loaded is not None:
        if config.tensor_parallel_size > 1:
            raise ConfigError("loaded: a preloaded model runs on one rank only")
        if loaded.model.dtype != config.dtype:
            raise ConfigError(
                f"loaded: the model is {loaded.model.dtype}, the config asks for {config.dtype}"
            )
    elif config.tensor_parallel_size > 1:
        from spectrio.runtime.tp_start import start_group

        group, loaded = await start_group(config, warmup)
    else:
        # Serving only: the runtime's own copy needs no unfused weights.
        loaded = await trio.to_thread.run_sync(
            partial(load, serving=True), config.model, config.model_dtype
        )
    draft: LoadedModel | None = None
    draft_name = config.speculative.draft_model
    if draft_name is not None:
        if group is not None:
            raise ConfigError(
                "draft_model: a draft model of its own runs on one rank only; with tensor "
                "parallelism the target drafts for itself (draft_model=None, draft_layers)"
            )
        draft = await trio.to_thread.run_sync(
            partial(load, serving=True), draft_name, config.model_dtype
        )
    try:
        rt = Runtime(config, loaded, encoded_channels, group, draft)
        if warmup:
            seconds = await trio.to_thread.run_sync(
                rt.workspace.warmup,
                config.warmup_num_tokens(),
                config.max_model_len,
                abandon_on_cancel=group is not None,
            )
            log.info(
                "warm-up pass done", tokens=config.warmup_num_tokens(), seconds=round(seconds, 3)
            )
    except BaseException:
        if group is not None:
            group.stop_followers(kill=True)
        raise
    # Everything loaded so far (the model, Paddle's and the host's modules) lives as long
    # as the process: move it out of the collector's way, so full collections stay short.
    gc.freeze()
    try:
        async with trio.open_nursery() as nursery:
            await rt._start(nursery)
            try:
                yield rt
            finally:
                rt._shutdown("shutdown")
                if rt._control is not None:
                    rt._control.close()
                with trio.move_on_after(shutdown_timeout) as waited:
                    waited.shield = True
                    await rt._stopped.wait()
                if waited.cancelled_caught:
                    log.warning("stages did not end in time; cancelling", seconds=shutdown_timeout)
                nursery.cancel_scope.cancel()
                rt._kept_timings.keep(rt._actor)
    finally:
        if group is not None:
            from spectrio.runtime.tp_start import stop_group

            with trio.CancelScope(shield=True):
                await stop_group(group, dead=rt._dead is not None)
    if rt._dead is not None:  # also for a caller that never waited on the engine
        raise rt._dead
