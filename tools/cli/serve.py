"""``spectrio serve`` and ``spectrio keys``: the flags, the checks made before the model
loads, and the entry points; what a server then runs is :mod:`.serve_run`'s.

Run directly as ``python -m spectrio.tools.cli.serve serve|client ...`` (``client`` is
:mod:`.client`'s), or wire the subcommands into ``tools/cli/commands.py`` with
:func:`add_serve_parser` and :func:`~spectrio.tools.cli.client.add_client_parser` (each
sets ``func`` on its subparser).

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
import json
import os
import sys
from typing import TYPE_CHECKING

import trio
import zmq

from spectrio.tools.cli.client import add_client_parser
from spectrio.tools.cli.logging_setup import configure_logging
from spectrio.tools.cli.runtime_flags import add_runtime_flags, runtime_config
from spectrio.tools.cli.serve_run import API_KEY_ENV, StartupSignals, serve_async

if TYPE_CHECKING:
    from spectrio.wire.curve import CurveServerKeys
    from spectrio.wire.server import EndpointClaim


__all__ = [
    "add_keys_parser",
    "add_serve_parser",
    "build_parser",
    "keys_main",
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
    with StartupSignals() as early:
        from spectrio.core.config import ConfigError
        from spectrio.runtime.metrics import parse_metrics_address
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
                from spectrio.tools.measurement.trace_format import TraceWriter, runtime_fields

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
                trio.run(serve_async, args, config, endpoints, claim, curve, ctx, early)
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
