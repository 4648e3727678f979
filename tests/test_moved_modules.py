"""A moved module's old import path keeps working and names the new one."""

from __future__ import annotations

import ast
import importlib
import re
import sys
import warnings
from pathlib import Path

import pytest

from spectrio._moved import moved_modules


def test_old_path_warns_and_gives_the_same_objects() -> None:
    moved_modules({"spectrio.core.probe_old_record": "spectrio.core.record"})
    sys.modules.pop("spectrio.core.probe_old_record", None)
    with pytest.warns(DeprecationWarning, match="moved to spectrio.core.record"):
        old = importlib.import_module("spectrio.core.probe_old_record")
    new = importlib.import_module("spectrio.core.record")
    assert old.record_width is new.record_width
    assert old.__name__ == "spectrio.core.probe_old_record"
    assert new.__name__ == "spectrio.core.record"  # the new module is left as it was


def test_unknown_old_path_still_fails() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("spectrio.core.no_such_module_ever")


def _stages_moves() -> dict[str, str]:
    import spectrio.stages

    return dict(spectrio.stages.MOVED)


@pytest.mark.parametrize("old", sorted(_stages_moves()))
def test_every_old_stages_path_imports_and_names_its_new_one(old: str) -> None:
    """issue 59 grouped ``stages/`` by thread: each module's flat path still imports."""
    new = _stages_moves()[old]
    parent, _, leaf = old.rpartition(".")
    with warnings.catch_warnings():  # a parent that moved too (stages.draft)
        warnings.simplefilter("ignore", DeprecationWarning)
        importlib.import_module(parent)
    saved = vars(sys.modules[parent]).get(leaf)
    sys.modules.pop(old, None)
    try:
        with pytest.warns(DeprecationWarning, match=f"moved to {re.escape(new)};"):
            module = importlib.import_module(old)
        target = importlib.import_module(new)
        for name in getattr(target, "__all__", []):
            assert getattr(module, name) is getattr(target, name), (old, name)
        if hasattr(target, "__path__"):  # a moved package's submodules import through it
            for sub in [o for o in _stages_moves() if o.startswith(old + ".")]:
                sys.modules.pop(sub, None)
                with pytest.warns(DeprecationWarning):
                    importlib.import_module(sub)
                sys.modules.pop(sub, None)
    finally:  # leave the package as other tests find it
        sys.modules.pop(old, None)
        if parent in sys.modules:
            vars(sys.modules[parent]).pop(leaf, None)
            if saved is not None:
                setattr(sys.modules[parent], leaf, saved)


def _models_moves() -> dict[str, str]:
    import spectrio.models

    moves: dict[str, str] = spectrio.models._MOVED  # type: ignore[attr-defined]
    return moves


@pytest.mark.parametrize("old", sorted(_models_moves()))
def test_every_old_models_path_imports_and_names_its_new_one(old: str) -> None:
    """issue 59 split ``models/`` into rooms: each module's flat path still imports."""
    new = _models_moves()[old]
    parent, _, leaf = old.rpartition(".")
    sys.modules.pop(old, None)
    try:
        with pytest.warns(DeprecationWarning, match=f"moved to {re.escape(new)};"):
            module = importlib.import_module(old)
        target = importlib.import_module(new)
        public = getattr(target, "__all__", None) or [
            n for n in vars(target) if not n.startswith("_")
        ]
        for name in public:
            assert getattr(module, name) is getattr(target, name), (old, name)
    finally:  # leave the package as other tests find it
        sys.modules.pop(old, None)
        vars(sys.modules[parent]).pop(leaf, None)  # the import set the copy there


def test_old_models_paths_name_no_module_that_exists() -> None:
    """An old path is only an alias: no file of that name is left beside the rooms."""
    root = Path(__file__).resolve().parents[1] / "models"
    for old in _models_moves():
        assert not (root / f"{old.rpartition('.')[2]}.py").exists(), old


def test_the_repository_imports_no_old_path() -> None:
    """Old paths are for outside users; the project's own code imports the new ones."""
    import spectrio.models

    moves = {**_models_moves(), **_stages_moves()}
    exported = {f"spectrio.models.{name}" for name in spectrio.models.__all__}
    root = Path(__file__).resolve().parents[1]
    bad: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if any(part.startswith(".") or part == "build" for part in path.relative_to(root).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                names = [n for n in names if n == node.module or n not in exported]
            bad += [f"{path.relative_to(root)}:{node.lineno} {n}" for n in names if n in moves]
    assert not bad, "\n".join(bad)
