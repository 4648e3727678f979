"""The state the wire server's owner tasks share (:class:`ServerState`: the destinations'
outboxes, the requests' owners, the counters) and the helpers both of its sides use;
:mod:`spectrio.wire.server` assembles the server from its two sides,
:mod:`.server_outputs` and :mod:`.server_requests`."""

from __future__ import annotations

import collections
import hashlib
import itertools
import math
from collections.abc import Sequence
from typing import Final, TypeVar

import msgspec
import numpy as np
import structlog
import trio
import zmq

from spectrio.core.messages import PublishedStep
from spectrio.core.notifier import Notifier
from spectrio.cuda_kernels.reference import pack_step_record
from spectrio.errors import EngineDead
from spectrio.runtime.api import Runtime
from spectrio.wire.admission import (
    PromptQueue,
    PromptTokenizer,
    RateLimiter,
)
from spectrio.wire.codec import (
    SequenceCounter,
)
from spectrio.wire.endpoints import (
    ServerEndpoints,
)
from spectrio.wire.outbox import Outbox
from spectrio.wire.schema import (
    Error,
    ErrorCode,
    ModelInfo,
    SpeculativeInfo,
)
from spectrio.wire.zmq_transport import TrioSocket

log = structlog.get_logger("spectrio.server")

T = TypeVar("T")

Context = zmq.Context[zmq.Socket[bytes]]

DEFAULT_FINISH_S: Final = 3.0
"""Seconds :meth:`WireServer.drain` spends, after the grace period, on aborting what still
runs, publishing the abort step and handing the last messages to the consumer."""

ABORT_REASON: Final = "aborted by client"
"""The runtime's abort reason for an ``Abort`` request (logs; the wire says ``"abort"``)."""


def model_info(runtime: Runtime, tokenizer_json: str) -> ModelInfo:
    """The ``Info`` reply for ``runtime`` (without the tokenizer's JSON)."""
    spec = runtime.config.speculative
    data = tokenizer_json.encode("utf-8")
    return ModelInfo(
        model=runtime.config.model,
        vocab_size=runtime.loaded.config.vocab_size,
        max_model_len=runtime.config.max_model_len,
        eos_token_id=runtime.tokenizer.eos_token_id,
        speculative=SpeculativeInfo(
            method=spec.method,
            num_speculative_tokens=spec.num_speculative_tokens,
            num_model_steps=spec.num_model_steps,
            adaptive=spec.adaptive,
            prompt_lookup_max=spec.prompt_lookup_max,
            prompt_lookup_min=spec.prompt_lookup_min,
            draft_model=spec.draft_model,
            draft_layers=spec.draft_layers,
        ),
        tokenizer_sha256=hashlib.sha256(data).hexdigest(),
        tokenizer_bytes=len(data),
        chat_template=runtime.chat_template is not None,
    )


class ServerStats(msgspec.Struct, kw_only=True):
    """Counters, for logs and tests."""

    requests: int = 0  # frames received on the request socket
    acks: int = 0
    errors: dict[str, int] = msgspec.field(default_factory=dict)  # ErrorCode value -> count
    dropped_frames: int = 0  # messages with no usable reply address
    replies_dropped: int = 0  # replies dropped because their client's queue was full (not reading)
    unreplied: int = 0  # replies that could not be delivered: the client was gone
    infos: int = 0  # Info requests answered
    prompts_tokenized: int = 0  # text prompts handed to the tokenizer
    steps_published: int = 0  # step messages handed to a socket (PUSH or a client's connection)
    steps_dropped: int = 0  # step messages dropped with an abandoned destination
    tap_dropped: int = 0  # step messages the tap dropped
    request_failures: int = 0  # accepted requests that failed inside the runtime
    requests_stalled: int = 0  # requests ended because their outputs were not read
    clients_gone: int = 0  # connections that closed with requests or messages of theirs left
    max_backlog: int = 0  # most messages one destination had queued at once


PUSH: Final = b""
"""The destination key of the shared PUSH outputs socket (a ROUTER routing id is never
empty, so it cannot collide with a client's)."""

RETRY_S: Final = 0.01
"""How often a destination whose socket refused a message (its queue is full, or the
PUSH socket has no reader) is tried again: libzmq says when a socket may send, not when
one ROUTER peer may."""

STALL_REASON: Final = "outputs not read"
"""The runtime's abort reason for a request ended because its outputs stalled (logs)."""

MAX_ENDED: Final = 4096
"""Requests ended for stalled outputs that an ``Abort`` from their owner can still ask
about (the oldest are forgotten first)."""


def check_output_bounds(high_water: int, stall_s: float) -> None:
    """Refuse output bounds that cannot work (``ValueError`` naming the flag)."""
    if high_water < 1:
        raise ValueError(f"--output-high-water: must be >= 1, got {high_water}")
    if not (math.isfinite(stall_s) and stall_s > 0):
        raise ValueError(f"--output-stall-s: must be a finite number > 0, got {stall_s}")


def _label(dest: bytes) -> str:
    """A destination as the logs name it."""
    return "outputs socket" if dest == PUSH else "client"


def _is_step(frames: list[bytes]) -> bool:
    """Whether a queued message is a step message (``[envelope, record]``) rather than a
    reply (``[reply]``, or ``["", reply]`` to a REQ socket)."""
    return len(frames) == 2 and frames[0] != b""


def engine_dead_reason(exc: Exception) -> str:
    """The reason every open request's error carries when the engine dies."""
    return f"engine_dead: {exc}"


def death_step(step: int, request_ids: Sequence[str]) -> PublishedStep:
    """The step that ends ``request_ids`` because the engine died: each an aborted (``-9``)
    slot with no tokens and ``finish_reason="abort"``. No drafts totals: the counts died
    with the engine."""
    n = len(request_ids)
    zeros = np.zeros(n, dtype=np.int64)
    record = pack_step_record(
        np.zeros((n, 1), dtype=np.int64), zeros, np.ones(n, dtype=bool), zeros, zeros
    )
    return PublishedStep(
        step=step, request_ids=list(request_ids), finish_reasons=["abort"] * n, record=record
    )


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


class ServerState:
    """What the owner tasks share (module docstring). Create the server through
    :func:`spectrio.wire.server.serve`."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        max_request_bytes: int,
        output_high_water: int,
        tap_buffer: int,
        output_stall_s: float = 10.0,
        rate: float | None = None,
        burst: int = 64,
        curve: bool = False,
        tap: bool = False,
    ) -> None:
        check_output_bounds(output_high_water, output_stall_s)
        self.runtime = runtime
        self._limits = RateLimiter(rate, burst)
        self._curve = curve
        self.stats = ServerStats()
        self._max_request_bytes = max_request_bytes
        self._high_water = output_high_water
        self._stall_s = output_stall_s
        self._counter = SequenceCounter()
        # Destination (a client's routing id, or PUSH) -> its undelivered messages.
        self._outboxes: dict[bytes, Outbox] = {PUSH: self._new_outbox()}
        self._dest: dict[str, bytes] = {}  # wire request id -> its destination, to its final slot
        self._owners: dict[bytes, bytes] = {}  # routing id -> the owner that last used it
        self._closed_ids = itertools.count(1)
        self._stalled: dict[str, Error] = {}  # request ended for stalled outputs -> its error
        self._ended: collections.OrderedDict[str, tuple[bytes, Error]] = (
            collections.OrderedDict()
        )  # request ended for stalled outputs -> (its owner, the error), for Abort replies
        self._changed = Notifier()  # on every queue, send or drop
        self._supervise = trio.Event()  # wakes the supervisor early (a connection closed)
        self._tap_tx, self._tap_rx = trio.open_memory_channel[list[bytes]](tap_buffer)
        self._tap_enabled = tap
        tokenizer = PromptTokenizer(runtime)
        self._info = model_info(runtime, tokenizer.json)
        self._prompts = PromptQueue(
            tokenizer,
            vocab_size=runtime.loaded.config.vocab_size,
            max_model_len=runtime.config.max_model_len,
            chat=runtime.chat_prompt,
        )
        self._running: dict[str, bytes] = {}  # acknowledged request id -> its owner
        self._finished = Notifier()  # each time a request task ends
        self._router_waiter: trio.CancelScope | None = None
        self._closing = False
        self._linger_s = 0.0  # how long the sockets may keep unsent messages on close
        self.endpoints: ServerEndpoints | None = None  # set once bound
        self._last_step = 0  # the step number of the last step queued
        # Requests whose stream ended with the engine's death, before their final step:
        # the death step (:meth:`publish_engine_death`) ends them for the consumer.
        self._lost: dict[str, None] = {}
        self._dead: EngineDead | None = None
        #: set once the engine's death has been published (or there was nothing to say)
        self.death_published = trio.Event()

    def _new_outbox(self) -> Outbox:
        return Outbox(limit=self._high_water, stall_s=self._stall_s)

    def _outbox(self, dest: bytes) -> Outbox:
        box = self._outboxes.get(dest)
        if box is None:
            box = self._outboxes[dest] = self._new_outbox()
        return box

    @property
    def closing(self) -> bool:
        """Whether the server has stopped taking requests (:meth:`close`, :meth:`drain`)."""
        return self._closing

    @property
    def linger_s(self) -> float:
        """Seconds the sockets may keep unsent messages when they close: what
        :meth:`drain` left of its finish budget (0 before a drain)."""
        return self._linger_s

    def close(self) -> None:
        """Stop taking requests (``unavailable`` from now on). Called by :func:`serve` on
        exit; safe to call twice."""
        self._closing = True
        self._wake()

    def _wake(self) -> None:
        """Something was queued, sent or dropped: wake the socket owners and waiters."""
        self._changed.notify()
        if self._router_waiter is not None:
            self._router_waiter.cancel()

    def _gone(self, dest: bytes, box: Outbox) -> None:
        box.gone = True
        dropped = box.drop_all()
        self.stats.steps_dropped += dropped
        self.stats.clients_gone += 1
        running = sum(1 for d in self._dest.values() if d == dest)
        log.info("wire client gone", messages_dropped=dropped, requests=running)
        self._supervise.set()
        self._wake()

    def _flush_router(self, sock: TrioSocket) -> bool:
        """Hand every client's queued messages (replies and step messages, in order) to
        the ROUTER without waiting. Returns whether a client's queue was full, so the owner
        task tries again after :data:`RETRY_S`. A connection that closed, under a routing id
        libzmq assigned (which no later connection can have), is gone: its messages are
        dropped and the supervisor ends its requests."""
        blocked = False
        for dest, box in list(self._outboxes.items()):
            if dest == PUSH or box.gone:
                continue
            while (frames := box.head()) is not None:
                try:
                    if not sock.try_send_multipart([dest, *frames]):
                        blocked = True
                        break
                except zmq.ZMQError:  # EHOSTUNREACH: no connection with this routing id
                    if dest[:1] == b"\x00":
                        self._gone(dest, box)
                    else:  # a client-chosen routing id: it may reconnect
                        box.unreachable(trio.current_time())
                        blocked = True
                    break
                if _is_step(frames):
                    self.stats.steps_published += 1
                box.sent(trio.current_time())
        return blocked

    def _error(self, code: ErrorCode, reason: str, request_id: str | None) -> Error:
        self.stats.errors[code.value] = self.stats.errors.get(code.value, 0) + 1
        return Error(code=code, reason=reason, request_id=request_id)
