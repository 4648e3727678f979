"""The native kernels' instruction-set paths (``models/ops/cpu_paths.py``): chosen from the
CPU's flags, forced with ``SPECTRIO_CPU_PATH``, refused where the CPU lacks them, and each
path this CPU has built, loaded and run on the bundled model's serving forward against
the op-by-op Paddle path (a child process per path: one process loads one build)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from spectrio.errors import ConfigError
from spectrio.models.ops import native_ops
from spectrio.models.ops.cpu_paths import CPU_PATH_ENV, available_paths, choose_path
from spectrio.models.ops.fast_ops import cpuinfo_line

ZEN3 = frozenset("sse2 avx avx2 fma f16c bmi2".split())
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"}
HERE = frozenset(cpuinfo_line("flags").partition(":")[2].split())


def test_the_best_path_the_flags_allow_is_chosen() -> None:
    assert available_paths(frozenset({"sse2"}), "x86_64") == ["generic"]
    assert available_paths(ZEN3, "x86_64") == ["generic", "avx2"]
    assert available_paths(ZEN4, "x86_64") == ["generic", "avx2", "avx512"]
    assert available_paths(ZEN4, "aarch64") == ["generic"]
    assert choose_path(ZEN3, {}, "x86_64") == "avx2"
    assert choose_path(ZEN4, {CPU_PATH_ENV: "auto"}, "x86_64") == "avx512"
    assert choose_path(ZEN4, {CPU_PATH_ENV: "AVX2"}, "x86_64") == "avx2"
    assert choose_path(ZEN3, {CPU_PATH_ENV: "generic"}, "x86_64") == "generic"


def test_a_path_the_cpu_lacks_is_refused_naming_what_it_lacks() -> None:
    with pytest.raises(ConfigError, match="lacks avx512bw, avx512dq, avx512f, avx512vl"):
        choose_path(ZEN3, {CPU_PATH_ENV: "avx512"}, "x86_64")
    with pytest.raises(ConfigError, match="the paths are generic, avx2, avx512"):
        choose_path(ZEN3, {CPU_PATH_ENV: "sse9"}, "x86_64")
    with pytest.raises(ConfigError, match="an x86-64 CPU"):
        choose_path(ZEN4, {CPU_PATH_ENV: "avx2"}, "aarch64")


_FORWARD = """
import json
import numpy as np, paddle
from spectrio.models import PackedBatch, PagedKVCache, load
from spectrio.models.ops import native_ops
lm = load("bundled")
cfg = lm.config
out = {"path": native_ops.cpu_path(), "built": native_ops.native_ops_available()}
for native in (True, False):
    lm.model.native_layers = native
    cache = PagedKVCache(cfg.num_hidden_layers, 16, 4, cfg.num_key_value_heads, cfg.head_dim)
    with paddle.no_grad():
        batch = PackedBatch.from_sequences(
            [list(range(5, 18)), [9, 8, 7]], [0, 0], [np.arange(8), np.arange(8, 16)])
        logits = lm.model.forward(batch, cache).logits.numpy()
    out["native" if native else "paddle"] = logits.tolist()
print(json.dumps(out))
"""


def _forward_on(path: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, CPU_PATH_ENV: path}
    return subprocess.run(
        [sys.executable, "-c", _FORWARD], env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.skipif(
    not native_ops.native_ops_available(), reason="spectrio's native kernels do not build here"
)
@pytest.mark.parametrize("path", ["generic", "avx2", "avx512"])
def test_each_path_the_cpu_has_runs_the_forward(path: str) -> None:
    if path not in available_paths(HERE):
        pytest.skip(f"this CPU does not run the {path} path")
    import numpy as np

    proc = _forward_on(path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["path"] == path and got["built"] is True, proc.stderr[-2000:]
    want = np.array(got["paddle"])
    np.testing.assert_allclose(np.array(got["native"]), want, rtol=0, atol=1e-4)


def test_forcing_a_path_the_cpu_lacks_ends_with_the_reason_not_a_crash() -> None:
    lacking = [p for p in ("avx2", "avx512") if p not in available_paths(HERE)]
    if not lacking:
        pytest.skip("this CPU runs every path")
    proc = _forward_on(lacking[-1])
    assert proc.returncode == 1, proc.stderr[-2000:]  # an exception, not a signal
    assert "ConfigError" in proc.stderr and f"{CPU_PATH_ENV}={lacking[-1]}" in proc.stderr
