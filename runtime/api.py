"""The public embedding API: ``open_runtime`` and ``Runtime.generate``."""

from __future__ import annotations

import functools
import itertools
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import msgspec
import structlog
import trio

from spectrio.models import LoadedModel, load
from spectrio.models.paddle_setup import configure_paddle
from spectrio.runtime.channels import ChannelSender, open_channel
from spectrio.runtime.config import ConfigError, RuntimeConfig
from spectrio.runtime.messages import (
    AbortRequest,
    Control,
    NewRequest,
    PublishedStep,
    SeqResult,
    StepPlan,
    StepResult,
    TokenLogprob,
)
from spectrio.runtime.params import InvalidRequest, SamplingParams
from spectrio.runtime.workspace import Workspace
from spectrio.stages.block_manager import BlockManager
from spectrio.stages.draft import run_draft
from spectrio.stages.publisher import run_publisher
from spectrio.stages.sampler import run_sampler
from spectrio.stages.sampling import Sampler
from spectrio.stages.scheduler import run_scheduler
from spectrio.stages.scheduling import Scheduler
from spectrio.stages.verify import run_verify

log = structlog.get_logger("spectrio.runtime")


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
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when asked for


class Runtime:
    """A running pipeline. Create it with :func:`open_runtime`."""

    def __init__(self, config: RuntimeConfig, loaded: LoadedModel, encoded_channels: bool) -> None:
        self.config = config
        self.loaded = loaded
        if loaded.tokenizer is None:
            raise ConfigError(f"model: {loaded.path} has no tokenizer.json")
        self.tokenizer = loaded.tokenizer
        cfg = loaded.config
        if config.speculative.enabled and not cfg.has_mtp:
            raise ConfigError("speculative: the checkpoint has no MTP layer; use SpeculativeConfig(method=None)")
        if config.max_model_len + config.speculative.num_draft_tokens > cfg.max_position_embeddings:
            raise ConfigError(
                f"max_model_len: {config.max_model_len} + k exceeds the model's "
                f"max_position_embeddings ({cfg.max_position_embeddings})"
            )
        num_blocks = config.resolve_num_kv_blocks(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.workspace = Workspace(loaded.model, num_blocks, config.block_size)
        self.scheduler = Scheduler(config, self.blocks)
        self.sampler = Sampler(cfg.vocab_size, self.tokenizer)
        self._observers: list[Callable[[PublishedStep], None]] = []
        self._sinks: list[Callable[[PublishedStep], Awaitable[None]]] = []
        self._encoded = encoded_channels
        self._limiter = trio.CapacityLimiter(1)
        self._control: ChannelSender[Control] | None = None
        self._streams: dict[str, trio.MemorySendChannel[Delta | SeqResult]] = {}
        self._seq_ids: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self.num_steps = 0  # pipeline steps published
        self.num_drafts_proposed = 0
        self.num_drafts_accepted = 0

    # ---- assembly ---------------------------------------------------------------------

    async def _start(self, nursery: trio.Nursery) -> None:
        enc = self._encoded
        control_tx, control_rx = open_channel(Control, math.inf, enc)
        plan_tx, plan_rx = open_channel(StepPlan, 1, enc)
        draft_tx, draft_rx = open_channel(StepPlan, 1, enc)
        verified_tx, verified_rx = open_channel(StepPlan, 1, enc)
        overlap = self.config.enable_overlap
        # With overlap the publisher may lag a step behind the sampler, hence the slack.
        sampled_tx, sampled_rx = open_channel(StepResult, 2 if overlap else 1, enc)
        feedback_tx, feedback_rx = open_channel(StepResult, 1, enc)
        self._control = control_tx
        # Downstream first, so every stage is ready before the scheduler plans anything.
        await nursery.start(
            run_publisher, sampled_rx, self._deliver, self._publish, None if overlap else feedback_tx
        )
        await nursery.start(
            functools.partial(run_sampler, feedback=feedback_tx if overlap else None),
            self.workspace, self.sampler, self._limiter, verified_rx, sampled_tx,
        )
        await nursery.start(run_verify, self.workspace, self._limiter, draft_rx, verified_tx)
        await nursery.start(run_draft, self.workspace, self._limiter, plan_rx, draft_tx)
        await nursery.start(
            functools.partial(run_scheduler, release=self.workspace.release),
            self.scheduler, control_rx, plan_tx, feedback_rx,
        )
        log.info("runtime started", num_kv_blocks=self.blocks.num_blocks, encoded=enc, overlap=overlap,
                 speculative=self.config.speculative.method, k=self.config.speculative.num_draft_tokens)

    def _deliver(self, result: StepResult) -> None:
        self.num_steps += 1
        for r in result.results:
            self.num_drafts_proposed += r.num_drafts
            self.num_drafts_accepted += r.num_accepted
            stream = self._streams.get(r.request_id)
            if stream is not None and (r.token_ids or r.finish_reason):
                stream.send_nowait(r)

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

    def add_record_sink(self, sink: Callable[[PublishedStep], Awaitable[None]]) -> Callable[[], None]:
        """Await ``sink`` with every step's record from now on. Unlike an observer, a sink
        may take its time: the publisher waits for it, so a slow sink applies backpressure
        to the whole pipeline (nothing is dropped). A sink must return promptly once
        removed. Returns a function that removes it."""
        self._sinks.append(sink)

        def remove() -> None:
            if sink in self._sinks:
                self._sinks.remove(sink)

        return remove

    async def _publish(self, published: PublishedStep) -> None:
        for sink in list(self._sinks):
            await sink(published)
        for observer in list(self._observers):
            try:
                observer(published)
            except Exception:
                log.exception("record observer failed", step=published.step)

    def _shutdown(self, reason: str) -> None:
        self._closed = True
        for rid, stream in list(self._streams.items()):
            stream.send_nowait(Delta(request_id=rid, token_ids=[], text="", finished=True,
                                     finish_reason="abort", abort_reason=reason))
            self._send_abort(rid, reason)

    # ---- requests ---------------------------------------------------------------------

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            vocab = self.loaded.config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequest(f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if not ids:
            raise InvalidRequest("prompt: must not be empty")
        if len(ids) >= self.config.max_model_len:
            raise InvalidRequest(
                f"prompt: {len(ids)} tokens leave no room under max_model_len={self.config.max_model_len}"
            )
        return ids

    def _send_abort(self, request_id: str, reason: str) -> None:
        seq_id = self._seq_ids.pop(request_id, None)
        if seq_id is not None and self._control is not None:
            try:
                self._control.send_nowait(AbortRequest(seq_id=seq_id, reason=reason))
            except trio.ClosedResourceError:
                pass

    async def wait_idle(self) -> None:
        """Wait until no request is queued or running and no step is in flight, so every
        finished or aborted request's blocks are back in the pool. Cancellation is safe."""
        while self.scheduler.has_work() or self.scheduler.step_in_flight or self._control_pending():
            await trio.sleep(0.002)

    def _control_pending(self) -> bool:
        """Requests or aborts sent to the scheduler that it has not read yet."""
        return self._control is not None and self._control.statistics().current_buffer_used > 0

    async def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Abort a request: its stream ends with ``finish_reason="abort"`` and its KV
        blocks are freed. Returns False for an unknown or finished request."""
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        stream.send_nowait(Delta(request_id=request_id, token_ids=[], text="", finished=True,
                                 finish_reason="abort", abort_reason=reason))
        self._send_abort(request_id, reason)
        return True

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> AsyncIterator[Delta]:
        """Stream a request's output, one :class:`Delta` per step that emitted tokens.

        ``delta.text`` holds complete characters only. With ``params.stop`` strings, the
        last ``max(len(stop)) - 1`` characters are held back until the next step (or the
        finish), so text a stop string later cuts is never streamed. ``delta.logprobs``
        has one entry per token when ``params.logprobs`` is set.

        Raises :class:`InvalidRequest` for a bad prompt or parameters. If the caller
        stops iterating or is cancelled, the request is aborted and its blocks freed.
        """
        if self._closed or self._control is None:
            raise RuntimeError("the runtime is not running")
        params = params or SamplingParams()
        params.validate(self.loaded.config.vocab_size)
        prompt_ids = self._prompt_ids(prompt)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise InvalidRequest(f"request_id: {request_id!r} is already running")
        spec = self.config.speculative.enabled if params.speculative is None else (
            params.speculative and self.config.speculative.enabled)
        eos = self.loaded.config.eos_token_id
        stops = list(params.stop_token_ids) + ([eos] if eos is not None and not params.ignore_eos else [])
        seq_id = next(self._ids)
        send, receive = trio.open_memory_channel[Delta | SeqResult](math.inf)
        self._streams[request_id] = send
        self._seq_ids[request_id] = seq_id
        self._control.send_nowait(NewRequest(seq_id=seq_id, request_id=request_id, prompt_ids=prompt_ids,
                                             params=params, eos_token_ids=stops, speculative=spec))
        detok = self.tokenizer.stream()
        # With stop strings, hold back the text a stop string completed later could still
        # cut: at most the longest stop string minus one character.
        hold = max((len(s) for s in params.stop), default=1) - 1
        pending, sent = "", 0
        done = False
        try:
            async for item in receive:
                if isinstance(item, Delta):
                    done = True
                    yield item
                    return
                pending += detok.push(item.token_ids)
                done = item.finish_reason is not None
                if done:
                    pending += detok.flush()
                    self._seq_ids.pop(request_id, None)
                if item.text_len is not None:
                    pending = pending[: max(0, item.text_len - sent)]
                keep = 0 if done else min(hold, len(pending))
                text, pending = pending[: len(pending) - keep], pending[len(pending) - keep :]
                sent += len(text)
                yield Delta(request_id=request_id, token_ids=item.token_ids, text=text, finished=done,
                            finish_reason=item.finish_reason, num_drafts=item.num_drafts,
                            num_accepted=item.num_accepted, logprobs=item.logprobs)
                if done:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not done:
                self._send_abort(request_id, "consumer went away")


@asynccontextmanager
async def open_runtime(
    config: RuntimeConfig | None = None, *, encoded_channels: bool = False, warmup: bool = True
) -> AsyncIterator[Runtime]:
    """Load the model, run the warm-up pass over ``config.warmup_num_tokens()`` tokens,
    start the five stages, and yield the running :class:`Runtime`.

    On exit, requests still streaming end with ``finish_reason="abort"`` (reason
    ``"shutdown"``) and every stage task is cancelled and awaited.
    """
    config = config or RuntimeConfig()
    threads = configure_paddle(config.resolve_num_threads())
    log.info("paddle configured", threads=threads)
    loaded = await trio.to_thread.run_sync(load, config.model, config.dtype)
    rt = Runtime(config, loaded, encoded_channels)
    if warmup:
        seconds = await trio.to_thread.run_sync(
            rt.workspace.warmup, config.warmup_num_tokens(), config.max_model_len, limiter=rt._limiter
        )
        log.info("warm-up pass done", tokens=config.warmup_num_tokens(), seconds=round(seconds, 3))
    async with trio.open_nursery() as nursery:
        await rt._start(nursery)
        try:
            yield rt
        finally:
            rt._shutdown("shutdown")
            nursery.cancel_scope.cancel()
