"""Old import paths of moved modules keep working, and say where the module went.

A package whose modules moved calls :func:`moved_modules` from its ``__init__`` with a
map of old module names to new ones. Importing an old name then warns
(``DeprecationWarning``, naming the new module) and gives the new module itself, so
``monkeypatch`` and ``mock.patch`` through an old path patch what callers use. A module
that was split into several (``parts``) gives a module carrying the names of all of
them instead (the same objects). Old paths need no files of their own, so the folders
hold only what lives there. ``python -m`` on an old path says which new one to run.

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
        self.parts: dict[str, tuple[str, ...]] = {}

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
        old = module.__name__
        new, parts = self.moves[old], self.parts.get(old, ())
        also = f" (names split off it are in {', '.join(parts)})" if parts else ""
        warnings.warn(
            f"{old} moved to {new}; import it from there{also}",
            DeprecationWarning,
            stacklevel=2,
        )
        target = importlib.import_module(new)
        if not parts:
            # The import system reads sys.modules again after exec_module: the old name
            # is then the new module itself.
            sys.modules[old] = target
            return
        for name in (*parts, new):  # the main module last: its names win
            for key, value in vars(importlib.import_module(name)).items():
                if not (key.startswith("__") and key.endswith("__")):
                    setattr(module, key, value)

    def get_code(self, fullname: str) -> None:
        """``python -m OLD``: a moved module cannot run under its old name."""
        raise ImportError(f"{fullname} moved to {self.moves[fullname]}; run that instead")


_FINDER = _MovedFinder()


def moved_modules(moves: dict[str, str], parts: dict[str, tuple[str, ...]] | None = None) -> None:
    """Make each old module name in ``moves`` import its new module (with a warning).
    ``parts``: for an old module that was split, the other new modules that hold some of
    its names."""
    _FINDER.moves.update(moves)
    _FINDER.parts.update(parts or {})
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
