"""The ``spectrio`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time

import trio

from spectrio.tools.cli.chat_flags import add_chat_flags, chat_messages, prompt_or_chat_error
from spectrio.tools.cli.logging_setup import LOG_FORMATS, configure_logging, split_logging_flags
from spectrio.tools.cli.runtime_flags import add_runtime_flags, runtime_config
from spectrio.tools.cli.sampling_flags import add_sampling_flags


async def _generate_async(args: argparse.Namespace) -> dict[str, object]:
    from spectrio import open_runtime
    from spectrio.stages.output.output_processor import RequestStats, logprob_json
    from spectrio.tools.cli.sampling_flags import sampling_params

    async with open_runtime(runtime_config(args)) as rt:
        stats = RequestStats()
        ids: list[int] = []
        text = ""
        reason = None
        totals: tuple[int | None, int | None] = (None, None)
        logprobs: list[dict[str, object]] = []
        params = sampling_params(args)
        t0 = time.perf_counter()
        messages = chat_messages(args)
        if messages is not None:  # the answer alone is streamed: no prompt to echo
            stream = rt.chat(messages, params)
        else:
            if not args.json:
                sys.stdout.write(args.prompt)
            stream = rt.generate(args.prompt, params)
        async for delta in stream:
            stats.add(delta)
            ids += delta.token_ids
            text += delta.text
            reason = delta.finish_reason
            if delta.finish_reason is not None:
                totals = (delta.total_drafts, delta.total_accepted)
            logprobs += [logprob_json(lp) for lp in delta.logprobs or ()]
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
        "total_drafts": totals[0],
        "total_accepted": totals[1],
        **({"logprobs": logprobs} if params.logprobs is not None else {}),
    }


def _generate(args: argparse.Namespace) -> int:
    from spectrio import ConfigError, InvalidRequest
    from spectrio.errors import CheckpointError, ModelConfigError

    problem = prompt_or_chat_error(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    refusals = (ConfigError, InvalidRequest, CheckpointError, ModelConfigError)
    try:
        result = trio.run(_generate_async, args)
    except refusals as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BaseExceptionGroup as group:
        # A request refused inside the runtime's block (a chat for a model without a
        # template, an empty prompt) reaches here wrapped by the runtime's nursery.
        refused, rest = group.split(refusals)
        if refused is None or rest is not None:
            raise
        first = refused.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        print(f"error: {first}", file=sys.stderr)
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
    parser.add_argument(
        "--log-level",
        default="warning",
        metavar="LEVEL",
        help="debug, info, warning or error; before or after the command (default: warning)",
    )
    parser.add_argument(
        "--log-format",
        default="console",
        choices=LOG_FORMATS,
        help="log lines on stderr as console text or one JSON object per line; before or "
        "after the command (default: console)",
    )
    from spectrio import __version__

    parser.add_argument("--version", action="version", version=f"spectrio {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate",
        help="stream a continuation (or, with --chat, an answer) through an in-process runtime",
    )
    add_chat_flags(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object (docs/cli.md)")
    add_sampling_flags(gen)
    # One request: one batch slot, so the KV cache holds one max_model_len sequence.
    add_runtime_flags(gen, defaults={"max_num_seqs": 1})
    gen.set_defaults(func=_generate)

    from spectrio.tools.cli.serve import add_client_parser, add_keys_parser, add_serve_parser

    add_serve_parser(sub)
    add_client_parser(sub)
    add_keys_parser(sub)

    from spectrio.tools.measurement.diff import add_diff_parser
    from spectrio.tools.measurement.replay import add_replay_parser
    from spectrio.tools.measurement.trace_command import add_trace_parser

    add_trace_parser(sub)
    add_replay_parser(sub)
    add_diff_parser(sub)

    from spectrio.tools.cli.convert import add_convert_parser
    from spectrio.tools.cli.quantize import add_quantize_parser

    add_convert_parser(sub)
    add_quantize_parser(sub)

    sub.add_parser(
        "train", help="train the bundled model (see `spectrio train --help`)", add_help=False
    )
    sub.add_parser(
        "train-mtp",
        help="train an MTP head for a model that has none (see `spectrio train-mtp --help`)",
        add_help=False,
    )
    sub.add_parser(
        "bench", help="throughput benchmark (see `spectrio bench --help`)", add_help=False
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # --log-level and --log-format work before or after the command (and for train and
    # bench, whose own parsers never see them).
    argv, logging_flags = split_logging_flags(argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        configure_logging(
            logging_flags.get("log_level", args.log_level),
            logging_flags.get("log_format", args.log_format),
        )
    except ValueError as exc:
        parser.error(str(exc))
    if args.command == "train":
        from spectrio.tools.training import train

        return train.main(rest)
    if args.command == "train-mtp":
        from spectrio.tools.training import train_mtp

        return train_mtp.main(rest)
    if args.command == "bench":
        from spectrio.tools.measurement import bench

        return bench.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if getattr(args, "sampling.max_tokens", 1) < 1:
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
