"""MKL's AVX2 path on AMD CPUs: when it is set, when it is not, and that importing
spectrio's Paddle sets it before Paddle's first op."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spectrio.models.ops.mkl_dispatch import MKL_CPU_TYPE_VAR, apply_mkl_dispatch, mkl_cpu_type_for

AMD_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model name\t: AMD EPYC
flags\t\t: fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2
"""
AMD_NO_AVX2 = AMD_AVX2.replace(" avx2", "")
AMD_NO_FMA = AMD_AVX2.replace(" fma", "")
INTEL = AMD_AVX2.replace("AuthenticAMD", "GenuineIntel").replace("AMD EPYC", "Xeon")


def test_amd_with_avx2_and_fma_gets_the_avx2_path() -> None:
    assert mkl_cpu_type_for(AMD_AVX2, {}) == "5"


@pytest.mark.parametrize("cpuinfo", [AMD_NO_AVX2, AMD_NO_FMA, INTEL, "", "garbage\n:::\n"])
def test_other_cpus_get_nothing(cpuinfo: str) -> None:
    assert mkl_cpu_type_for(cpuinfo, {}) is None


@pytest.mark.parametrize("value", ["", "0", "5"])
def test_a_value_the_user_set_is_left_alone(value: str, tmp_path: Path) -> None:
    assert mkl_cpu_type_for(AMD_AVX2, {MKL_CPU_TYPE_VAR: value}) is None
    info = tmp_path / "cpuinfo"
    info.write_text(AMD_AVX2)  # a CPU that would get the AVX2 path if the user set nothing
    env = {MKL_CPU_TYPE_VAR: value}
    assert apply_mkl_dispatch(env, str(info)) == value
    assert env == {MKL_CPU_TYPE_VAR: value}


def test_apply_sets_the_environment_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(AMD_AVX2)
    env: dict[str, str] = {"OTHER": "x"}
    assert apply_mkl_dispatch(env, str(info)) == "5"
    assert env == {"OTHER": "x", MKL_CPU_TYPE_VAR: "5"}
    info.write_text(INTEL)
    env = {}
    assert apply_mkl_dispatch(env, str(info)) is None
    assert env == {}
    assert apply_mkl_dispatch(env, str(tmp_path / "missing")) is None


def _variable_after_import(env: dict[str, str]) -> str:
    code = (
        "import os, spectrio.models.ops.paddle_setup as s; "
        f"print(repr(os.environ.get({MKL_CPU_TYPE_VAR!r})), repr(s.MKL_CPU_TYPE))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip().splitlines()[-1]


def test_importing_spectrios_paddle_applies_it_for_this_cpu() -> None:
    env = {k: v for k, v in os.environ.items() if k != MKL_CPU_TYPE_VAR}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    expected = mkl_cpu_type_for(cpuinfo, {})
    assert _variable_after_import(env) == f"{expected!r} {expected!r}"
    env[MKL_CPU_TYPE_VAR] = ""
    assert _variable_after_import(env) == "'' ''"
