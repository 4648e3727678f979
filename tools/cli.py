"""The ``spectrio`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time

import trio

from spectrio.tools.logging_setup import configure_logging
from spectrio.tools.runtime_flags import add_runtime_flags, runtime_config


async def _generate_async(args: argparse.Namespace) -> dict[str, object]:
    from spectrio import SamplingParams, open_runtime
    from spectrio.tools.generation_stats import GenerationStats

    async with open_runtime(runtime_config(args)) as rt:
        stats = GenerationStats()
        ids: list[int] = []
        text = ""
        reason = None
        t0 = time.perf_counter()
        if not args.json:
            sys.stdout.write(args.prompt)
        async for delta in rt.generate(args.prompt, SamplingParams(max_tokens=args.max_tokens)):
            stats.add(delta)
            ids += delta.token_ids
            text += delta.text
            reason = delta.finish_reason
            if not args.json:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
        seconds = time.perf_counter() - t0
    return {
        "text": text,
        "token_ids": ids,
        "finish_reason": reason,
        "num_steps": stats.num_steps,
        "mean_accept_len": round(stats.mean_accept_len, 4),
        "accepted_per_position": [round(x, 4) for x in stats.accepted_per_position],
        "seconds": round(seconds, 4),
        "tokens_per_second": round(len(ids) / seconds, 2) if seconds > 0 else None,
    }


def _generate(args: argparse.Namespace) -> int:
    from spectrio import ConfigError, InvalidRequest

    try:
        result = trio.run(_generate_async, args)
    except (ConfigError, InvalidRequest) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print()
        print(
            f"[{len(result['token_ids'])} tokens in {result['num_steps']} steps, "  # type: ignore[arg-type]
            f"mean accepted length {result['mean_accept_len']}, "
            f"finish_reason={result['finish_reason']}, "
            f"{result['tokens_per_second']} tok/s]",
            file=sys.stderr,
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spectrio", description="Speculative decoding with MTP heads"
    )
    parser.add_argument("--log-level", default="warning", help="structlog level (default: warning)")
    from spectrio import __version__

    parser.add_argument("--version", action="version", version=f"spectrio {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream a greedy continuation through the pipeline")
    gen.add_argument("prompt")
    add_runtime_flags(gen)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.set_defaults(func=_generate)

    from spectrio.tools.serve_cli import add_client_parser, add_keys_parser, add_serve_parser

    add_serve_parser(sub)
    add_client_parser(sub)
    add_keys_parser(sub)

    from spectrio.tools.diff import add_diff_parser
    from spectrio.tools.replay import add_replay_parser
    from spectrio.tools.trace import add_trace_parser

    add_trace_parser(sub)
    add_replay_parser(sub)
    add_diff_parser(sub)

    sub.add_parser(
        "train", help="train the bundled model (see `spectrio train --help`)", add_help=False
    )
    sub.add_parser(
        "bench", help="throughput benchmark (see `spectrio bench --help`)", add_help=False
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    configure_logging(args.log_level)
    if args.command == "train":
        from spectrio.tools import train

        return train.main(rest)
    if args.command == "bench":
        from spectrio.tools import bench

        return bench.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if getattr(args, "max_tokens", 1) < 1:
        parser.error("--max-tokens must be >= 1")
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # stdout closed early (``spectrio diff a b | head``): quiet, like other tools.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
