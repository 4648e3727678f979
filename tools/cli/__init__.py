"""spectrio.tools.cli: the ``spectrio`` command line.

:func:`main` and :func:`build_parser` (:mod:`.commands`: the top-level parser, the
dispatch to every room's commands, and ``generate``); the flags commands share
(:mod:`.runtime_flags`, :mod:`.sampling_flags`, :mod:`.chat_flags`) and the CLI's logging
(:mod:`.logging_setup`); ``serve`` and ``keys`` (:mod:`.serve`, :mod:`.serve_run`),
``client`` (:mod:`.client`), ``convert`` and ``quantize``. ``python -m spectrio.tools.cli``
runs the command.
"""

from typing import TYPE_CHECKING

from spectrio._lazy import lazy_exports

__all__ = ["build_parser", "main"]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {"build_parser": "spectrio.tools.cli.commands", "main": "spectrio.tools.cli.commands"},
)

if TYPE_CHECKING:
    from spectrio.tools.cli.commands import build_parser, main
