"""spectrio's cache folder, shared by every layer that keeps something per machine (the
fused-kernel verdict in :mod:`spectrio.models.ops.fast_ops`, the adaptive policy's step times
in :mod:`spectrio.runtime.timing_cache`). It lives in the top-level package, as
:mod:`spectrio.errors` does, because ``models`` sits below everything and may import no
other sub-package."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["cache_dir", "cache_subfolder", "publish_folder"]


def cache_dir() -> Path:
    """``$SPECTRIO_CACHE_DIR``, else ``$XDG_CACHE_HOME/spectrio``, else
    ``~/.cache/spectrio``. An empty variable counts as unset."""
    own = os.environ.get("SPECTRIO_CACHE_DIR")
    if own:
        return Path(own).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spectrio"


_OFF = ("0", "off", "false", "no")


def cache_subfolder(env: str, name: str) -> Path | None:
    """A part of the cache with its own switch: ``$env`` when it names a folder, else
    ``<cache>/name``; None when ``$env`` is ``0``, ``off``, ``false`` or ``no``."""
    value = os.environ.get(env, "").strip()
    if value.lower() in _OFF:
        return None
    return Path(value).expanduser() if value else cache_dir() / name


def publish_folder(folder: Path, marker: str, build: Callable[[Path], None]) -> None:
    """Make ``folder`` complete or leave it absent: ``build`` fills a temporary folder
    beside it, which is then renamed into place. A rename that loses to another process
    (which completed ``folder``: its ``marker`` file is there) is not an error; any other
    failure raises ``OSError`` and leaves nothing behind."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        build(tmp)
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / marker).is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
