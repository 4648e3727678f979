"""``spectrio serve`` and ``spectrio client``: argument parsing and entry points.

Run directly as ``python -m spectrio.tools.serve_cli serve|client ...``, or wire the two
subcommands into ``tools/cli.py`` with :func:`add_serve_parser` and
:func:`add_client_parser` (each sets ``func`` on its subparser).

``serve`` checks its endpoints and locks its run directory before it loads the model,
then prints one JSON line to stdout once its sockets are bound (the resolved endpoints,
so ``tcp://127.0.0.1:*`` becomes a real port) and logs them. SIGINT or SIGTERM stops it
cleanly at any time: during start-up it stops loading and exits 0; while serving, the
first signal gives running requests ``--grace`` seconds, a second one cuts that to
zero, and in every case each accepted request still gets its final step (with
``finish_reason="abort"``, reason ``"shutdown"``, when it was cut) before the sockets
close and the socket files are removed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, cast

import structlog
import trio
import zmq

from spectrio.tools.logging_setup import configure_logging
from spectrio.tools.runtime_flags import add_runtime_flags, runtime_config

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from spectrio.core.config import RuntimeConfig
    from spectrio.http_api.front import HttpFront
    from spectrio.runtime.api import Runtime
    from spectrio.tools.metrics import RequestHooks
    from spectrio.wire.curve import CurveServerKeys
    from spectrio.wire.server import EndpointClaim, WireServer

log = structlog.get_logger("spectrio.serve")

__all__ = [
    "add_client_parser",
    "add_serve_parser",
    "build_parser",
    "client_main",
    "main",
    "serve_main",
]


def add_serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve", help="serve the runtime over ZeroMQ (docs/wire.md) and/or HTTP (docs/http.md)"
    )
    add_runtime_flags(p)
    p.add_argument("--requests", help="ROUTER endpoint (default: ipc:// under --run-dir)")
    p.add_argument(
        "--outputs",
        help="PUSH endpoint for requests submitted without stream, one consumer "
        "(default: ipc:// under --run-dir)",
    )
    p.add_argument("--tap", help="optional PUB endpoint for observers (may drop)")
    p.add_argument(
        "--run-dir",
        help="folder for default ipc:// endpoints "
        "(default: $XDG_RUNTIME_DIR/spectrio or <tmp>/spectrio-<uid>)",
    )
    p.add_argument(
        "--allow-public",
        action="store_true",
        help="allow endpoints other hosts or users can reach: a non-loopback address, "
        "a wildcard (binds every interface), an abstract ipc://@name; use CURVE with it",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=1 << 20,
        help="largest request frame read; a larger one gets too_large (default 1 MiB)",
    )
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=None,
        help="transport limit: libzmq drops the connection of a client that sends a larger "
        "message, without a reply (default 16x --max-request-bytes, at least 16 MiB)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds running requests get to finish on SIGINT/SIGTERM; a second "
        "signal cuts it to zero (the abort step and flush take at most 3 s more)",
    )
    p.add_argument(
        "--max-requests-per-s",
        type=float,
        default=None,
        help="per-client request-rate cap (token bucket, burst 64)",
    )
    p.add_argument(
        "--output-stall-s",
        type=float,
        default=10.0,
        metavar="S",
        help="a wire client (or the outputs socket) whose oldest unread step message has "
        "waited S seconds has its running requests ended with output_stalled (default 10)",
    )
    p.add_argument(
        "--output-high-water",
        type=int,
        default=1024,
        metavar="N",
        help="step messages queued for one wire client (or the outputs socket) beyond which "
        "its requests are ended the same way (default 1024)",
    )
    p.add_argument(
        "--curve-secret",
        default=None,
        help="CURVE: the server's NAME.key_secret (from `spectrio keys`); encrypts every socket",
    )
    p.add_argument(
        "--record",
        metavar="TRACE",
        default=None,
        help="append every accepted request and its result to this trace (docs/trace.md)",
    )
    p.add_argument(
        "--metrics",
        metavar="[HOST:]PORT",
        default=None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (host: 127.0.0.1 unless "
        "given; a non-loopback host needs --allow-public; port 0 picks a free one)",
    )
    p.add_argument(
        "--http",
        metavar="[HOST:]PORT",
        default=None,
        help="also serve the OpenAI-compatible HTTP API at http://HOST:PORT/v1 (docs/http.md; "
        "host: 127.0.0.1 unless given; a non-loopback host needs --allow-public; port 0 "
        "picks a free one), with /health and /metrics on the same port",
    )
    p.add_argument(
        "--no-zmq",
        action="store_true",
        help="serve HTTP only: bind no ZeroMQ endpoint and claim no run directory",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="HTTP: require 'Authorization: Bearer KEY' on /v1/ routes "
        f"(default: ${API_KEY_ENV} when set)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="HTTP: the model's name in /v1/models and the requests' model field "
        "(default: --model as given)",
    )
    p.set_defaults(func=serve_main)


API_KEY_ENV = "SPECTRIO_API_KEY"


def add_client_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("client", help="stream one request through a running server")
    from spectrio.tools.chat_flags import add_chat_flags

    add_chat_flags(p)  # PROMPT, or --chat MESSAGE [--system TEXT], as `spectrio generate`
    p.add_argument("--requests", required=True, help="the server's requests endpoint")
    p.add_argument(
        "--outputs",
        default=None,
        help="not needed since wire schema 1.7 (the request's output comes back on the "
        "requests connection); accepted, and unused, so older command lines run",
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for any reply")
    p.add_argument("--json", action="store_true", help="print one JSON object (docs/cli.md)")
    p.add_argument(
        "--curve-server-key",
        default=None,
        help="CURVE: the server's public NAME.key, for a server run with --curve-secret",
    )
    from spectrio.tools.sampling_flags import add_sampling_flags

    add_sampling_flags(p)  # the same sampling flags as `spectrio generate`
    p.set_defaults(func=client_main)


def add_keys_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("keys", help="create a CURVE key pair for `serve --curve-secret`")
    p.add_argument("directory", help="folder for NAME.key (public) and NAME.key_secret")
    p.add_argument("--name", default="server")
    p.set_defaults(func=keys_main)


def keys_main(args: argparse.Namespace) -> int:
    from spectrio.wire.curve import create_keys

    public, secret = create_keys(args.directory, args.name)
    print(json.dumps({"public": str(public), "secret": str(secret)}))
    return 0


class _StartupSignals:
    """SIGINT and SIGTERM outside Trio's signal receiver. These Python handlers only
    record the signal, so a stop requested during start-up is honoured once the start-up
    can be cancelled cleanly (exit 0, quietly). Paddle installs a C-level SIGTERM handler
    while it is imported (inside this block), and spectrio puts these back right after
    (:mod:`spectrio.models.host_state`).

    On exit the two signals are ignored: the server is done and the process is exiting,
    and Python's finalization would otherwise put back the default action, so a late
    signal would kill a process that already shut down cleanly.

    A signal during Paddle's import itself still meets Paddle's handler."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def _record(self, signum: int, frame: object) -> None:
        self.received.append(signum)

    def __enter__(self) -> _StartupSignals:
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


async def _serve_async(
    args: argparse.Namespace,
    config: RuntimeConfig,
    endpoints: tuple[str, str, str | None] | None,
    claim: EndpointClaim | None,
    curve: CurveServerKeys | None,
    ctx: zmq.Context[zmq.Socket[bytes]],
    early: _StartupSignals,
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
    or ``--http``, an :class:`~spectrio.tools.metrics.ObservedRuntime` that reports each
    request to the trace recorder and the metrics. Also starts the metrics task and the
    ``--metrics`` HTTP server (stopped with the nursery). Returns it, extra keys for the
    ready line and the metrics registry (``/metrics`` of ``--http`` serves it too)."""
    import time

    hooks: list[RequestHooks] = []
    extra: dict[str, str] = {}
    registry: CollectorRegistry | None = None
    if args.record_writer is not None:
        from spectrio.tools.trace import TraceRecorder

        hooks.append(TraceRecorder(args.record_writer, time.perf_counter()))
    if args.metrics_address is not None or args.http_address is not None:
        from spectrio.tools.metrics import ServeMetrics

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
    from spectrio.tools.metrics import ObservedRuntime

    return cast("Runtime", ObservedRuntime(rt, hooks)), extra, registry


def serve_main(args: argparse.Namespace) -> int:
    """Exit status: 0 after a clean stop (a signal at any time, start-up included);
    2 when the configuration, the endpoints or the run directory are refused (before the
    model is loaded)."""
    from spectrio.runtime.tp import GroupEnv

    group_env = GroupEnv.from_environ()
    if group_env is not None and group_env.rank != 0:
        # Started by `python -m paddle.distributed.launch ... serve`: a follower rank binds
        # nothing and writes no output; it computes what rank 0 broadcasts.
        from spectrio.runtime.tp_follower import run_follower

        return run_follower()
    code = _serve_main(args)
    if runtime_config_tp(args) > 1:
        # A rank's device thread may still sit in a collective with a dead peer, and
        # Paddle's teardown of a broken group can block: everything was flushed and
        # closed above, so leave without the interpreter's teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def runtime_config_tp(args: argparse.Namespace) -> int:
    """The group size the served config had (1 when it never got that far)."""
    return int(getattr(args, "resolved_tp", 1))


def _serve_main(args: argparse.Namespace) -> int:
    args.metrics_address = None
    args.http_address = None
    args.http_socket = None
    args.record_writer = None
    with _StartupSignals() as early:
        from spectrio.core.config import ConfigError
        from spectrio.tools.metrics import parse_metrics_address
        from spectrio.wire.curve import CurveError, load_server_keys
        from spectrio.wire.server import (
            EndpointRefused,
            ServerRunning,
            check_output_bounds,
            claim_endpoints,
            default_endpoints,
            message_cap,
        )

        claim: EndpointClaim | None = None
        endpoints: tuple[str, str, str | None] | None = None
        curve: CurveServerKeys | None = None
        try:
            config = runtime_config(args)
            message_cap(args.max_request_bytes, args.max_message_bytes)  # ValueError: refused
            check_output_bounds(args.output_high_water, args.output_stall_s)
            args.resolved_tp = config.tensor_parallel_size
            _check_fronts(args)
            # Before the model loads: a refused or second server fails at once.
            if args.http is not None:
                args.http_address = parse_metrics_address(
                    args.http, allow_public=args.allow_public, flag="--http"
                )
                from spectrio.http_api.server import bind_socket

                try:  # bound now: a taken port is refused before the model loads
                    args.http_socket = bind_socket(*args.http_address)
                except OSError as exc:
                    raise ValueError(f"--http: cannot serve on {args.http}: {exc}") from None
            if args.metrics is not None:
                args.metrics_address = parse_metrics_address(
                    args.metrics, allow_public=args.allow_public
                )
            if not args.no_zmq:
                defaults = (
                    default_endpoints(args.run_dir)
                    if not (args.requests and args.outputs)
                    else None
                )
                requests = args.requests or (defaults.requests if defaults else None)
                outputs = args.outputs or (defaults.outputs if defaults else None)
                assert requests is not None and outputs is not None
                endpoints = (requests, outputs, args.tap)
                curve = load_server_keys(args.curve_secret) if args.curve_secret else None
            if args.record is not None:
                from spectrio.tools.trace import TraceWriter, runtime_fields

                args.record_writer = TraceWriter(
                    args.record,
                    source="serve",
                    model=config.model,
                    runtime=runtime_fields(config),
                    append=True,
                )
            if endpoints is not None:
                claim = claim_endpoints(*endpoints, allow_public=args.allow_public)
        except (ConfigError, EndpointRefused, ServerRunning, CurveError, ValueError) as exc:
            if args.record_writer is not None:
                args.record_writer.close()
            if args.http_socket is not None:
                args.http_socket.close()
            print(f"error: {exc}", file=sys.stderr)
            return 2
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            with claim if claim is not None else contextlib.nullcontext():
                trio.run(_serve_async, args, config, endpoints, claim, curve, ctx, early)
                ctx.term()  # waits for the PUSH socket's last steps, for the time drain left
        except BaseExceptionGroup as group:  # from the task nurseries
            from spectrio.errors import EngineDead

            dead, rest = group.split(EngineDead)
            if dead is not None and rest is None:
                for leaf in _leaves(dead):
                    print(f"error: {leaf}", file=sys.stderr)
                return 1
            refused, other = group.split((ConfigError, ValueError))
            if other is not None or refused is None:
                raise
            for leaf in _leaves(refused):
                print(f"error: {leaf}", file=sys.stderr)
            return 2
        except (ConfigError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        finally:
            ctx.destroy(linger=0)
            if args.record_writer is not None:
                args.record_writer.close()
            if args.http_socket is not None:
                args.http_socket.close()  # a no-op once Hypercorn took it over
    return 0


def _check_fronts(args: argparse.Namespace) -> None:
    """``--no-zmq`` needs ``--http`` (something must be served) and takes no ZeroMQ
    flag; the HTTP-only flags need ``--http``. Raises ValueError with the rule."""
    if args.no_zmq:
        if args.http is None:
            raise ValueError("--no-zmq: nothing left to serve; add --http [HOST:]PORT")
        given = [
            flag
            for flag, value in (
                ("--requests", args.requests),
                ("--outputs", args.outputs),
                ("--tap", args.tap),
                ("--run-dir", args.run_dir),
                ("--curve-secret", args.curve_secret),
            )
            if value is not None
        ]
        if given:
            raise ValueError(f"--no-zmq: {', '.join(given)} configure ZeroMQ endpoints")
    if args.http is None:
        given = [
            flag
            for flag, value in (
                ("--api-key", args.api_key),
                ("--served-model-name", args.served_model_name),
            )
            if value is not None
        ]
        if given:
            raise ValueError(f"{', '.join(given)}: HTTP settings need --http [HOST:]PORT")


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return out


def client_main(args: argparse.Namespace) -> int:
    import zmq

    from spectrio.stages.output_processor import logprob_json
    from spectrio.tools.chat_flags import chat_messages, prompt_or_chat_error
    from spectrio.tools.sampling_flags import sampling_params
    from spectrio.wire.client import Client, RequestRefused, SequenceGap

    problem = prompt_or_chat_error(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    messages = chat_messages(args)
    params = sampling_params(args)
    totals: dict[str, int | None] = {"total_drafts": None, "total_accepted": None}
    logprobs: list[dict[str, object]] = []
    ids: list[int] = []
    text = ""
    reason: str | None = None
    try:
        curve = None
        if args.curve_server_key:
            from spectrio.wire.curve import client_keys

            curve = client_keys(args.curve_server_key)
        # Its own outputs, on its own connection: any number of clients share a server.
        with Client(args.requests, timeout_s=args.timeout, curve=curve) as client:
            # The prompt is echoed with the first chunk, once the server has accepted the
            # request: a refused one leaves stdout empty, with the error on stderr alone.
            echo = ""
            if messages is not None:  # the answer alone is streamed: no prompt to echo
                chunks = client.chat(messages, params)
            else:
                echo = "" if args.json else args.prompt
                chunks = client.generate(args.prompt, params)
            for chunk in chunks:
                if echo:
                    sys.stdout.write(echo)
                    echo = ""
                ids += chunk.token_ids
                text += chunk.text
                logprobs += map(logprob_json, chunk.logprobs or ())
                reason = chunk.finish_reason
                if chunk.finished:
                    totals = {
                        "total_drafts": chunk.total_drafts,
                        "total_accepted": chunk.total_accepted,
                    }
                if not args.json:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
    except RequestRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except zmq.Again:
        print(f"error: no reply from the server within {args.timeout}s", file=sys.stderr)
        return 3
    except SequenceGap as exc:
        print(f"error: lost step messages: {exc}", file=sys.stderr)
        return 2
    except (ValueError, zmq.ZMQError) as exc:  # a malformed step message, a socket error
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out: dict[str, object] = {
            "text": text,
            "token_ids": ids,
            "finish_reason": reason,
            **totals,
        }
        if params.logprobs is not None:
            out["logprobs"] = logprobs
        print(json.dumps(out))
    else:
        print()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spectrio", description="spectrio wire server and client")
    parser.add_argument("--log-level", default="warning", help="structlog level (default: warning)")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_client_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging(args.log_level)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
