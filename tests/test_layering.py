"""Sub-packages import one way (docs/architecture.md, "Layering"): a module may import its
own package and the layers below it, never a layer above or a sibling of the same rank.
Imports inside functions and under ``TYPE_CHECKING`` count too: a cycle is a design bug
wherever it hides."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# package -> (folder, rank); a module may import packages of a lower rank, and its own.
LAYERS: dict[str, tuple[str, int]] = {
    "errors": ("spectrio_root/errors.py", 0),
    "_lazy": ("spectrio_root/_lazy.py", 0),
    "_moved": ("spectrio_root/_moved.py", 0),
    "cache_dir": ("spectrio_root/cache_dir.py", 0),
    "process_memory": ("spectrio_root/process_memory.py", 0),
    "models": ("models", 1),
    "core": ("core", 2),
    "cuda_kernels": ("cuda_kernels", 3),
    "stages": ("stages", 4),
    "runtime": ("runtime", 5),
    "wire": ("wire", 6),
    "http_api": ("http_api", 7),
    "tools": ("tools", 8),
}


def _imported_packages(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "spectrio":  # the facade re-exports runtime-level names
                names = [
                    f"spectrio.{a.name if a.name in LAYERS else 'runtime'}" for a in node.names
                ]
        for name in names:
            parts = name.split(".")
            if parts[0] == "spectrio" and len(parts) > 1:
                found.add(parts[1])
    return found


def _modules(package: str) -> list[Path]:
    where = ROOT / LAYERS[package][0]
    return [where] if where.is_file() else sorted(where.rglob("*.py"))


def test_every_import_goes_down() -> None:
    bad: list[str] = []
    for package, (_, rank) in LAYERS.items():
        for path in _modules(package):
            for other in _imported_packages(path):
                if other == package:
                    continue
                if other not in LAYERS:
                    bad.append(f"{path.relative_to(ROOT)} imports unknown spectrio.{other}")
                elif LAYERS[other][1] >= rank:
                    bad.append(
                        f"{path.relative_to(ROOT)} imports spectrio.{other} (rank "
                        f"{LAYERS[other][1]} >= {rank})"
                    )
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from spectrio.runtime.api import Runtime\n")
    assert _imported_packages(probe) == {"runtime"}


# stages/ is grouped by the thread that runs the code: a room never imports another's
# modules (a rule both use lives below them, in core).
STAGE_ROOMS = ("planning", "device", "output")


def test_stage_rooms_do_not_import_each_other() -> None:
    bad: list[str] = []
    for room in STAGE_ROOMS:
        for path in sorted((ROOT / "stages" / room).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                for name in names:
                    parts = name.split(".")
                    if parts[:2] == ["spectrio", "stages"] and len(parts) > 2:
                        other = parts[2]
                        if other in STAGE_ROOMS and other != room:
                            bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


# Inside models/, the serving rooms never import the test doubles (the oracle, the synthetic
# device): those stand in for the model in tests and benchmarks. The one exception is the
# seam that selects the synthetic device by name, ``load("synthetic:...")``, which imports
# it inside the function, only when asked for.
SERVING_ROOMS = ("architecture", "ops", "loading", "text")
DOUBLES = "spectrio.models.doubles"
DOUBLES_SEAMS = {("models/loading/loader.py", "spectrio.models.doubles.synthetic")}


def _imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_serving_rooms_do_not_import_the_doubles() -> None:
    bad: list[str] = []
    for room in SERVING_ROOMS:
        for path in sorted((ROOT / "models" / room).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            for name in _imported_modules(path):
                doubles = name == DOUBLES or name.startswith(DOUBLES + ".")
                if name == "spectrio.models.doubles.reference":  # the package's lazy re-export
                    doubles = True
                seam = any(
                    where == w and (name == m or name.startswith(m + ".")) for w, m in DOUBLES_SEAMS
                )
                if doubles and not seam:
                    bad.append(f"{where} imports {name}")
    assert not bad, "\n".join(bad)
