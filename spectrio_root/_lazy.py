"""Lazy re-exports for package ``__init__`` modules (PEP 562).

A package's public names are imported from their defining module on first use, not
when the package is imported. That keeps Paddle out of processes that only need the
wire protocol or the CUDA kernels (a GPU machine with CuPy and no Paddle, a consumer
process): ``import spectrio.wire`` runs ``spectrio/__init__`` first, and an eager import
there would pull the whole runtime, models and Paddle in with it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(
    package: str, exports: dict[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``; ``exports`` maps each public name
    to the module that defines it (a name that is a submodule maps to the package)."""

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        source = importlib.import_module(module)
        value = source if module == f"{package}.{name}" else getattr(source, name)
        setattr(sys.modules[package], name, value)  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(exports) | set(vars(sys.modules[package])))

    return __getattr__, __dir__
