"""Llama building blocks in Paddle: RMSNorm, rotary embeddings, GQA attention, SwiGLU MLP.

Attention has two entry points that share every weight and the same core:
``forward_paged`` (packed rows, paged cache; serving) and ``forward_dense``
(``[B, T]`` causal, no cache; training and the oracle).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from spectrio.models.ops.paddle_setup import paddle  # first: Paddle is imported there, once

# isort: split
import paddle.nn.functional as F
from paddle import nn

from spectrio.models.architecture.batch import AttentionPlan, LayerRows
from spectrio.models.architecture.config import DType, ModelConfig
from spectrio.models.architecture.kv_cache import PagedKVCache
from spectrio.models.ops import fast_ops as fo
from spectrio.models.ops import native_ops
from spectrio.models.ops.serving_matrix import ServingMatrix

KV = tuple[paddle.Tensor, paddle.Tensor]


class RMSNorm(nn.Layer):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([dim], default_initializer=nn.initializer.Constant(1.0))
        self._ones: paddle.Tensor | None = None

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.add_normalize(x, None, weighted=True)[0]

    def normalize(self, x: paddle.Tensor) -> paddle.Tensor:
        """``x / rms(x)`` without the weight, for callers that fold the weight into the
        next matmul."""
        return x * paddle.rsqrt((x * x).mean(axis=-1, keepdim=True) + self.eps)

    def add_normalize(
        self, x: paddle.Tensor, delta: paddle.Tensor | None, weighted: bool = False
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """``(normalize(x + delta), x + delta)``: a residual add and the next norm, with
        the norm's weight applied when ``weighted`` (else folded into the next matmul).
        One op where :func:`fast_ops.fused_rms_norm` or :func:`native_ops.add_rms_norm`
        runs; five or six otherwise."""
        if weighted:
            scale = self.weight
        else:
            if self._ones is None:
                self._ones = paddle.ones([x.shape[-1]], dtype=x.dtype)
            scale = self._ones
        if delta is None:
            fused = fo.fused_rms_norm(x, scale, self.eps)
        else:
            fused = fo.fused_rms_norm(delta, scale, self.eps, residual=x)
        if fused is None:
            fused = native_ops.add_rms_norm(x, delta, scale, self.eps)
        if fused is not None:
            return fused
        if delta is not None:
            x = x + delta
        normed = self.normalize(x)
        return (normed * self.weight if weighted else normed), x


def rope_cos_sin(
    positions: paddle.Tensor, inv_freq: np.ndarray, dtype: DType
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """cos/sin tables ``[..., head_dim]`` for the given positions (rotate-half layout),
    from the float64 inverse frequencies ``[head_dim / 2]`` (:meth:`ModelConfig.inv_freq`)."""
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


def _folded(
    norm_weight: paddle.Tensor, parts: Sequence[paddle.Tensor | np.ndarray], half: bool = False
) -> ServingMatrix:
    """``norm_weight[:, None] * concat(parts, axis=1)``, a new matrix. Computed in NumPy:
    the same correctly rounded products Paddle's ops give, without its broadcast kernel,
    which made building a model's fused weights take a second of every start-up."""
    w = np.concatenate([p if isinstance(p, np.ndarray) else p.numpy() for p in parts], axis=1)
    w *= norm_weight.numpy()[:, None]
    return ServingMatrix(w, half=half)


def _linear(d_in: int, d_out: int, bias: bool) -> nn.Linear:
    """A Paddle linear layer (weight ``[in, out]``); its bias, when present, starts at 0."""
    return nn.Linear(d_in, d_out, bias_attr=None if bias else False)


class Attention(nn.Layer):
    """GQA attention with the family's switches: q/k/v bias, o bias, q/k RMSNorm.

    ``shards`` > 1 builds one tensor-parallel rank's share (``H/n`` query heads, ``KVH/n``
    KV heads); :meth:`_reduce` then sums the o projection's partial outputs across ranks
    (:class:`spectrio.models.architecture.parallel.ParallelAttention`), and the o bias,
    replicated on every rank, is added once after that sum."""

    def __init__(self, cfg: ModelConfig, shards: int = 1) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads // shards
        self.num_kv_heads = cfg.num_key_value_heads // shards
        self.head_dim = cfg.head_dim
        self.scale = 1.0 / math.sqrt(self.head_dim)
        d = cfg.hidden_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        self.q_proj = _linear(d, q, cfg.qkv_bias)
        self.k_proj = _linear(d, kv, cfg.qkv_bias)
        self.v_proj = _linear(d, kv, cfg.qkv_bias)
        self.o_proj = _linear(q, d, cfg.o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self._qkv_weight: ServingMatrix | None = None
        self._qkv_bias: paddle.Tensor | None = None
        self._qk_norm_weight: paddle.Tensor | None = None  # [H + KVH, D]
        self._o_weight: ServingMatrix | None = None

    def _reduce(self, x: paddle.Tensor) -> paddle.Tensor:
        """The sum of every rank's partial o projection (one rank: ``x`` itself)."""
        return x

    def _out(self, product: paddle.Tensor) -> paddle.Tensor:
        """The o projection's ``product`` (this rank's ``attn @ o``) summed across ranks,
        then the o bias."""
        out = self._reduce(product)
        bias = self.o_proj.bias
        return out if bias is None else fo.add(out, bias)

    def _qkv(
        self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor
    ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        lead = list(x.shape[:-1])
        q = self.q_proj(x).reshape(lead + [self.num_heads, self.head_dim])
        k = self.k_proj(x).reshape(lead + [self.num_kv_heads, self.head_dim])
        v = self.v_proj(x).reshape(lead + [self.num_kv_heads, self.head_dim])
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
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
        flat = out.transpose([0, 2, 1, 3]).reshape([b, t, -1])
        return self._out(fo.matmul(flat, self.o_proj.weight)), (k, v)

    @property
    def _q_scale(self) -> float:
        """What the fused q weight is scaled by: 1/sqrt(D), or 1 with q/k norms (their
        output does not scale with their input; the q norm's weight carries it)."""
        return 1.0 if self.q_norm is not None else self.scale

    def qkv_parts(self) -> list[np.ndarray]:
        """The fused q|k|v weight's parts ``[d, *]``, q pre-scaled (:attr:`_q_scale`)."""
        q = self.q_proj.weight.numpy()
        return [q * q.dtype.type(self._q_scale), self.k_proj.weight.numpy(),
                self.v_proj.weight.numpy()]  # fmt: skip

    def fuse_qkv(self, norm_weight: paddle.Tensor, half: bool = False) -> None:
        """Build ``[d, (H + 2 KVH) * D]``: the preceding RMSNorm's weight folded into the
        rows, then q, k and v side by side, so one matmul of the normalised input does all
        three. q is pre-scaled by 1/sqrt(D) here, or, with q/k norms (whose output does
        not scale with their input), through the q norm's weight in ``_qk_norm_weight``.
        The biases are concatenated the same way.

        The separate projections stay the parameters that checkpoints and training see;
        :meth:`SpectrioForCausalLM.train` drops the fused copy. ``half``: float16 panels
        (:class:`~spectrio.models.ops.serving_matrix.ServingMatrix`).
        """
        q_scale = self._q_scale
        if self._qkv_weight is None:  # else set from elsewhere (GGUF blocks): keep it
            self._qkv_weight = _folded(norm_weight, self.qkv_parts(), half)
        if self.q_proj.bias is not None:
            self._qkv_bias = paddle.concat(
                [self.q_proj.bias * q_scale, self.k_proj.bias, self.v_proj.bias]
            ).detach()
        if self.q_norm is not None and self.k_norm is not None:
            self._qk_norm_weight = paddle.concat(
                [
                    (self.q_norm.weight * self.scale).unsqueeze(0).expand([self.num_heads, -1]),
                    self.k_norm.weight.unsqueeze(0).expand([self.num_kv_heads, -1]),
                ]
            ).detach()
        if self._o_weight is None:
            self._o_weight = ServingMatrix(self.o_proj.weight.detach(), half=half)

    def forward_paged(
        self,
        x: paddle.Tensor,
        rope: RopeRows,
        plan: AttentionPlan,
        cache: PagedKVCache,
        layer: int,
    ) -> paddle.Tensor:
        """x ``[N, d]`` packed rows, normalised but not yet scaled by the norm weight (it
        is folded into the fused projection); writes this step's K/V, then attends for
        the whole batch at once over the context gathered through the block tables."""
        n = x.shape[0]
        h, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        assert self._qkv_weight is not None, "DecoderLayer.forward_paged fuses the weights"
        qkv = self._qkv_weight.matmul(x)
        if self._qkv_bias is not None:
            qkv = fo.add(qkv, self._qkv_bias)
        qk, v = fo.split(qkv, [(h + kvh) * hd, kvh * hd], 1)
        qk = fo.reshape(qk, [n, h + kvh, hd])
        if self._qk_norm_weight is not None:
            assert self.q_norm is not None
            qk = self.q_norm.normalize(qk) * self._qk_norm_weight
        q, k = fo.split(rope.apply(qk), [h, kvh], 1)
        cache.write(layer, plan.write_rows, k, v)
        if plan.groups is None:
            out = self._attend(q, plan, cache, layer)
        else:  # decode/verify rows and prefill chunks, each padded only to their own length
            out = paddle.concat([self._attend(q, part, cache, layer) for part in plan.groups])
            if plan.order is not None:
                out = fo.gather(out, plan.order)
        assert self._o_weight is not None
        return self._out(self._o_weight.matmul(out))

    def _attend(
        self, q: paddle.Tensor, plan: AttentionPlan, cache: PagedKVCache, layer: int
    ) -> paddle.Tensor:
        """Attention of the query rows ``q`` ``[N, H, D]`` (rope applied) of ``plan``'s
        sequences over their cached context: ``[rows, H * D]`` in the plan's packed order."""
        h, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        b, tq, g = plan.num_seqs, plan.max_q, h // kvh
        if plan.pad_rows is not None:
            q = fo.gather(q, plan.pad_rows)
        # [B, KVH, Tk, D], or [1, 1, KVH, Tk, D] to broadcast over the rows
        kc, vc = cache.gather(layer, plan.context_blocks, b, row_axis=plan.broadcast_kv)
        # GQA without repeating K/V: the query heads of one KV head and their rows share
        # one matrix, so attention is a plain batched matmul over (sequence, KV head). A
        # decode step's rows are already in that layout; verification and prefill (several
        # rows per sequence) need a transpose, except a single sequence's few rows, which
        # keep their row axis and broadcast K/V over it (AttentionPlan.broadcast_kv).
        flat = tq == 1 or plan.broadcast_kv
        if tq == 1:
            q = fo.reshape(q, [b, kvh, g, hd])
        elif plan.broadcast_kv:
            q = fo.reshape(q, [b, tq, kvh, g, hd])
        else:
            q = fo.reshape(
                fo.transpose(fo.reshape(q, [b, tq, kvh, g, hd]), [0, 2, 3, 1, 4]),
                [b, kvh, g * tq, hd],
            )
        scores = fo.add(fo.matmul(q, kc, transpose_y=True), plan.mask_for_groups(g))
        out = fo.matmul(fo.softmax(scores), vc)  # [B, KVH, G * Tq, D] or [1, Tq, KVH, G, D]
        if flat:
            out = fo.reshape(out, [b * tq, h * hd])
        else:
            out = fo.reshape(
                fo.transpose(fo.reshape(out, [b, kvh, g, tq, hd]), [0, 3, 1, 2, 4]),
                [b * tq, h * hd],
            )
        if plan.unpad_rows is not None:
            out = fo.gather(out, plan.unpad_rows)
        return out


class RopeRows:
    """Rotary embedding for one step's rows, shared by every layer.

    ``x * cos + rotate_half(x) * sin`` is linear in ``x``: per position it is ``x @ M``
    with ``M = diag(cos) + R diag(sin)`` (R the signed rotate-half permutation). Each
    row's M is looked up once per step, so q and k of a layer rotate in one batched
    matmul instead of four elementwise ops.
    """

    def __init__(self, matrices: paddle.Tensor) -> None:
        self.matrices = matrices  # [N, D, D]

    def apply(self, x: paddle.Tensor) -> paddle.Tensor:
        """``x`` [N, heads, D] rotated by its row's position."""
        return fo.matmul(x, self.matrices)


def rope_matrices(cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """``[P, D, D]`` rotation matrices ``diag(cos) + R diag(sin)`` from ``[P, D]`` tables."""
    d = cos.shape[-1]
    half = d // 2
    m = np.zeros((cos.shape[0], d, d), dtype=cos.dtype)
    cols = np.arange(d)
    m[:, cols, cols] = cos
    # rotate_half(x)[j] = -x[j + half] for j < half, x[j - half] for j >= half.
    m[:, cols[:half] + half, cols[:half]] = -sin[:, :half]
    m[:, cols[half:] - half, cols[half:]] = sin[:, half:]
    return m


class MLP(nn.Layer):
    """SwiGLU with optional biases; ``shards`` > 1 builds one rank's ``F/n`` columns, and
    :meth:`_reduce` sums the down projection across ranks before its bias is added."""

    def __init__(self, cfg: ModelConfig, shards: int = 1) -> None:
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size // shards
        self.gate_proj = _linear(d, f, cfg.mlp_bias)
        self.up_proj = _linear(d, f, cfg.mlp_bias)
        self.down_proj = _linear(f, d, cfg.mlp_bias)

        self._gate_up_weight: ServingMatrix | None = None
        self._gate_up_bias: paddle.Tensor | None = None
        self._down_weight: ServingMatrix | None = None

    def _reduce(self, x: paddle.Tensor) -> paddle.Tensor:
        return x

    def _down(self, product: paddle.Tensor) -> paddle.Tensor:
        """The down projection's ``product`` summed across ranks, then the down bias."""
        out = self._reduce(product)
        bias = self.down_proj.bias
        return out if bias is None else fo.add(out, bias)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        return self._down(fo.matmul(h, self.down_proj.weight))

    def gate_up_parts(self) -> list[np.ndarray]:
        """The fused gate|up weight's parts ``[d, f]``."""
        return [self.gate_proj.weight.numpy(), self.up_proj.weight.numpy()]

    def fuse(self, norm_weight: paddle.Tensor, half: bool = False) -> None:
        """Build the gate|up matrix with the preceding RMSNorm's weight folded in
        (``half``: float16 panels, as :meth:`Attention.fuse_qkv`)."""
        if self._gate_up_weight is None:  # else set from elsewhere (GGUF blocks): keep it
            self._gate_up_weight = _folded(norm_weight, self.gate_up_parts(), half)
        if self.gate_proj.bias is not None:
            self._gate_up_bias = paddle.concat([self.gate_proj.bias, self.up_proj.bias]).detach()
        if self._down_weight is None:
            self._down_weight = ServingMatrix(self.down_proj.weight.detach(), half=half)

    def forward_fused(self, x: paddle.Tensor) -> paddle.Tensor:
        """The same MLP on a normalised, unweighted ``x``: one gate|up matmul, ``swiglu``."""
        assert self._gate_up_weight is not None, "DecoderLayer.forward_paged fuses the weights"
        assert self._down_weight is not None
        gate_up = self._gate_up_weight.matmul(x)
        if self._gate_up_bias is not None:
            gate_up = fo.add(gate_up, self._gate_up_bias)
        return self._down(self._down_weight.matmul(fo.swiglu(gate_up)))


class DecoderLayer(nn.Layer):
    #: build the serving weights as float16 panels (the MTP layer's, which only drafts)
    half_weights = False
    #: prepare_serving built the serving weights (a class default: a tensor-parallel
    #: layer builds its parts without this __init__)
    _fused = False
    #: its halves' outputs are one rank's partial sums, summed across the ranks between
    #: the halves (a tensor-parallel shard's layer): it runs op by op, never in a run of
    #: layers in one op
    partial_sums = False
    _native_inputs: native_ops.LayerInputs | None = None  # native_inputs(), kept

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
        rope: RopeRows,
        plan: AttentionPlan,
        cache: PagedKVCache,
        layer: int,
        delta: paddle.Tensor | None = None,
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """The block on ``x + delta``. Returns ``(x', delta')`` whose sum is the block's
        output, left unsummed so the next norm adds it in its own op."""
        if not self._fused:
            self.prepare_serving()
        h, x = self.input_layernorm.add_normalize(x, delta)
        attn = self.self_attn.forward_paged(h, rope, plan, cache, layer)
        h, x = self.post_attention_layernorm.add_normalize(x, attn)
        return x, self.mlp.forward_fused(h)

    def native_ready(self) -> bool:
        """Whether :meth:`forward_native` runs: the serving weights are packed panels
        (float32 weights where the native kernels run; the MTP layer's may be float16)."""
        return self.native_inputs() is not None

    def native_inputs(self) -> native_ops.LayerInputs | None:
        """The layer's inputs to the native ops (:class:`native_ops.LayerInputs`), or
        None where they cannot run: a serving weight is not packed. Kept until
        :meth:`drop_fused`, since the packed weights live as long."""
        if self._native_inputs is not None:
            return self._native_inputs
        if not self._fused:
            self.prepare_serving()
        attn, mlp = self.self_attn, self.mlp
        qkv_m, o_m = attn._qkv_weight, attn._o_weight
        gate_up_m, down_m = mlp._gate_up_weight, mlp._down_weight
        if qkv_m is None or o_m is None or gate_up_m is None or down_m is None:
            return None
        qkv, o, gate_up, down = qkv_m.panels, o_m.panels, gate_up_m.panels, down_m.panels
        if qkv is None or o is None or gate_up is None or down is None:  # not packed
            return None
        # panels carry the norm weights folded in; blocks cannot, so the ops apply them
        self._native_inputs = native_ops.LayerInputs(
            input_norm=self.input_layernorm.weight if qkv_m.blocks else None,
            qkv=qkv, qkv_bias=attn._qkv_bias, qk_norm=attn._qk_norm_weight, o=o,
            o_bias=attn.o_proj.bias,
            post_norm=self.post_attention_layernorm.weight if gate_up_m.blocks else None,
            gate_up=gate_up, gate_up_bias=mlp._gate_up_bias, down=down,
            down_bias=mlp.down_proj.bias,
            types=(qkv_m.ggml_type, o_m.ggml_type, gate_up_m.ggml_type, down_m.ggml_type),
            heads=(attn.num_heads, attn.num_kv_heads, attn.head_dim),
            intermediate=down_m.shape[0],
            eps=self.input_layernorm.eps,
        )  # fmt: skip
        return self._native_inputs

    def forward_native(
        self,
        x: paddle.Tensor,
        delta: paddle.Tensor | None,
        bias: paddle.Tensor | None,
        rows: LayerRows,
        cache: PagedKVCache,
        layer: int,
    ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor | None]:
        """The block on ``x + delta + bias`` in two native ops, one per half
        (``csrc/spectrio_layer.cc``), with each half's partial output summed across
        tensor-parallel ranks between them. Returns ``(x', delta', bias')`` whose sum is
        the block's output: the down bias is left for the next op to add, as each op
        adds the previous half's bias (o's, here) after the ranks' sum. Only where
        :meth:`native_ready`, without autograd."""
        i = self.native_inputs()
        assert i is not None
        out, x = native_ops.attention_block(
            x, delta, bias, i.qkv, i.qkv_bias, i.qk_norm, rows.rope, cache.pools(layer), i.o,
            rows.as_tuple, (*i.heads, cache.block_size), i.eps, norm_weight=i.input_norm,
            types=(i.types[0], i.types[1]),
        )  # fmt: skip
        out, x = native_ops.mlp_block(
            x, self.self_attn._reduce(out), i.o_bias, i.gate_up, i.gate_up_bias, i.down,
            i.intermediate, i.eps, norm_weight=i.post_norm, types=(i.types[2], i.types[3]),
        )  # fmt: skip
        return x, self.mlp._reduce(out), i.down_bias

    def quantize_serving(self, type_name: str) -> None:
        """Serve this layer from GGUF blocks of ``type_name`` quantized from its
        parameters (q pre-scaled as :meth:`Attention.fuse_qkv` scales it), instead of
        panels: :meth:`prepare_serving` then keeps them and adds the biases and q/k norms;
        the layer ops apply the norm weights, which blocks cannot hold. Only where the
        native layers run (they multiply by blocks)."""
        attn, mlp = self.self_attn, self.mlp
        qkv, gate_up = np.concatenate(attn.qkv_parts(), axis=1), mlp.gate_up_parts()
        attn._qkv_weight = ServingMatrix.quantized(qkv.T, type_name)
        attn._o_weight = ServingMatrix.quantized(attn.o_proj.weight.numpy().T, type_name)
        mlp._gate_up_weight = ServingMatrix.quantized(np.concatenate(gate_up, axis=1).T, type_name)
        mlp._down_weight = ServingMatrix.quantized(mlp.down_proj.weight.numpy().T, type_name)
        self._native_inputs = None

    def prepare_serving(self, release: bool = False) -> None:
        """Build the fused serving weights (once). With ``release``, free the separate
        q/k/v and gate/up matrices they were built from: the fused copies hold the same
        values (times the norm weights), so keeping both doubles most of a layer's
        memory, but only the serving forward can run afterwards."""
        if not self._fused:
            self.self_attn.fuse_qkv(self.input_layernorm.weight, self.half_weights)
            self.mlp.fuse(self.post_attention_layernorm.weight, self.half_weights)
            self._fused = True
        if release:
            attn, mlp = self.self_attn, self.mlp
            linears = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
            # o and down share the parameter's memory unless they were packed into panels
            shared = ((attn.o_proj, attn._o_weight), (mlp.down_proj, mlp._down_weight))
            linears += [linear for linear, matrix in shared if matrix is not None and matrix.packed]
            for linear in linears:
                if linear.weight._is_initialized():  # one served from blocks never was
                    linear.weight._clear_data()

    def drop_fused(self) -> None:
        """Forget the fused serving weights (they are rebuilt from the parameters)."""
        attn, mlp = self.self_attn, self.mlp
        attn._qkv_weight = attn._qkv_bias = attn._qk_norm_weight = attn._o_weight = None
        mlp._gate_up_weight = mlp._gate_up_bias = mlp._down_weight = None
        self._native_inputs = None
        self._fused = False
