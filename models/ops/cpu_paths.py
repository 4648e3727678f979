"""Which instruction-set path spectrio's native kernels are built for, chosen at run time.

The kernels (``models/ops/csrc``) have three paths, each a build of the same sources with its
own compiler flags, selected in the sources by the macros those flags define:

* ``generic``: plain C++ for any x86-64 CPU (or none: the compiler's defaults elsewhere);
* ``avx2``: AVX2, FMA and F16C intrinsics, the baseline of every CPU this runs well on;
* ``avx512``: 16-column panels in one AVX-512 register and twice the register tile.

:func:`choose_path` picks the best path the CPU's flags (CPUID, as ``/proc/cpuinfo``
reports them) allow, or the one ``SPECTRIO_CPU_PATH`` names, and refuses a path the CPU
lacks: a build for instructions the CPU does not have would die of an illegal
instruction, so it is never loaded. Pure logic: flags in, a path out.

The panel products sum every output in the same order on every path, so ``avx2`` and
``avx512`` give the same bits; ``generic`` may round differently (no fused multiply-add).
"""

from __future__ import annotations

import platform
from collections.abc import Mapping

from spectrio.errors import ConfigError

__all__ = ["CPU_PATH_ENV", "PATHS", "available_paths", "choose_path", "compiler_flags"]

CPU_PATH_ENV = "SPECTRIO_CPU_PATH"

#: the paths, worst first, with the CPU flags each needs and the compiler flags it is
#: built with
PATHS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    "generic": (frozenset(), ("-march=x86-64", "-mtune=generic")),
    "avx2": (frozenset({"avx2", "fma", "f16c"}), ("-march=x86-64", "-mavx2", "-mfma", "-mf16c")),
    "avx512": (
        frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}),
        (
            "-march=x86-64",
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512dq",
            "-mavx2",
            "-mfma",
            "-mf16c",
        ),
    ),  # fmt: skip
}


def _x86(machine: str) -> bool:
    return machine.lower() in ("x86_64", "amd64")


def available_paths(flags: frozenset[str] | set[str], machine: str | None = None) -> list[str]:
    """The paths a CPU with ``flags`` runs, worst first (``generic`` only off x86-64)."""
    if not _x86(machine or platform.machine()):
        return ["generic"]
    return [name for name, (needs, _) in PATHS.items() if needs <= flags]


def choose_path(
    flags: frozenset[str] | set[str], environ: Mapping[str, str], machine: str | None = None
) -> str:
    """The path to build and load: ``SPECTRIO_CPU_PATH`` where set (``ConfigError`` naming
    what the CPU lacks if it cannot run it), else the best this CPU runs."""
    paths = available_paths(flags, machine)
    wanted = environ.get(CPU_PATH_ENV, "").strip().lower()
    if not wanted or wanted == "auto":
        return paths[-1]
    if wanted not in PATHS:
        raise ConfigError(f"{CPU_PATH_ENV}={wanted!r}: the paths are {', '.join(PATHS)} (or auto)")
    if wanted not in paths:
        missing = sorted(PATHS[wanted][0] - set(flags)) or [f"an x86-64 CPU, not {machine}"]
        raise ConfigError(
            f"{CPU_PATH_ENV}={wanted}: this CPU lacks {', '.join(missing)}; it runs "
            f"{', '.join(paths)}"
        )
    return wanted


def compiler_flags(path: str, machine: str | None = None) -> list[str]:
    """The compiler flags of ``path`` (none off x86-64: the compiler's defaults)."""
    return list(PATHS[path][1]) if _x86(machine or platform.machine()) else []
