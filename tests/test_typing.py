"""The package type-checks under mypy with disallow_untyped_defs (pyproject's settings)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["spectrio_root", "models", "runtime", "stages", "cuda_kernels", "wire", "tools"]


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is part of the test extras")
def test_mypy_is_clean() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *PACKAGES],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
