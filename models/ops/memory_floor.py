"""The memory floor of a forward: the bytes it must read, divided by the read bandwidth
of the machine it runs on, probed in the same run.

At few rows a decoder's forward is bound by memory: every weight is read once per step
whatever the row count, and each row reads its sequence's KV. No kernel beats that
floor, so a forward's time is judged as a ratio to it. The bandwidth drifts on shared
hosts (by 1.7x within a day on the 2-core development guests), so it is measured in the
same run as the forward it judges, never taken from a table.

* :func:`forward_bytes` counts what one target forward reads, from the model's
  configuration: each layer's projections and norms, the final norm and the LM head
  (the whole ``vocab x hidden`` matrix, tied or not; the embedding lookup reads only
  one row per token), plus the KV of every row's context.
* :func:`read_bandwidth` reads a large float32 buffer (1 GiB by default, far beyond the
  caches) with ``threads`` threads, several passes, and reports the best and the median
  pass. It uses spectrio's native ``read_sum`` kernel (wide loads, one contiguous share
  per thread); without the kernels it falls back to Paddle's ``sum``, which reads more
  slowly and so overstates the floor, and says so in ``method``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import msgspec

from spectrio.models.architecture.config import ModelConfig

__all__ = ["Bandwidth", "floor_us", "forward_bytes", "read_bandwidth"]


class Bandwidth(msgspec.Struct, frozen=True, kw_only=True):
    """A read-bandwidth probe: GB/s (10^9 bytes) of its best and median pass."""

    best_gb_s: float
    median_gb_s: float
    nbytes: int
    passes: int
    threads: int
    method: str  # "native" (spectrio_read_sum) or "paddle" (paddle.sum: an overstated floor)


def forward_bytes(
    cfg: ModelConfig,
    contexts: Sequence[int],
    *,
    weight_bytes: int = 4,
    kv_bytes: int = 4,
    weights_total: int | None = None,
) -> int:
    """Bytes one target forward reads: every weight once (``weight_bytes`` each: 4 for
    float32; or ``weights_total`` bytes in all, for weights stored in mixed formats such
    as a GGUF file's blocks, :func:`spectrio.models.loading.block_serving.served_weight_bytes`)
    and, for each row, the KV of its ``contexts[i]`` positions (``kv_bytes`` per element)
    in every layer."""
    hidden, head_dim = cfg.hidden_size, cfg.head_dim
    q = cfg.num_attention_heads * head_dim
    kv = cfg.num_key_value_heads * head_dim
    attention = hidden * (q + 2 * kv) + q * hidden
    if cfg.attention_bias:
        attention += q + 2 * kv + hidden
    if cfg.qk_norm:  # Qwen3's per-head norms of q and k
        attention += 2 * head_dim
    mlp = 3 * hidden * cfg.intermediate_size
    if cfg.mlp_bias:
        mlp += 2 * cfg.intermediate_size + hidden
    layer = attention + mlp + 2 * hidden  # and its two norms
    weights = cfg.num_hidden_layers * layer + hidden + cfg.vocab_size * hidden
    cache = cfg.num_hidden_layers * 2 * kv * sum(int(c) for c in contexts)
    read = weights * weight_bytes if weights_total is None else weights_total
    return read + cache * kv_bytes


def floor_us(nbytes: int, bandwidth: Bandwidth) -> float:
    """Microseconds that reading ``nbytes`` takes at the probe's best bandwidth."""
    return nbytes / (bandwidth.best_gb_s * 1e9) * 1e6


def read_bandwidth(nbytes: int = 1 << 30, passes: int = 10, threads: int = 1) -> Bandwidth:
    """Probe the read bandwidth (module docstring). ``threads`` should be the forward's."""
    from spectrio.models.ops.native_ops import read_sum
    from spectrio.models.ops.paddle_setup import paddle

    with paddle.no_grad():
        buf = paddle.ones([nbytes // 4], dtype="float32")
        method = "native" if read_sum(buf, threads) is not None else "paddle"
        seconds: list[float] = []
        for _ in range(passes):
            t0 = time.perf_counter()
            out = read_sum(buf, threads) if method == "native" else paddle.sum(buf)
            assert out is not None
            out.item()  # the read is done
            seconds.append(time.perf_counter() - t0)
        del buf
    size = (nbytes // 4) * 4
    return Bandwidth(
        best_gb_s=round(size / min(seconds) / 1e9, 2),
        median_gb_s=round(size / statistics.median(seconds) / 1e9, 2),
        nbytes=size,
        passes=passes,
        threads=threads,
        method=method,
    )
