"""MKL's code path on AMD CPUs.

Paddle's CPU wheel does its matmuls in the MKL it bundles (``libmklml_intel.so``), and
that MKL picks a generic, slow code path for any CPU whose vendor is not Intel, whatever
instructions the CPU has. ``MKL_DEBUG_CPU_TYPE=5`` is MKL's switch for "use the AVX2
path"; on an AMD EPYC it makes matmuls 2.5-3.5x faster (docs/performance.md). MKL
reads the variable once, when it initialises on its first call, so it has to be in the
environment before Paddle's first matmul; it also reaches child processes
(tensor-parallel followers) from there.

It is set only where it is safe: an AMD CPU that reports both AVX2 and FMA (the AVX2 path
uses both; forcing it elsewhere would die of an illegal instruction). A value the user
has set, even an empty one, is left alone, so ``MKL_DEBUG_CPU_TYPE=`` turns this off.
On Intel CPUs MKL ignores the variable, and it is not set there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

__all__ = ["MKL_CPU_TYPE_VAR", "apply_mkl_dispatch", "mkl_cpu_type_for"]

MKL_CPU_TYPE_VAR = "MKL_DEBUG_CPU_TYPE"
_AVX2_PATH = "5"


def _first_field(cpuinfo: str, name: str) -> str:
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return ""


def mkl_cpu_type_for(cpuinfo: str, environ: Mapping[str, str]) -> str | None:
    """The ``MKL_DEBUG_CPU_TYPE`` value to set for a CPU described by ``cpuinfo`` (the
    text of ``/proc/cpuinfo``), or None to set nothing."""
    if MKL_CPU_TYPE_VAR in environ:
        return None
    if _first_field(cpuinfo, "vendor_id") != "AuthenticAMD":
        return None
    flags = set(_first_field(cpuinfo, "flags").split())
    if not {"avx2", "fma"} <= flags:
        return None
    return _AVX2_PATH


def apply_mkl_dispatch(
    environ: MutableMapping[str, str] | None = None, cpuinfo_path: str = "/proc/cpuinfo"
) -> str | None:
    """Set ``MKL_DEBUG_CPU_TYPE`` in ``environ`` (default ``os.environ``) where
    :func:`mkl_cpu_type_for` says so; returns the variable's value afterwards (None when
    unset). Call it before Paddle's first op."""
    env = os.environ if environ is None else environ
    try:
        with open(cpuinfo_path) as fh:
            cpuinfo = fh.read()
    except OSError:
        cpuinfo = ""
    value = mkl_cpu_type_for(cpuinfo, env)
    if value is not None:
        env[MKL_CPU_TYPE_VAR] = value
    return env.get(MKL_CPU_TYPE_VAR)
