"""The package type-checks under mypy as installed, and ruff passes, both with the
project's own configuration (pyproject.toml)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typecheck import ROOT, lay_out_package, run_mypy


@pytest.mark.skipif(
    importlib.util.find_spec("mypy") is None, reason="mypy is part of the test extras"
)
def test_mypy_is_clean_on_the_installed_layout() -> None:
    proc = run_mypy()
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_installed_layout_resolves_spectrio_imports(tmp_path: Path) -> None:
    """The check is not hollow: the laid-out package holds every sub-package, ships
    py.typed, and an import of a spectrio module resolves to a typed definition."""
    lay_out_package(tmp_path)
    for sub in ("runtime", "stages", "models", "cuda_kernels", "wire", "tools"):
        assert (tmp_path / "spectrio" / sub / "__init__.py").is_file()
    assert (tmp_path / "spectrio" / "py.typed").is_file()
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is part of the test extras")
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from spectrio.core.params import SamplingParams\n"
        "reveal_type(SamplingParams(max_tokens=3).max_tokens)\n"
        "x: str = SamplingParams().max_tokens\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), str(probe)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={"MYPYPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert re.search(r'Revealed type is "(builtins\.)?int"', proc.stdout), proc.stdout
    assert "Incompatible types in assignment" in proc.stdout, proc.stdout


@pytest.mark.skipif(
    shutil.which("ruff") is None and importlib.util.find_spec("ruff") is None,
    reason="ruff is part of the test extras",
)
def test_ruff_is_clean() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
