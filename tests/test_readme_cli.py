"""The CLI synopsis (``docs/cli.md``, *Synopsis*) names every ``spectrio`` command (and
sub-command) and lists exactly the flags each one's argparse usage shows: a flag or a
command added to a parser without the synopsis fails here, and so does a documented flag
that does not exist. Each command's flags are read from its own ``--help`` usage."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from spectrio.tools.cli.commands import main

CLI_DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
FLAG = re.compile(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*|-[a-zA-Z])(?![\w-])")
CHOICES = re.compile(r"\{([a-z0-9_,-]+)\}")


def usage(*argv: str) -> str:
    """The usage part of ``spectrio ARGV --help``."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return out.getvalue().split("\n\n", 1)[0]


def flags_of(text: str) -> set[str]:
    return set(FLAG.findall(text)) - {"-h", "--help"}


def commands(*prefix: str) -> list[tuple[str, ...]]:
    """Every command path under ``prefix`` (a sub-parser's ``{a,b}`` choices, recursively);
    ``()`` is the top level."""
    text = usage(*prefix)
    while True:  # drop the optional parts ([--dtype {float32,float64}] has choices too)
        shorter = re.sub(r"\[[^\[\]]*\]", "", text)
        if shorter == text:
            break
        text = shorter
    found = CHOICES.search(text)
    if found is None:
        return [prefix]
    paths = [prefix] if not prefix else []
    for name in found.group(1).split(","):
        paths += commands(*prefix, name)
    return paths


COMMANDS = commands()


def synopsis_blocks() -> dict[tuple[str, ...], set[str]]:
    """Flags per command path in the synopsis code block of ``docs/cli.md``: a line
    starting with ``spectrio`` and the command's words, plus the indented lines after it."""
    block = CLI_DOC.read_text().split("## Synopsis\n", 1)[1].split("```", 2)[1]
    flags: dict[tuple[str, ...], set[str]] = {}
    current: tuple[str, ...] | None = None
    for line in block.splitlines():
        if line.startswith("spectrio "):
            words = line.split()[1:]
            current = max(
                (p for p in COMMANDS if tuple(words[: len(p)]) == p), key=len, default=None
            )
            assert current is not None, f"docs/cli.md names no command: {line!r}"
            assert current not in flags, f"two docs/cli.md lines for {current!r}"
            flags[current] = set()
        elif not line.startswith(" "):
            current = None
        if current is not None:
            flags[current] |= flags_of(line.split("#", 1)[0])
    return flags


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "spectrio")
def test_the_synopsis_lists_exactly_the_flags_of(path: tuple[str, ...]) -> None:
    documented = synopsis_blocks()
    name = " ".join(("spectrio", *path))
    assert path in documented, f"no `{name}` line in docs/cli.md's synopsis"
    real = flags_of(usage(*path))
    assert documented[path] == real, (
        f"{name}: missing from docs/cli.md {sorted(real - documented[path])}, "
        f"not a flag {sorted(documented[path] - real)}"
    )


def test_every_command_is_found() -> None:
    """The walk over the parsers sees the commands (so the test above cannot pass empty)."""
    assert {("serve",), ("client",), ("generate",), ("bench",), ("train",), ()} <= set(COMMANDS)
