"""A moved module's old import path keeps working and names the new one."""

from __future__ import annotations

import importlib
import sys

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


def test_every_moved_stage_module_imports_from_its_old_path() -> None:
    import spectrio.stages

    for old, new in spectrio.stages.MOVED.items():
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=f"moved to {new}"):
            module = importlib.import_module(old)
        public = getattr(importlib.import_module(new), "__all__", [])
        assert all(getattr(module, name) is not None for name in public), old
    # a moved package's moved submodules import through it
    from spectrio.stages.draft.ngram import NgramProposer  # noqa: F401
