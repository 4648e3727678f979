"""The ``spectrio`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time

from spectrio.tools.logging_setup import configure_logging


def _generate(args: argparse.Namespace) -> int:
    from spectrio.models import load, reference

    loaded = load(args.model, dtype=args.dtype)
    tok = loaded.tokenizer
    if tok is None:
        print(f"error: {loaded.path} has no tokenizer.json", file=sys.stderr)
        return 2
    prompt_ids = tok.encode(args.prompt)
    if not prompt_ids:
        print("error: the prompt encodes to no tokens", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    out = reference.greedy_generate(
        loaded.model, prompt_ids, args.max_tokens, eos_token_id=loaded.config.eos_token_id
    )
    seconds = time.perf_counter() - t0
    text = tok.decode(out.token_ids)
    if args.json:
        payload = {
            "text": text,
            "token_ids": out.token_ids,
            "finish_reason": out.finish_reason,
            "num_prompt_tokens": len(prompt_ids),
            "seconds": round(seconds, 4),
            "tokens_per_second": round(len(out.token_ids) / seconds, 2),
        }
        print(json.dumps(payload))
    else:
        print(args.prompt + text)
        print(
            f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}, "
            f"{len(out.token_ids) / seconds:.1f} tok/s]",
            file=sys.stderr,
        )
    return 0


def _train(rest: list[str]) -> int:
    from spectrio.tools import train

    return train.main(rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spectrio", description="Speculative decoding with MTP heads")
    parser.add_argument("--log-level", default="warning", help="structlog level (default: warning)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="greedily continue a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="bundled", help="'bundled' or a checkpoint folder")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.set_defaults(func=_generate)

    sub.add_parser("train", help="train the bundled model (see `spectrio train --help`)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    configure_logging(args.log_level)
    if args.command == "train":
        return _train(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "generate" and args.max_tokens < 1:
        parser.error("--max-tokens must be >= 1")
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
