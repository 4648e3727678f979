"""``PROMPT`` or ``--chat MESSAGE [--system TEXT]``: the request arguments ``spectrio
generate`` and ``spectrio client`` share."""

from __future__ import annotations

import argparse

__all__ = ["add_chat_flags", "chat_messages", "prompt_or_chat_error"]


def chat_messages(args: argparse.Namespace) -> list[dict[str, str]] | None:
    """The chat ``--chat MESSAGE`` (after ``--system TEXT``, when given) asks for, or None
    for a plain prompt."""
    if args.chat is None:
        return None
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    return [*system, {"role": "user", "content": args.chat}]


def prompt_or_chat_error(args: argparse.Namespace) -> str | None:
    """Why the command's prompt arguments do not name one request, or None: a PROMPT or
    ``--chat MESSAGE``, never both; ``--system`` only with ``--chat``."""
    if args.chat is None and args.system is not None:
        return "--system needs --chat MESSAGE"
    if (args.prompt is None) == (args.chat is None):
        return "give a PROMPT or --chat MESSAGE (one of them)"
    return None


def add_chat_flags(p: argparse.ArgumentParser) -> None:
    """``PROMPT`` or ``--chat MESSAGE`` (and ``--system TEXT``), for generate and client."""
    p.add_argument("prompt", nargs="?", default=None, help="the text to continue")
    p.add_argument(
        "--chat",
        default=None,
        metavar="MESSAGE",
        help="instead of PROMPT: a user message, rendered with the model's chat template; "
        "the answer ends at the template's end-of-turn token (a model without a template "
        "is an error)",
    )
    p.add_argument(
        "--system",
        default=None,
        metavar="TEXT",
        help="with --chat: a system message before the user's",
    )
