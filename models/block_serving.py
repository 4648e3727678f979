"""A float model's serving weights taken from a GGUF file's quantized blocks instead.

The layers' fused projections and the output head are
:meth:`~spectrio.models.serving_matrix.ServingMatrix.from_blocks` matrices over the
file's own blocks (q/k/v and gate/up concatenated row-wise, which needs one type per
group; q's 1/sqrt(head_dim) folded into its block scales), so the native layer ops and
the head multiply by the quantized weights with int8 activations. A group whose tensors
are of a type without a kernel, or of mixed types, keeps its float32 matrices.

This first step still builds the float32 model from the file and keeps its parameters:
it changes what the serving forward computes with, not the memory the model holds.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import structlog

from spectrio.models.gguf_blocks import scaled_blocks
from spectrio.models.gguf_file import GGUFFile
from spectrio.models.model import SpectrioForCausalLM
from spectrio.models.serving_matrix import ServingMatrix

__all__ = ["serve_blocks"]

log = structlog.get_logger("spectrio.models.block_serving")


def _group(source: GGUFFile, names: list[str]) -> tuple[str, list[np.ndarray]] | None:
    """The blocks of every tensor of ``names``, when all have one type with a kernel."""
    found = [source.blocks(n) for n in names]
    if any(f is None for f in found) or len({f[0] for f in found if f is not None}) != 1:
        return None
    return found[0][0], [f[1] for f in found if f is not None]  # type: ignore[index]


def serve_blocks(model: SpectrioForCausalLM, source: GGUFFile) -> Counter[str]:
    """Point ``model``'s serving matrices at ``source``'s blocks where a kernel runs them;
    returns the matrices set per block type (``float32``: kept)."""
    cfg = model.config
    d = cfg.hidden_size
    model.prepare_serving()
    counts: Counter[str] = Counter()
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        pre = f"model.layers.{i}."
        qkv = _group(source, [pre + f"self_attn.{p}_proj.weight" for p in "qkv"])
        if qkv is not None:
            kind, (q, k, v) = qkv
            if attn.q_norm is None:  # the fused float path scales q; blocks scale their d
                q = scaled_blocks(q, kind, attn.scale)
            attn._qkv_weight = ServingMatrix.from_blocks(np.concatenate([q, k, v]), kind, d)
        counts[qkv[0] if qkv else "float32"] += 1
        o = _group(source, [pre + "self_attn.o_proj.weight"])
        if o is not None:
            attn._o_weight = ServingMatrix.from_blocks(
                o[1][0], o[0], attn.num_heads * attn.head_dim
            )
        counts[o[0] if o else "float32"] += 1
        gu = _group(source, [pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight"])
        if gu is not None:
            mlp._gate_up_weight = ServingMatrix.from_blocks(np.concatenate(gu[1]), gu[0], d)
        counts[gu[0] if gu else "float32"] += 1
        down = _group(source, [pre + "mlp.down_proj.weight"])
        if down is not None:
            f = cfg.intermediate_size
            mlp._down_weight = ServingMatrix.from_blocks(down[1][0], down[0], f)
        counts[down[0] if down else "float32"] += 1
    lm_head = model.lm_head
    head = _group(source, ["model.embed_tokens.weight" if lm_head is None else "lm_head.weight"])
    if head is not None:
        weight = model.model.embed_tokens.weight if lm_head is None else lm_head.weight.t()
        model._head.set_matrix(ServingMatrix.from_blocks(head[1][0], head[0], d), weight.detach())
    counts[head[0] if head else "float32"] += 1
    log.info("serving from GGUF blocks", path=source.where, matrices=dict(counts))
    return counts
