"""Issue 15 item 8: the README's CLI block lists every flag of every ``spectrio``
subcommand, and no flag that does not exist. Each command's flags are read from its own
``--help`` usage (argparse), so a flag added to a parser without the README fails here."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from spectrio.tools.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"
FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")
COMMANDS = ["generate", "bench", "serve", "client", "keys", "train"]


def readme_blocks() -> dict[str, set[str]]:
    """Flags per command in the README's ``## CLI`` code block: a line starting with
    ``spectrio COMMAND`` and the indented lines after it (``""``: the top-level line)."""
    text = README.read_text()
    block = text.split("## CLI\n", 1)[1].split("```", 2)[1]
    flags: dict[str, set[str]] = {}
    current: str | None = None
    for line in block.splitlines():
        if line.startswith("spectrio "):
            word = line.split()[1]
            current = "" if word.startswith("[") else word
            assert current not in flags, f"two README lines for {current!r}"
            flags[current] = set()
        elif not line.startswith(" "):
            current = None
        if current is not None:
            flags[current] |= set(FLAG.findall(line.split("#", 1)[0]))
    return flags


def parser_flags(*argv: str) -> set[str]:
    """The flags in the usage of ``spectrio ARGV --help``."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    usage = out.getvalue().split("\n\n", 1)[0]
    return set(FLAG.findall(usage)) - {"--help"}


@pytest.mark.parametrize("command", COMMANDS)
def test_the_readme_lists_exactly_the_flags_of(command: str) -> None:
    documented = readme_blocks()
    assert command in documented, f"no `spectrio {command}` line in the README's CLI block"
    real = parser_flags(command)
    assert documented[command] == real, (
        f"spectrio {command}: missing from the README {sorted(real - documented[command])}, "
        f"not a flag {sorted(documented[command] - real)}"
    )


def test_the_readme_lists_the_top_level_flags_and_every_command() -> None:
    documented = readme_blocks()
    assert documented.get("") == parser_flags()
    assert set(documented) - {""} == set(COMMANDS)
