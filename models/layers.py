"""Llama building blocks in Paddle: RMSNorm, rotary embeddings, GQA attention, SwiGLU MLP.

Attention has two entry points that share every weight and the same core:
``forward_paged`` (packed rows, paged cache; serving) and ``forward_dense``
(``[B, T]`` causal, no cache; training and the oracle).
"""

from __future__ import annotations

import math

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from spectrio.models.batch import AttentionPlan
from spectrio.models.config import DType, ModelConfig
from spectrio.models.kv_cache import PagedKVCache

KV = tuple[paddle.Tensor, paddle.Tensor]


class RMSNorm(nn.Layer):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter(
            [dim], default_initializer=nn.initializer.Constant(1.0)
        )

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        variance = (x * x).mean(axis=-1, keepdim=True)
        return x * paddle.rsqrt(variance + self.eps) * self.weight


def rope_cos_sin(
    positions: paddle.Tensor, head_dim: int, theta: float, dtype: DType
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """cos/sin tables ``[..., head_dim]`` for the given positions (rotate-half layout)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    freqs = positions.astype("float64").unsqueeze(-1) * paddle.to_tensor(inv_freq)
    emb = paddle.concat([freqs, freqs], axis=-1)
    return paddle.cos(emb).astype(dtype), paddle.sin(emb).astype(dtype)


def apply_rope(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    """Rotate ``x`` of shape ``[..., T, H, D]`` with tables ``[..., T, D]``."""
    half = x.shape[-1] // 2
    rotated = paddle.concat([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


def attend(
    q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, mask: paddle.Tensor, scale: float
) -> paddle.Tensor:
    """Softmax attention. q ``[..., H, Tq, D]``, k/v ``[..., H, Tk, D]``, additive mask."""
    scores = paddle.matmul(q, k, transpose_y=True) * scale + mask
    return paddle.matmul(F.softmax(scores, axis=-1), v)


class Attention(nn.Layer):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.scale = 1.0 / math.sqrt(self.head_dim)
        d = cfg.hidden_size
        kv = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias_attr=False)
        self.k_proj = nn.Linear(d, kv, bias_attr=False)
        self.v_proj = nn.Linear(d, kv, bias_attr=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias_attr=False)

    def _qkv(
        self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor
    ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        lead = list(x.shape[:-1])
        q = self.q_proj(x).reshape(lead + [self.num_heads, self.head_dim])
        k = self.k_proj(x).reshape(lead + [self.num_kv_heads, self.head_dim])
        v = self.v_proj(x).reshape(lead + [self.num_kv_heads, self.head_dim])
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _expand_kv(self, t: paddle.Tensor, head_axis: int) -> paddle.Tensor:
        rep = self.num_heads // self.num_kv_heads
        return t if rep == 1 else paddle.repeat_interleave(t, rep, axis=head_axis)

    def forward_dense(
        self,
        x: paddle.Tensor,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        mask: paddle.Tensor,
        past: KV | None = None,
    ) -> tuple[paddle.Tensor, KV]:
        """x ``[B, T, d]``; ``past`` holds contiguous keys/values ``[B, P, kv_heads, D]`` of
        the positions before these; mask ``[T, P+T]``. Returns the output and all K/V."""
        b, t, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        if past is not None:
            k = paddle.concat([past[0], k], axis=1)
            v = paddle.concat([past[1], v], axis=1)
        qh, kh, vh = (y.transpose([0, 2, 1, 3]) for y in (q, k, v))
        out = attend(qh, self._expand_kv(kh, 1), self._expand_kv(vh, 1), mask, self.scale)
        return self.o_proj(out.transpose([0, 2, 1, 3]).reshape([b, t, -1])), (k, v)

    def forward_paged(
        self,
        x: paddle.Tensor,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        plan: AttentionPlan,
        cache: PagedKVCache,
        layer: int,
    ) -> paddle.Tensor:
        """x ``[N, d]`` packed rows; writes this step's K/V, then attends per sequence."""
        q, k, v = self._qkv(x, cos, sin)
        cache.write(layer, plan.write_slots, k, v)
        outs = []
        for seq in plan.seqs:
            kc, vc = cache.gather(layer, seq.context_slots)
            qs = q[seq.rows].transpose([1, 0, 2])
            kc = self._expand_kv(kc.transpose([1, 0, 2]), 0)
            vc = self._expand_kv(vc.transpose([1, 0, 2]), 0)
            outs.append(attend(qs, kc, vc, seq.mask, self.scale).transpose([1, 0, 2]))
        out = paddle.concat(outs, axis=0) if len(outs) > 1 else outs[0]
        return self.o_proj(out.reshape([x.shape[0], -1]))


class MLP(nn.Layer):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias_attr=False)
        self.up_proj = nn.Linear(d, f, bias_attr=False)
        self.down_proj = nn.Linear(f, d, bias_attr=False)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Layer):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward_dense(
        self,
        x: paddle.Tensor,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        mask: paddle.Tensor,
        past: KV | None = None,
    ) -> tuple[paddle.Tensor, KV]:
        attn, present = self.self_attn.forward_dense(self.input_layernorm(x), cos, sin, mask, past)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), present

    def forward_paged(
        self,
        x: paddle.Tensor,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        plan: AttentionPlan,
        cache: PagedKVCache,
        layer: int,
    ) -> paddle.Tensor:
        h = self.input_layernorm(x)
        x = x + self.self_attn.forward_paged(h, cos, sin, plan, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))
