"""What ``spectrio serve`` runs once its flags and endpoints passed their checks: the
signals by phase (start-up, serving, draining), the runtime, its ZeroMQ and HTTP fronts,
the metrics and the trace recorder that observe it, and the drain."""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import signal
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, cast

import structlog
import trio
import zmq

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from spectrio.core.config import RuntimeConfig
    from spectrio.http_api.front import HttpFront
    from spectrio.runtime.api import Runtime
    from spectrio.runtime.metrics import RequestHooks
    from spectrio.wire.curve import CurveServerKeys
    from spectrio.wire.server import EndpointClaim, WireServer

log = structlog.get_logger("spectrio.serve")

API_KEY_ENV = "SPECTRIO_API_KEY"


class StartupSignals:
    """SIGINT and SIGTERM outside Trio's signal receiver. These Python handlers only
    record the signal, so a stop requested during start-up is honoured once the start-up
    can be cancelled cleanly (exit 0, quietly). Paddle installs a C-level SIGTERM handler
    while it is imported (inside this block), and spectrio puts these back right after
    (:mod:`spectrio.models.ops.host_state`).

    On exit the two signals are ignored: the server is done and the process is exiting,
    and Python's finalization would otherwise put back the default action, so a late
    signal would kill a process that already shut down cleanly.

    A signal during Paddle's import itself still meets Paddle's handler."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def _record(self, signum: int, frame: object) -> None:
        self.received.append(signum)

    def __enter__(self) -> StartupSignals:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)


class _Stopper:
    """What a signal does, by phase. During start-up it cancels the start-up. Once the
    runtime is up, the first signal starts the drain (``requested``) and any later one
    cuts its grace period to zero (``cut``); the drain still publishes every request's
    final step, within a bounded time."""

    def __init__(self) -> None:
        self.startup: trio.CancelScope | None = None
        self.requested = trio.Event()
        self.cut = trio.Event()

    def on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.startup is not None:
            log.warning("stopping during start-up", signal=name)
            self.startup.cancel()
        elif not self.requested.is_set():
            log.warning("shutting down: running requests get the grace period", signal=name)
            self.requested.set()
        elif not self.cut.is_set():
            log.warning("second signal: grace period cut; aborting running requests", signal=name)
            self.cut.set()

    async def watch(self, signals: AsyncIterator[int]) -> None:
        async for signum in signals:
            self.on_signal(signum)


async def serve_async(
    args: argparse.Namespace,
    config: RuntimeConfig,
    endpoints: tuple[str, str, str | None] | None,
    claim: EndpointClaim | None,
    curve: CurveServerKeys | None,
    ctx: zmq.Context[zmq.Socket[bytes]],
    early: StartupSignals,
) -> None:
    from spectrio.runtime.api import open_runtime

    stopper = _Stopper()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        if early.received:
            log.warning("stopped before start-up", signal=signal.Signals(early.received[0]).name)
            return
        async with trio.open_nursery() as top:
            top.start_soon(stopper.watch, signals)
            with trio.CancelScope() as startup:
                stopper.startup = startup
                log.info("loading the model", model=config.model)
                async with open_runtime(config) as rt, trio.open_nursery() as nursery:
                    stopper.startup = None  # from here a signal drains instead
                    # Structured output's vocabulary index holds the GIL for a moment once:
                    # a server builds it before it serves, not under its first request.
                    await trio.to_thread.run_sync(rt.grammar.warm)
                    served, extra, registry = _observe(rt, args, nursery)
                    front = _http_front(served, args, config, registry)
                    servers: list[WireServer] = []
                    nursery.start_soon(_exit_when_dead, rt, servers, front)
                    ready: dict[str, str | None] = {"requests": None, "outputs": None, "tap": None}
                    server = None
                    if endpoints is not None:
                        server = await _start_wire(
                            served, args, endpoints, claim, curve, ctx, nursery
                        )
                        assert server.endpoints is not None
                        servers.append(server)
                        ep = server.endpoints
                        ready = {"requests": ep.requests, "outputs": ep.outputs, "tap": ep.tap}
                    if front is not None:
                        from spectrio.http_api.server import serve_http

                        ready["http"] = await nursery.start(
                            functools.partial(serve_http, front, sock=args.http_socket)
                        )
                    # The model, the libraries and the warm-up made every object the
                    # process keeps; out of the collector's reach, a full collection scans
                    # only what serving allocates (tens of ms less per pause).
                    gc.freeze()
                    print(json.dumps({**ready, **extra}), flush=True)
                    await stopper.requested.wait()
                    async with trio.open_nursery() as draining:  # both fronts at once
                        if server is not None:
                            draining.start_soon(
                                functools.partial(server.drain, args.grace, cut=stopper.cut)
                            )
                        if front is not None:
                            draining.start_soon(
                                functools.partial(front.drain, args.grace, cut=stopper.cut)
                            )
                    nursery.cancel_scope.cancel()
            if startup.cancelled_caught:
                log.warning("stopped during start-up")
            top.cancel_scope.cancel()


async def _start_wire(
    served: Runtime,
    args: argparse.Namespace,
    endpoints: tuple[str, str, str | None],
    claim: EndpointClaim | None,
    curve: CurveServerKeys | None,
    ctx: zmq.Context[zmq.Socket[bytes]],
    nursery: trio.Nursery,
) -> WireServer:
    """Bind the ZeroMQ endpoints and serve them in ``nursery``."""
    from spectrio.wire.server import WireServer, serve

    requests, outputs, tap = endpoints
    server = await nursery.start(
        lambda task_status=trio.TASK_STATUS_IGNORED: serve(
            served,
            requests,
            outputs,
            tap,
            allow_public=args.allow_public,
            context=ctx,
            claim=claim,
            max_request_bytes=args.max_request_bytes,
            max_message_bytes=args.max_message_bytes,
            max_requests_per_s=args.max_requests_per_s,
            output_stall_s=args.output_stall_s,
            output_high_water=args.output_high_water,
            curve=curve,
            task_status=task_status,
        )
    )
    assert isinstance(server, WireServer)
    return server


def _http_front(
    served: Runtime,
    args: argparse.Namespace,
    config: RuntimeConfig,
    registry: CollectorRegistry | None,
) -> HttpFront | None:
    """The HTTP front of ``--http`` (None without it)."""
    if args.http_address is None:
        return None
    from spectrio.http_api.front import HttpFront

    host, _ = args.http_address
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if not _is_loopback(host) and not key:
        log.warning(
            "serving HTTP beyond this machine without an API key: anyone who can connect "
            f"can submit requests (--api-key or ${API_KEY_ENV})",
            host=host,
        )
    return HttpFront(
        served,
        model_name=args.served_model_name or config.model,
        api_key=key or None,
        max_body_bytes=args.max_request_bytes,
        max_requests_per_s=args.max_requests_per_s,
        registry=registry,
    )


def _is_loopback(host: str) -> bool:
    import ipaddress

    return ipaddress.ip_address(host).is_loopback


async def _exit_when_dead(
    rt: Runtime, servers: Sequence[WireServer], front: HttpFront | None = None
) -> None:
    """A dead engine (a tensor-parallel rank died, a stage failed) ends the server at
    once, not at the next request: raise its :class:`EngineDead` here, once each server
    has told its consumers (the last step that aborts every open request, bounded by
    :data:`~spectrio.wire.server.DEFAULT_FINISH_S`) and open HTTP responses have sent
    their error event and ``[DONE]`` (the runtime handed every stream the engine's
    death; HTTP requests meanwhile get 503)."""
    from spectrio.wire.server import DEFAULT_FINISH_S

    exc = await rt.wait_dead()
    with trio.move_on_after(DEFAULT_FINISH_S + 1.0):
        for server in servers:
            await server.death_published.wait()
        if front is not None:
            await front.wait_idle()
    raise exc


def _observe(
    rt: Runtime, args: argparse.Namespace, nursery: trio.Nursery
) -> tuple[Runtime, dict[str, str], CollectorRegistry | None]:
    """The runtime the servers get: ``rt`` itself, or, with ``--record``, ``--metrics``
    or ``--http``, an :class:`~spectrio.runtime.metrics.ObservedRuntime` that reports each
    request to the trace recorder and the metrics. Also starts the metrics task and the
    ``--metrics`` HTTP server (stopped with the nursery). Returns it, extra keys for the
    ready line and the metrics registry (``/metrics`` of ``--http`` serves it too)."""
    import time

    hooks: list[RequestHooks] = []
    extra: dict[str, str] = {}
    registry: CollectorRegistry | None = None
    if args.record_writer is not None:
        from spectrio.tools.measurement.trace_record import TraceRecorder

        hooks.append(TraceRecorder(args.record_writer, time.perf_counter()))
    if args.metrics_address is not None or args.http_address is not None:
        from spectrio.runtime.metrics import ServeMetrics

        metrics = ServeMetrics()
        registry = metrics.registry
        hooks.append(metrics)
        remove = metrics.attach(rt)
        http = None
        if args.metrics_address is not None:
            try:
                http, url = metrics.serve_http(*args.metrics_address)
            except OSError as exc:
                remove()
                raise ValueError(f"--metrics: cannot serve on {args.metrics}: {exc}") from None
            extra["metrics"] = url
            log.info("metrics", url=url)

        async def run_metrics() -> None:
            try:
                await metrics.run(rt)
            finally:
                remove()
                if http is not None:
                    http.shutdown()

        nursery.start_soon(run_metrics)
    if not hooks:
        return rt, extra, registry
    from spectrio.runtime.metrics import ObservedRuntime

    return cast("Runtime", ObservedRuntime(rt, hooks)), extra, registry
