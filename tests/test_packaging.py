"""The installed distribution exposes only the ``spectrio`` namespace."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import spectrio
import spectrio.models

SUBPACKAGES = ("runtime", "stages", "models", "cuda_kernels", "wire", "http_api", "tools")


def test_every_folder_is_a_spectrio_subpackage() -> None:
    root = Path(__file__).resolve().parent.parent
    for name in SUBPACKAGES:
        module = __import__(f"spectrio.{name}", fromlist=["_"])
        assert Path(module.__file__).resolve() == root / name / "__init__.py"
        assert module.__doc__, f"spectrio.{name} needs a docstring stating its public names"


def test_no_bare_top_level_packages(tmp_path: Path) -> None:
    code = (
        "import importlib.util, sys\n"
        f"bad = [n for n in {SUBPACKAGES!r} if importlib.util.find_spec(n) is not None]\n"
        "sys.exit(1 if bad else 0)\n"
    )
    # Run from an empty directory so the repository root is not on sys.path.
    assert subprocess.run([sys.executable, "-c", code], cwd=tmp_path).returncode == 0


def test_models_exports_are_pinned() -> None:
    assert sorted(spectrio.models.__all__) == sorted(
        [
            "BUNDLED_DIR",
            "CheckpointError",
            "ForwardOutput",
            "IncrementalDetokenizer",
            "LoadedModel",
            "ModelConfig",
            "ModelConfigError",
            "PackedBatch",
            "PagedKVCache",
            "SpectrioForCausalLM",
            "TextTokenizer",
            "build_model",
            "load",
            "reference",
            "save_checkpoint",
            "slots_for_positions",
        ]
    )
    for name in spectrio.models.__all__:
        assert hasattr(spectrio.models, name)


def test_console_script_is_declared() -> None:
    from importlib.metadata import entry_points

    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("spectrio") == "spectrio.tools.cli.commands:main"
    assert spectrio.__version__


def test_top_level_exports_are_pinned() -> None:
    assert sorted(spectrio.__all__) == sorted(
        [
            "ConfigError",
            "Constraint",
            "Delta",
            "EngineDead",
            "InvalidRequest",
            "PublishedStep",
            "Runtime",
            "RuntimeConfig",
            "SamplingParams",
            "SpectrioError",
            "SpeculativeConfig",
            "TokenLogprob",
            "__version__",
            "open_runtime",
        ]
    )
    assert issubclass(spectrio.ConfigError, ValueError)
    assert issubclass(spectrio.InvalidRequest, ValueError)


def test_wire_and_kernels_import_without_paddle() -> None:
    """A GPU machine with CuPy and no Paddle, or a consumer process, imports the wire
    protocol, its client library and the CUDA kernels: nothing on that path may import
    Paddle (package __init__ modules export lazily)."""
    code = (
        "import sys\n"
        "sys.modules['paddle'] = None  # any 'import paddle' now raises\n"
        "import spectrio, spectrio.wire, spectrio.cuda_kernels\n"
        "from spectrio.wire import client, codec, record, schema\n"
        "from spectrio.wire.client import Client, StreamAssembler\n"
        "from spectrio.cuda_kernels import speculate_save_ref, pack_topk_ref\n"
        "from spectrio import SamplingParams\n"
        "from spectrio.models import TextTokenizer, BUNDLED_DIR\n"
        "assert 'spectrio.models.architecture.model' not in sys.modules\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_lazy_exports_resolve_to_the_defining_objects() -> None:
    import spectrio.models
    import spectrio.runtime
    import spectrio.stages
    from spectrio.runtime.api import open_runtime
    from spectrio.stages.planning.scheduler import Scheduler

    assert spectrio.open_runtime is open_runtime and spectrio.runtime.open_runtime is open_runtime
    assert spectrio.stages.Scheduler is Scheduler
    for package in (spectrio, spectrio.runtime, spectrio.models, spectrio.stages):
        for name in package.__all__:
            assert getattr(package, name) is not None
        assert set(package.__all__) <= set(dir(package))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        spectrio.runtime.nope  # noqa: B018
