"""spectrio's cache folder, shared by every layer that keeps something per machine (the
fused-kernel verdict in :mod:`spectrio.models.fast_ops`, the adaptive policy's step times
in :mod:`spectrio.runtime.timing_cache`). It lives in the top-level package, as
:mod:`spectrio.errors` does, because ``models`` sits below everything and may import no
other sub-package."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """``$SPECTRIO_CACHE_DIR``, else ``$XDG_CACHE_HOME/spectrio``, else
    ``~/.cache/spectrio``. An empty variable counts as unset."""
    own = os.environ.get("SPECTRIO_CACHE_DIR")
    if own:
        return Path(own).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spectrio"
