"""``spectrio client``: stream one request through a running server (the wire client)."""

from __future__ import annotations

import argparse
import json
import sys


def add_client_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("client", help="stream one request through a running server")
    from spectrio.tools.cli.chat_flags import add_chat_flags

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
    from spectrio.tools.cli.sampling_flags import add_sampling_flags

    add_sampling_flags(p)  # the same sampling flags as `spectrio generate`
    p.set_defaults(func=client_main)


def client_main(args: argparse.Namespace) -> int:
    import zmq

    from spectrio.stages.output.output_processor import logprob_json
    from spectrio.tools.cli.chat_flags import chat_messages, prompt_or_chat_error
    from spectrio.tools.cli.sampling_flags import sampling_params
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
