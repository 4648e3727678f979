"""Type-check spectrio as it is installed, not as the source folders lie.

pyproject maps top-level folders (``runtime/``, ``wire/``, ...) into ``spectrio.*``
through ``package-dir``. mypy cannot follow that mapping through an editable install:
it would see every ``spectrio.*`` import as missing and, with missing imports ignored,
as ``Any``, which proves nothing. So this lays the package out the way an install does
(one ``spectrio/`` tree, ``py.typed`` included) in a temporary folder, checks
``-p spectrio`` there with the project's mypy settings, together with the scripts in
``benchmarks/`` (not installed; they import the package as installed), and reports paths
back in the source layout.

Run: ``python tests/typecheck.py`` (exit status is mypy's).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def lay_out_package(dest: Path) -> dict[str, str]:
    """Copy every mapped folder's Python files (and py.typed) to ``dest`` as pyproject's
    ``package-dir`` maps them; returns {installed path prefix: source folder prefix}."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    back: dict[str, str] = {}
    for package, folder in mapping.items():
        target = dest / package.replace(".", "/")
        target.mkdir(parents=True, exist_ok=True)
        for src in (ROOT / folder).iterdir():
            if src.suffix in (".py", ".pyi") or src.name == "py.typed":
                shutil.copy2(src, target / src.name)
        back[str(target.relative_to(dest)) + "/"] = folder + "/"
    return back


def run_mypy() -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="spectrio-typecheck-") as tmp:
        back = lay_out_package(Path(tmp))
        shutil.copytree(
            ROOT / "benchmarks",
            Path(tmp) / "benchmarks",
            ignore=shutil.ignore_patterns("*.md", "__pycache__"),
        )
        env = dict(os.environ, MYPYPATH=tmp)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "mypy",
                "--config-file",
                str(ROOT / "pyproject.toml"),
                "--no-incremental",
                "spectrio",
                "benchmarks",
            ],
            cwd=tmp,
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
        )
    out = proc.stdout
    # Longest prefixes first, so spectrio/runtime/ wins over spectrio/.
    for installed, source in sorted(back.items(), key=lambda kv: -len(kv[0])):
        out = out.replace(installed, source)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, proc.stderr)


if __name__ == "__main__":
    result = run_mypy()
    sys.stdout.write(result.stdout + result.stderr)
    raise SystemExit(result.returncode)
