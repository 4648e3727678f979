"""The HTTP front's state: admission, prompts, the requests it runs, drain and death.

One :class:`HttpFront` per served runtime, shared by every HTTP request (all on the
runtime's Trio thread). It knows nothing of Starlette or Hypercorn: the app's handlers
(:mod:`spectrio.http_api.endpoints`) ask it to admit a client, to turn prompts into token
ids, and to start and track requests; the CLI asks it to drain.

* **Admission**: a dead engine or a draining server answers 503 (``/health`` also
  answers 503 while the runtime's requests cannot progress:
  :meth:`~spectrio.runtime.api.Runtime.health`); the wire's per-client
  token bucket (:class:`~spectrio.wire.admission.RateLimiter`, keyed by client address)
  answers 429.
* **Prompts** are checked with the runtime's rules
  (:func:`~spectrio.core.params.check_prompt`: text too long for ``max_model_len`` is
  refused by its length before it is tokenized) and tokenized in a worker thread, one
  at a time, with the GIL released, by a tokenizer of the front's own, so a long prompt
  does not stall the event loop.
* **Tracking**: every runtime request an HTTP request started is known until its
  handler ends, so :meth:`HttpFront.drain` can wait for them and then abort the rest.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Final

import msgspec
import structlog
import trio
from tokenizers import Tokenizer

from spectrio.core.notifier import Notifier
from spectrio.core.params import SamplingParams, check_prompt
from spectrio.errors import EngineDead
from spectrio.http_api.logprobs import TokenStrings
from spectrio.http_api.mapping import HttpError
from spectrio.http_api.response_format import Sourced, check_enforceable
from spectrio.models.text.tokenizer import TextTokenizer
from spectrio.wire.admission import RateLimiter

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from spectrio.runtime.api import RequestStream, Runtime

__all__ = ["DEFAULT_FINISH_S", "HttpFront"]

log = structlog.get_logger("spectrio.http")

DEFAULT_FINISH_S: Final = 3.0
"""Seconds :meth:`HttpFront.drain` spends, after the grace period, on aborting what
still runs and letting each response end."""


class HttpFront:
    """What the HTTP app serves: a runtime under a model name, with its limits.

    ``rt`` may be an :class:`~spectrio.runtime.metrics.ObservedRuntime` (the CLI's seam
    for metrics and traces): only the public Runtime API is used. ``registry``: the
    Prometheus registry ``/metrics`` exposes (None: no ``/metrics``)."""

    def __init__(
        self,
        rt: Runtime,
        *,
        model_name: str,
        api_key: str | None = None,
        max_body_bytes: int = 1 << 20,
        max_requests_per_s: float | None = None,
        burst: int = 64,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.rt = rt
        self.model_name = model_name
        self.api_key = api_key or None
        self.max_body_bytes = max_body_bytes
        self.registry = registry
        self.created = int(time.time())
        self.vocab_size = rt.loaded.config.vocab_size
        self.max_model_len = rt.config.max_model_len
        self.strings = TokenStrings(rt.tokenizer)
        # A tokenizer of the front's own, used from its worker thread only.
        self._tokenizer = TextTokenizer(
            Tokenizer.from_str(rt.tokenizer.raw.to_str()), rt.tokenizer.eos_token_id
        )
        self._tokenizing = trio.CapacityLimiter(1)
        self._limits = RateLimiter(max_requests_per_s, burst)
        self.dead: EngineDead | None = None
        self.died = trio.Event()  # set once the front knows the engine is dead
        self.closing = False
        self.stopped = trio.Event()  # Hypercorn's shutdown trigger
        self._open: set[str] = set()  # runtime request ids of running HTTP requests
        self._exchanges = 0  # HTTP requests being answered
        self._changed = Notifier()

    # ---- admission --------------------------------------------------------------------

    def check_available(self) -> None:
        """503 once the engine is dead or while the server drains."""
        if self.dead is not None:
            raise HttpError(
                503, f"the engine is dead: {self.dead}", type="server_error", code="engine_dead"
            )
        if self.closing:
            raise HttpError(
                503, "the server is shutting down", type="server_error", code="unavailable"
            )

    def admit(self, client: str) -> None:
        """Admit one generation request from ``client`` (its address), or raise 503/429."""
        self.check_available()
        if not self._limits.admit(b"http:" + client.encode(), time.monotonic()):
            rate = self._limits.rate or 1.0
            raise HttpError(
                429,
                f"over {rate} requests/s; retry later",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(max(1, math.ceil(1 / rate)))},
            )

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise HttpError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    # ---- prompts ----------------------------------------------------------------------

    def _check(self, prompts: Sequence[str | list[int]]) -> list[list[int]]:
        return [
            check_prompt(
                p,
                vocab_size=self.vocab_size,
                max_model_len=self.max_model_len,
                tokenize=self._tokenizer.encode_prompt_releasing_gil,
                max_token_bytes=self._tokenizer.max_token_bytes,
            )
            for p in prompts
        ]

    async def prompt_ids(self, prompts: Sequence[str | list[int]]) -> list[list[int]]:
        """Each prompt's token ids, checked (:class:`InvalidRequest`). Text is tokenized
        in the front's worker thread; cancellation abandons the thread's result."""
        if all(not isinstance(p, str) for p in prompts):
            return self._check(prompts)  # nothing to tokenize
        return await trio.to_thread.run_sync(
            functools.partial(self._check, prompts),
            limiter=self._tokenizing,
            abandon_on_cancel=True,
        )

    async def check_constraints(self, constraints: Sequence[Sourced]) -> None:
        """Refuse a constraint the grammar library cannot enforce (a bad schema, pattern
        or grammar, an unimplemented schema keyword), naming the HTTP field it came from
        (:class:`InvalidRequest`). Compiled in a worker thread (the runtime's compiler
        keeps it, so the request's own check finds it ready); cancellation abandons the
        thread's result."""
        grammar = self.rt.grammar
        for sourced in constraints:
            await trio.to_thread.run_sync(
                functools.partial(check_enforceable, grammar.check, sourced),
                abandon_on_cancel=True,
            )

    # ---- requests ---------------------------------------------------------------------

    def start(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        cache_salt: str = "",
    ) -> RequestStream:
        """Start one runtime request (checked and submitted now); 503 when the runtime
        is dead or stopped."""
        try:
            return self.rt.generate(
                prompt_ids, params, request_id=request_id, cache_salt=cache_salt
            )
        except EngineDead as exc:
            self.dead = self.dead or exc
            self.check_available()
            raise
        except RuntimeError as exc:  # the runtime has shut down
            raise HttpError(503, str(exc), type="server_error", code="unavailable") from None

    @contextlib.contextmanager
    def exchange(self) -> Iterator[None]:
        """Count one HTTP request being answered (``wait_idle`` waits for none)."""
        self._exchanges += 1
        try:
            yield
        finally:
            self._exchanges -= 1
            self._notify()

    @contextlib.contextmanager
    def tracking(self, streams: Sequence[RequestStream]) -> Iterator[None]:
        """Know ``streams``' requests while the block runs (the drain aborts them); on
        exit every stream is closed, which aborts a request still running."""
        ids = [s.request_id for s in streams]
        self._open.update(ids)
        try:
            yield
        finally:
            for s in streams:
                s.close()
            self._open.difference_update(ids)
            self._notify()

    def _notify(self) -> None:
        self._changed.notify()

    @property
    def open_requests(self) -> int:
        """Runtime requests started by HTTP requests still being answered."""
        return len(self._open)

    async def wait_idle(self) -> None:
        """Wait until no HTTP request is being answered."""
        while self._exchanges:
            await self._changed.wait()

    # ---- life -------------------------------------------------------------------------

    async def watch_engine(self) -> None:
        """Note the engine's death at once: from then on every request gets 503 and
        ``/health`` says so (open streams get their error event from the runtime)."""
        self.dead = await self.rt.wait_dead()
        self.died.set()
        log.error("engine dead: HTTP requests get 503", error=str(self.dead))
        self._notify()

    async def drain(
        self,
        grace_s: float,
        *,
        cut: trio.Event | None = None,
        finish_s: float = DEFAULT_FINISH_S,
    ) -> bool:
        """Stop taking requests (503), let the running ones finish for up to
        ``grace_s`` seconds (or until ``cut`` is set), then abort the rest (reason
        ``shutdown``: their responses end with ``finish_reason="abort"``) and give their
        handlers up to ``finish_s`` seconds to answer; then stop the HTTP server. Returns
        True when every request finished on its own."""
        self.closing = True
        with trio.move_on_after(grace_s):
            async with trio.open_nursery() as grace:
                if cut is not None:

                    async def cut_short() -> None:
                        await cut.wait()
                        grace.cancel_scope.cancel()

                    grace.start_soon(cut_short)
                while self._open:
                    await self._changed.wait()
                grace.cancel_scope.cancel()
        cut_ids = sorted(self._open)
        with trio.move_on_after(finish_s):
            for rid in cut_ids:
                await self.rt.abort(rid, "shutdown")
            await self.wait_idle()
        self.stopped.set()
        log.info("HTTP drained", aborted=len(cut_ids), answering=self._exchanges)
        return not cut_ids

    def stop(self) -> None:
        """Stop the HTTP server now (no drain)."""
        self.closing = True
        self.stopped.set()

    # ---- introspection ----------------------------------------------------------------

    def health(self) -> tuple[int, dict[str, object]]:
        """``GET /health``'s status and body, from the runtime's counters and its
        :meth:`~spectrio.runtime.api.Runtime.health`: 200 with ``status: "ok"`` while
        requests can progress; otherwise 503 with the app's error object (code: the
        health's cause, ``stalled``, ``sink_blocked``, ``engine_dead`` or ``stopped``;
        message: its reason) and ``status: "unhealthy"``, beside the same counters.
        (:meth:`check_available`'s 503s, a dead engine or a drain, come first.)"""
        stats = self.rt.stats()
        health = self.rt.health()
        counters: dict[str, object] = {
            "model": self.model_name,
            "running": stats.running,
            "waiting": stats.waiting,
            "free_kv_blocks": stats.free_kv_blocks,
            "num_kv_blocks": stats.num_kv_blocks,
            "finished": stats.finished,  # requests ended, by finish reason
            "open_requests": health.open_requests,  # every front's, accepted and not ended
            "open_http_requests": len(self._open),
            "seconds_since_step": _rounded(health.seconds_since_step),
            "blocked_sink": health.blocked_sink,
            "blocked_s": _rounded(health.blocked_s),
            "stall_timeout_s": health.stall_timeout_s,
        }
        if health.ok:
            return 200, {"status": "ok", **counters}
        error = HttpError(
            503,
            health.reason or "the runtime cannot make progress",
            type="server_error",
            code=health.cause,
        )
        return 503, {**msgspec.to_builtins(error.body()), "status": "unhealthy", **counters}


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)
