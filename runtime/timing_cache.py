"""The adaptive policy's timing cache: what it measured about this machine's step times,
kept between runs.

The policy compares k by their step times measured side by side, one noisy sample at a
time, so a run of a few hundred steps ends before the close calls are settled; without a
cache every run starts again from nothing, exploring k = 4 down to 0 and choosing
between neighbours on a handful of samples. The samples are a property of the machine,
the checkpoint and the settings, not of the requests, so they are kept: at shutdown the
policy's pair samples, step times and extra-row costs per batch bucket
(:meth:`SpecPolicy.export_timings`) are written to one JSON file per identity, and the
next runtime with the same identity starts from them (:meth:`SpecPolicy.import_timings`).
Its own samples push the old ones out of each pair's window as they come in, so a cache
follows the machine. Acceptance is not kept: it depends on the requests.

The identity is every setting that moves a step's time: spectrio's native kernels (their
source, flags and CPU, or off), the checkpoint (its folder, and
the size and modification time of its config and weight files; or its GGUF file's path,
size and modification time), the MTP head attached from outside it (the head the package
ships, or ``X.mtp.safetensors`` beside a GGUF file: its path, size and modification
time, since a retrained head drafts at another cost), dtype, threads, tensor-parallel
size, overlap, k, the CPU (model name, count, instruction-set flags) and Paddle's
version. A file for another identity is never read; an unreadable or malformed file is
logged and ignored (the run starts cold), and a write that fails is logged, never
raised: the cache only saves time. Files are written atomically (a temporary file
renamed over the old one), so two runtimes closing at once leave one whole file.

A runtime reads its file once, when it starts, and writes it once, when it closes
(:class:`KeptTimings`); nothing else in the runtime touches the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any, Protocol

import structlog

from spectrio.cache_dir import cache_dir
from spectrio.core.config import RuntimeConfig

__all__ = [
    "KeptTimings",
    "PolicyTimings",
    "cache_file",
    "cache_root",
    "identity",
    "load_timings",
    "save_timings",
]

log = structlog.get_logger("spectrio.timing_cache")

SCHEMA = 1


def cache_root(setting: str) -> Path | None:
    """The folder a ``timing_cache`` setting names; None for ``"off"``."""
    if setting == "off":
        return None
    if setting != "auto":
        return Path(setting).expanduser()
    return cache_dir()


def _cpu_model() -> str:
    from spectrio.models.ops.fast_ops import cpuinfo_line

    return cpuinfo_line("model name").split(":", 1)[-1].strip() or platform.processor()


_MODEL_FILES = ("config.json", "*.safetensors", "*.pdparams")


def _stat(path: Path) -> list[Any]:
    """[path, size, modification time] of a file; [path] alone where it cannot be read
    (a synthetic model's name)."""
    try:
        st = path.stat()
    except OSError:
        return [str(path)]
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def _checkpoint(path: Path) -> list[Any]:
    """The checkpoint's folder and the name, size and modification time of each file
    that defines the model (its config and weights, not its README); for a GGUF file,
    its path, size and modification time."""
    if not path.is_dir():
        return _stat(path)
    files = sorted({p for pattern in _MODEL_FILES for p in path.glob(pattern) if p.is_file()})
    return [str(path.resolve())] + [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def _head(model_path: Path, head_path: Path | None) -> dict[str, Any]:
    """The ``head`` entry of the identity: the attached head's [path, size, modification
    time], where it lies outside the checkpoint's folder (inside it, the folder's own
    entry already has it, as it had before the key existed)."""
    if head_path is None or head_path.resolve().parent == model_path.resolve():
        return {}
    return {"head": _stat(head_path)}


def identity(
    config: RuntimeConfig, model_path: Path, head_path: Path | None = None
) -> dict[str, Any]:
    """Everything that moves a step's time, as JSON-ready data (``head_path``: the MTP
    head file attached to the model, :attr:`LoadedModel.head_path`)."""
    from spectrio.models.loading.loader import blocks_enabled
    from spectrio.models.ops.fast_ops import cpu_signature
    from spectrio.models.ops.native_ops import kernels_identity

    spec = config.speculative
    return {
        "schema": SCHEMA,
        "checkpoint": _checkpoint(model_path),
        **_head(model_path, head_path),
        "dtype": config.dtype,
        "threads": config.resolve_num_threads(),
        "tensor_parallel_size": config.tensor_parallel_size,
        "overlap": config.enable_overlap,
        "k": spec.effective_num_model_steps,
        "method": spec.method,
        # a draft model's steps cost what the model and its layers cost
        **({"draft": [spec.draft_model, spec.draft_layers]} if spec.needs.draft_model else {}),
        "cpu": [_cpu_model(), os.cpu_count(), cpu_signature()],
        "kernels": kernels_identity() if config.dtype == "float32" else "off",
        # the file's quantized blocks instead of float weights (models/loading/loader.py)
        **({"blocks": True} if blocks_enabled() else {}),
    }


def cache_file(config: RuntimeConfig, ident: dict[str, Any]) -> Path | None:
    """The file of the timings of ``ident`` (:func:`identity`); None where there is
    nothing to keep (the cache is off, or the policy is not adaptive)."""
    spec = config.speculative
    root = cache_root(spec.timing_cache)
    if root is None or not spec.enabled or not spec.adaptive:
        return None
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
    return root / "spec_timings" / f"{digest}.json"


def load_timings(path: Path, ident: dict[str, Any]) -> dict[str, Any] | None:
    """The timings kept at ``path`` for ``ident``; None when there are none (no file, or
    one that cannot be read or is for another identity: logged)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("timing cache unreadable; starting cold", path=str(path), error=repr(exc))
        return None
    if not isinstance(data, dict) or data.get("identity") != ident:
        log.warning("timing cache is for another identity; starting cold", path=str(path))
        return None
    timings = data.get("timings")
    return timings if isinstance(timings, dict) else None


def save_timings(path: Path, ident: dict[str, Any], timings: dict[str, Any]) -> bool:
    """Write the timings atomically; False (logged) where the file cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump({"identity": ident, "timings": timings}, fh)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        log.warning("timing cache not written", path=str(path), error=repr(exc))
        return False
    return True


class PolicyTimings(Protocol):
    """What keeps the adaptive policy's timings (the scheduler actor)."""

    def export_timings(self) -> dict[str, Any]: ...
    def import_timings(self, kept: dict[str, Any]) -> None: ...


class KeptTimings:
    """One runtime's use of the cache: the file for its identity, read once when the
    runtime starts (:meth:`restore`) and written once when it closes (:meth:`keep`)."""

    def __init__(
        self, config: RuntimeConfig, model_path: Path, head_path: Path | None = None
    ) -> None:
        self.identity = identity(config, model_path, head_path)
        self.path = cache_file(config, self.identity)  # None: nothing to keep
        # The batch buckets whose step times the policy started from; empty: it started cold.
        self.buckets: list[int] = []

    def restore(self, policy: PolicyTimings) -> None:
        """Start ``policy`` from the step times an earlier run kept (cold, logged, when
        there are none or they are malformed)."""
        path = self.path
        if path is None:
            return
        kept = load_timings(path, self.identity)
        if kept is None:
            log.info("timing cache empty; the policy starts cold", path=str(path))
            return
        try:
            policy.import_timings(kept)
        except ValueError as exc:
            log.warning("timing cache malformed; starting cold", path=str(path), error=str(exc))
            return
        self.buckets = sorted(map(int, kept["buckets"]))
        log.info("timing cache loaded", path=str(path), buckets=self.buckets)

    def keep(self, policy: PolicyTimings) -> None:
        """Write what ``policy`` measured, for the next run (a failed write is logged)."""
        if self.path is not None and save_timings(
            self.path, self.identity, policy.export_timings()
        ):
            log.info("timing cache written", path=str(self.path))
