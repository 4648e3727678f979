"""Old import paths of moved modules keep working, and say where the module went.

A package whose modules moved calls :func:`moved_modules` from its ``__init__`` with a
map of old module names to new ones. Importing an old name then warns
(``DeprecationWarning``, naming the new module) and gives a module object that carries
the new module's names (the same objects: ``isinstance`` and identity hold). Old paths
need no files of their own, so the folders hold only what lives there.

The old name resolves only once its package was imported, which every import of it does
first (``import spectrio.models.loader`` imports ``spectrio.models`` before looking the
submodule up), so a package registers its own moves.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence

__all__ = ["moved_modules"]


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module name and loads it as a copy of the new module's namespace."""

    def __init__(self) -> None:
        self.moves: dict[str, str] = {}

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.moves:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None  # the default module object; exec_module fills it

    def exec_module(self, module: types.ModuleType) -> None:
        new = self.moves[module.__name__]
        warnings.warn(
            f"{module.__name__} moved to {new}; import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        target = importlib.import_module(new)
        for name, value in vars(target).items():
            if name not in ("__name__", "__spec__", "__loader__", "__path__", "__package__"):
                setattr(module, name, value)
        if hasattr(target, "__path__"):  # a package: its moved submodules import through it
            module.__path__ = []


_FINDER = _MovedFinder()


def moved_modules(moves: dict[str, str]) -> None:
    """Make each old module name in ``moves`` import its new module (with a warning)."""
    _FINDER.moves.update(moves)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
