"""``spectrio serve`` and ``spectrio client``: argument parsing and entry points.

Run directly as ``python -m spectrio.tools.serve_cli serve|client ...``, or wire the two
subcommands into ``tools/cli.py`` with :func:`add_serve_parser` and
:func:`add_client_parser` (each sets ``func`` on its subparser).

``serve`` prints one JSON line to stdout once its sockets are bound (the resolved
endpoints, so ``tcp://127.0.0.1:*`` becomes a real port) and logs them. SIGINT or
SIGTERM stops it cleanly: requests still running end with ``finish_reason="abort"``
(reason ``"shutdown"``), and the sockets close.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import AsyncIterator

import structlog
import trio
from spectrio.tools.runtime_flags import add_runtime_flags, runtime_config
from spectrio.tools.logging_setup import configure_logging

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
    p = sub.add_parser("serve", help="serve the runtime over ZeroMQ (docs/wire.md)")
    add_runtime_flags(p)
    p.add_argument("--requests", help="ROUTER endpoint (default: ipc:// under --run-dir)")
    p.add_argument("--outputs", help="PUSH endpoint, lossless (default: ipc:// under --run-dir)")
    p.add_argument("--tap", help="optional PUB endpoint for observers (may drop)")
    p.add_argument("--run-dir", help="folder for default ipc:// endpoints "
                   "(default: $XDG_RUNTIME_DIR/spectrio or <tmp>/spectrio-<uid>)")
    p.add_argument("--allow-public", action="store_true",
                   help="allow binding a non-loopback tcp:// host")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20)
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds running requests get to finish on SIGINT/SIGTERM")
    p.add_argument("--max-requests-per-s", type=float, default=None,
                   help="per-client request-rate cap (token bucket, burst 64)")
    p.add_argument("--curve-secret", default=None,
                   help="CURVE: the server's NAME.key_secret (from `spectrio keys`); encrypts every socket")
    p.set_defaults(func=serve_main)


def add_client_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("client", help="stream one request through a running server")
    p.add_argument("prompt")
    p.add_argument("--requests", required=True, help="the server's requests endpoint")
    p.add_argument("--outputs", required=True, help="the server's outputs endpoint")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for any reply")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--curve-server-key", default=None,
                   help="CURVE: the server's public NAME.key, for a server run with --curve-secret")
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


async def _serve_async(args: argparse.Namespace) -> None:
    from spectrio.runtime.api import open_runtime
    from spectrio.runtime.server import WireServer, default_endpoints, serve

    config = runtime_config(args)
    defaults = default_endpoints(args.run_dir) if not (args.requests and args.outputs) else None
    requests = args.requests or (defaults.requests if defaults else None)
    outputs = args.outputs or (defaults.outputs if defaults else None)
    assert requests is not None and outputs is not None
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        curve = None
        if args.curve_secret:
            from spectrio.wire.curve import load_server_keys

            curve = load_server_keys(args.curve_secret)
        async with open_runtime(config) as rt, trio.open_nursery() as nursery:
            server = await nursery.start(
                lambda task_status=trio.TASK_STATUS_IGNORED: serve(  # type: ignore[misc]
                    rt, requests, outputs, args.tap, allow_public=args.allow_public,
                    max_request_bytes=args.max_request_bytes,
                    max_requests_per_s=args.max_requests_per_s, curve=curve,
                    task_status=task_status,
                )
            )
            assert isinstance(server, WireServer) and server.endpoints is not None
            ep = server.endpoints
            print(json.dumps({"requests": ep.requests, "outputs": ep.outputs, "tap": ep.tap}),
                  flush=True)
            async for signum in signals:
                log.info("shutting down", signal=signal.Signals(signum).name,
                         grace_s=args.grace)
                break
            # A second signal skips the grace period.
            with trio.CancelScope() as drain_scope:
                nursery.start_soon(_cancel_on_signal, signals, drain_scope)
                await server.drain(args.grace)
            nursery.cancel_scope.cancel()


async def _cancel_on_signal(
    signals: AsyncIterator[int], scope: trio.CancelScope
) -> None:
    async for _ in signals:
        scope.cancel()
        return


def serve_main(args: argparse.Namespace) -> int:
    from spectrio.runtime.config import ConfigError

    try:
        trio.run(_serve_async, args)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def client_main(args: argparse.Namespace) -> int:
    import zmq
    from spectrio.runtime.params import SamplingParams
    from spectrio.wire.client import Client, RequestRefused

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    ids: list[int] = []
    text = ""
    reason: str | None = None
    try:
        curve = None
        if args.curve_server_key:
            from spectrio.wire.curve import client_keys

            curve = client_keys(args.curve_server_key)
        with Client(args.requests, args.outputs, timeout_s=args.timeout, curve=curve) as client:
            if not args.json:
                sys.stdout.write(args.prompt)
            for chunk in client.generate(args.prompt, params):
                ids += chunk.token_ids
                text += chunk.text
                reason = chunk.finish_reason
                if not args.json:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
    except RequestRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except zmq.Again:
        print(f"error: no reply from the server within {args.timeout}s", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps({"text": text, "token_ids": ids, "finish_reason": reason}))
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
