"""ZeroMQ endpoints for a running :class:`~spectrio.runtime.api.Runtime` (wire schema v1,
``docs/wire.md``).

Three sockets, each driven by exactly one owner task (and a supervisor task that ends
the requests of destinations that stopped reading):

* **requests** (ROUTER): every frame is untrusted. It is decoded with
  :func:`spectrio.wire.codec.decode_request` (the size cap comes first) and checked with
  :func:`~spectrio.wire.codec.check_submit`; every request gets an ``Ack`` or an
  ``Error`` with a specific code. A valid ``Submit`` runs ``runtime.generate`` in a task of
  its own; its output reaches consumers only through the step stream.
* **streams** (on the requests socket, schema 1.7): a ``Submit`` with ``stream`` gets
  the request's step messages back on the connection that sent it, after its ``Ack``:
  each client reads its own, sliced from the step to its requests
  (:func:`spectrio.wire.codec.slice_step`), in order and complete, and any number of
  clients share one server.
* **outputs** (PUSH): one ``[envelope, record]`` message per step for the requests
  submitted without ``stream``, with per-request sequence numbers
  (:class:`~spectrio.wire.codec.SequenceCounter`). PUSH deals messages round-robin, so it
  serves one consumer process. A step with none of these requests is not sent there.
* **tap** (PUB, optional): every step, whole, for observers. It drops when a subscriber
  is slow or when its bounded buffer is full; sequence numbers make the gap visible.

Nothing a client does makes the request task wait on that client:

* Replies are queued on the client's connection, behind its step messages, and sent
  without waiting. A client that does not read fills its own queue; once that holds
  ``output_high_water`` messages its replies are dropped and counted
  (``stats.replies_dropped``), and every other client is served as before.
* Admission (:mod:`spectrio.wire.admission`) comes before any cost: per-client rate
  limits, the size caps, and a text prompt bounded before it is tokenized (one whose
  UTF-8 length already proves it has ``max_model_len`` tokens or more gets
  ``prompt_too_long`` at once). The rest, and chats (``messages``, rendered by the
  model's chat template), are tokenized in a worker thread (one at a time, with the GIL
  released) while the event loop keeps running; the ``Ack`` or ``Error`` follows when
  the tokenizer is done.
* ``Abort`` is scoped to the client that submitted the request: its CURVE public key when
  CURVE is on, else its ROUTER identity. Anyone else gets ``unknown_request``, the same
  reply as for an id that does not exist.

No consumer holds another. The server is a record sink of the runtime
(``add_record_sink``) that never waits: it slices each step to the destinations that
have requests in it and queues one message for each in that destination's
:class:`~spectrio.wire.outbox.Outbox` (a client connection, or the PUSH socket). HTTP and
in-process requests never reach a wire socket. A destination that does not read falls
behind alone: once its oldest queued message has waited ``output_stall_s`` seconds (or
``output_high_water`` messages are queued), the server aborts its running requests
(their final step carries an ``output_stalled`` error, and their KV blocks are freed);
once nothing of it runs and it has still read nothing for 3 times ``output_stall_s``
more, its messages are dropped and counted. A connection found closed (a send to its
routing id fails) is ended at once when libzmq chose the id, after
:data:`~spectrio.wire.outbox.RECONNECT_S` when its client did. Every other client, the
HTTP front and the embedding API go on as before.

``ipc://`` endpoints live in a run directory that one server at a time holds
(:func:`~spectrio.wire.endpoints.claim_endpoints`, in :mod:`spectrio.wire.endpoints`
with the endpoint policy): a second server is refused with the first one's pid, socket
files of a dead server are removed, and a server removes its own on exit. The names of
both modules stay importable from here.

Only rank 0 serves: on any other rank :func:`serve` binds nothing.

The server's shared state and helpers are :mod:`.server_state`, its output side
:mod:`.server_outputs` and its request side :mod:`.server_requests`; this module
assembles :class:`WireServer` from them and keeps every public name.
"""

from __future__ import annotations

import errno
import functools
from collections.abc import Callable

import msgspec
import trio
import zmq

from spectrio.runtime.api import Runtime
from spectrio.wire.admission import (
    MAX_TOKENIZING,
    MAX_TOKENIZING_PER_CLIENT,
    MIN_MESSAGE_BYTES,
    PromptTokenizer,
    message_cap,
)
from spectrio.wire.codec import (
    DEFAULT_MAX_REQUEST_BYTES,
)
from spectrio.wire.curve import ZAP_ENDPOINT, CurveServerKeys, run_zap_handler
from spectrio.wire.endpoints import (
    LOCK_FILE,
    EndpointClaim,
    EndpointRefused,
    ServerEndpoints,
    ServerRunning,
    check_endpoint,
    claim_endpoints,
    default_endpoints,
)
from spectrio.wire.server_outputs import OutputSide
from spectrio.wire.server_requests import RequestSide
from spectrio.wire.server_state import (
    DEFAULT_FINISH_S,
    PUSH,
    Context,
    ServerStats,
    check_output_bounds,
    death_step,
    engine_dead_reason,
    log,
    model_info,
)
from spectrio.wire.zmq_transport import TrioSocket, open_socket

__all__ = [
    "DEFAULT_FINISH_S",
    "LOCK_FILE",
    "MAX_TOKENIZING",
    "MAX_TOKENIZING_PER_CLIENT",
    "MIN_MESSAGE_BYTES",
    "PUSH",
    "EndpointClaim",
    "EndpointRefused",
    "PromptTokenizer",
    "ServerEndpoints",
    "ServerRunning",
    "ServerStats",
    "WireServer",
    "check_endpoint",
    "check_output_bounds",
    "claim_endpoints",
    "death_step",
    "default_endpoints",
    "engine_dead_reason",
    "message_cap",
    "model_info",
    "serve",
]


class WireServer(OutputSide, RequestSide):
    """The wire server: its output side and its request side over the state their owner
    tasks share. Create it through :func:`serve`."""


def _router_handover(
    configure: Callable[[zmq.Socket[bytes]], None] | None,
) -> Callable[[zmq.Socket[bytes]], None]:
    def apply(sock: zmq.Socket[bytes]) -> None:
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if configure is not None:
            configure(sock)

    return apply


async def serve(
    runtime: Runtime,
    requests_endpoint: str,
    outputs_endpoint: str,
    tap_endpoint: str | None = None,
    *,
    rank: int = 0,
    allow_public: bool = False,
    context: Context | None = None,
    claim: EndpointClaim | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_message_bytes: int | None = None,
    output_high_water: int = 1024,
    output_stall_s: float = 10.0,
    output_sndhwm: int = 1000,
    tap_buffer: int = 1024,
    max_requests_per_s: float | None = None,
    request_burst: int = 64,
    curve: CurveServerKeys | None = None,
    task_status: trio.TaskStatus[WireServer | None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``runtime`` over ZeroMQ until cancelled. Use with ``nursery.start`` to get
    the running :class:`WireServer` (its ``endpoints`` and ``stats``); None on a rank other
    than 0, which binds nothing.

    Endpoints must pass the endpoint policy (:func:`check_endpoint`; ``allow_public`` for
    anything beyond this machine, with a warning when CURVE is off). ``ipc://`` run
    directories are locked (:func:`claim_endpoints`); pass ``claim`` when the caller
    claimed the endpoints already (the CLI does, before loading the model), else serve
    claims them and releases them on exit.

    ``max_request_bytes`` is the largest request frame the server reads; a larger one
    gets ``too_large``. ``max_message_bytes`` (``zmq.MAXMSGSIZE``; default
    :func:`message_cap`, at least 16 MiB) is the transport's limit: libzmq disconnects a
    peer whose message is larger, without a reply, before the server sees it. It must be
    larger than ``max_request_bytes``.

    Outputs (module docstring): each destination, a client's connection or the PUSH
    socket, queues at most ``output_high_water`` messages before its requests are ended,
    and the requests of one whose oldest message has waited ``output_stall_s`` seconds
    are ended (``output_stalled``). ``output_sndhwm`` is the libzmq queue of each
    connection (``SNDHWM``: messages handed over but not yet read), below the server's.

    ``max_requests_per_s`` caps each client (by CURVE key or ROUTER identity) with a
    token bucket of ``request_burst``; a request over the cap gets ``rate_limited``.

    On cancellation, running requests are aborted (the runtime ends their streams with
    ``finish_reason="abort"``) and the sockets close; after :meth:`WireServer.drain`, the
    sockets keep unsent messages for what remains of the drain's finish budget.
    """
    if rank != 0:
        log.info("not rank 0: no sockets bound", rank=rank)
        task_status.started(None)
        await trio.sleep_forever()
    own_claim = claim is None
    if claim is None:
        claim = claim_endpoints(
            requests_endpoint, outputs_endpoint, tap_endpoint, allow_public=allow_public
        )
    cap = message_cap(max_request_bytes, max_message_bytes)
    ctx = context if context is not None else zmq.Context.instance()
    socks: list[TrioSocket] = []
    out: TrioSocket | None = None
    req: TrioSocket | None = None
    server: WireServer | None = None
    try:
        server = WireServer(
            runtime,
            max_request_bytes=max_request_bytes,
            output_high_water=output_high_water,
            output_stall_s=output_stall_s,
            tap_buffer=tap_buffer,
            rate=max_requests_per_s,
            burst=request_burst,
            curve=curve is not None,
            tap=tap_endpoint is not None,
        )
        zap: TrioSocket | None = None
        if curve is not None:
            try:
                zap = open_socket(ctx, zmq.REP, bind=ZAP_ENDPOINT, max_msg_size=None)
                socks.append(zap)
            except zmq.ZMQError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                log.warning(
                    "this context has a ZAP handler already; aborts are scoped to "
                    "the User-Id it sets, else to the connection"
                )
        configure = curve.apply if curve is not None else None  # encrypts every socket
        opened = functools.partial(open_socket, ctx, configure=configure, allow_public=allow_public)
        req = opened(
            zmq.ROUTER,
            bind=requests_endpoint,
            max_msg_size=cap,
            sndhwm=output_sndhwm,
            # A client that chose its routing id keeps its streams across a reconnect.
            configure=_router_handover(configure),
        )
        socks.append(req)
        out = opened(zmq.PUSH, bind=outputs_endpoint, max_msg_size=None, sndhwm=output_sndhwm)
        socks.append(out)
        tap: TrioSocket | None = None
        if tap_endpoint is not None:
            tap = opened(zmq.PUB, bind=tap_endpoint, max_msg_size=None)
            socks.append(tap)
        bound = ServerEndpoints(
            requests=req.socket.getsockopt_string(zmq.LAST_ENDPOINT),
            outputs=out.socket.getsockopt_string(zmq.LAST_ENDPOINT),
            tap=tap.socket.getsockopt_string(zmq.LAST_ENDPOINT) if tap is not None else None,
        )
        server.endpoints = bound
        if claim.public and curve is None:
            log.warning(
                "serving beyond this machine without CURVE: anyone who can connect "
                "can submit requests and read every output (see `spectrio keys`)",
                requests=bound.requests,
                outputs=bound.outputs,
                tap=bound.tap,
            )
        remove = runtime.add_record_sink(server.on_step, name="wire")
        try:
            async with trio.open_nursery() as nursery:
                if zap is not None:
                    nursery.start_soon(run_zap_handler, zap)
                nursery.start_soon(server.run_outputs, out)
                if tap is not None:
                    nursery.start_soon(server.run_tap, tap)
                nursery.start_soon(server.run_requests, req, nursery)
                nursery.start_soon(server.run_supervisor)
                nursery.start_soon(server.watch_engine)
                log.info(
                    "serving",
                    requests=bound.requests,
                    outputs=bound.outputs,
                    tap=bound.tap,
                    max_request_bytes=max_request_bytes,
                )
                task_status.started(server)
        finally:
            server.close()
            remove()
            log.info("server stopped", **msgspec.structs.asdict(server.stats))
    finally:
        linger_ms = int(server.linger_s * 1000) if server is not None else 0
        for sock in socks:
            sock.close(linger=linger_ms if sock is out or sock is req else 0)
        if own_claim:
            claim.release()
