"""``python -m spectrio.tools.cli``: the ``spectrio`` command."""

from spectrio.tools.cli.commands import main

if __name__ == "__main__":
    raise SystemExit(main())
