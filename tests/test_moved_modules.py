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
