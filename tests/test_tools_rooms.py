"""tools/ in rooms (issue 59): every old flat module path still imports, warning with
the new one's name; no code outside the tests imports an old path; no tools module
outgrows about 600 lines."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

import spectrio.tools
from spectrio.tools import MOVED

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_warns_with_the_new_one(old: str) -> None:
    new = MOVED[old]
    sys.modules.pop(old, None)  # a test before may have imported it already
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new};"):
        module = importlib.import_module(old)
    target = importlib.import_module(new)
    shared = [n for n in vars(target) if not n.startswith("__")]
    assert shared and all(getattr(module, n) is getattr(target, n) for n in shared)


def test_the_old_names_of_the_served_metrics_still_work() -> None:
    sys.modules.pop("spectrio.tools.metrics", None)
    with pytest.warns(DeprecationWarning, match="moved to spectrio.runtime.metrics"):
        from spectrio.tools.metrics import ObservedRuntime, ServeMetrics
    from spectrio.runtime import metrics

    assert ObservedRuntime is metrics.ObservedRuntime and ServeMetrics is metrics.ServeMetrics


def test_the_cli_package_keeps_main() -> None:
    from spectrio.tools.cli import build_parser, commands, main

    assert main is commands.main and build_parser is commands.build_parser


def _imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_no_code_imports_an_old_path() -> None:
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", ".git", "build") or "egg-info" in str(rel):
            continue
        for name in _imported_modules(path) & set(MOVED):
            bad.append(f"{rel} imports {name} (now {MOVED[name]})")
    assert not bad, "\n".join(bad)


def test_no_tools_module_is_over_600_lines() -> None:
    folder = Path(spectrio.tools.__file__).parent
    long = {
        str(p.relative_to(folder)): n
        for p in folder.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert not long, long
