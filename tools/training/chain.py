"""The MTP layer unrolled as the runtime drafts, for training: substep j + 1 reads
substep j's own output hidden state and attends to the real substep-1 entries plus its
own chain (``spectrio train``'s phase 2 and ``spectrio train-mtp`` train through it), the
target's greedy chain that labels it, chained acceptance, and the held-out evaluation."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, cast

import numpy as np

if TYPE_CHECKING:
    from spectrio.models.architecture.layers import KV, DecoderLayer
    from spectrio.models.architecture.model import SpectrioForCausalLM
    from spectrio.models.ops.paddle_setup import paddle

# ---- the unrolled chain, as the runtime drafts --------------------------------------


def chain_mask(rows: int, prefix: int, dtype: str) -> paddle.Tensor:
    """Additive mask of chain r over the ``prefix`` real (prefix) entries: row r sees
    columns ``c <= r + prefix - rows``, every real entry before its own first step."""
    from spectrio.models.ops.paddle_setup import paddle

    real = np.arange(prefix)[None, :] <= np.arange(rows)[:, None] + (prefix - rows)
    return paddle.to_tensor(np.where(real, 0.0, -np.inf).astype(dtype))


def _rope(model: SpectrioForCausalLM, start: int, n: int) -> tuple[paddle.Tensor, paddle.Tensor]:
    from spectrio.models.architecture.layers import rope_cos_sin
    from spectrio.models.ops.paddle_setup import paddle

    cfg = model.config
    return rope_cos_sin(paddle.arange(start, start + n, dtype="int64"), cfg.inv_freq(), model.dtype)


def chain_layer(
    layer: DecoderLayer,
    x: paddle.Tensor,
    cos: paddle.Tensor,
    sin: paddle.Tensor,
    real: KV,
    mask: paddle.Tensor,
    chain: list[KV],
) -> tuple[paddle.Tensor, KV]:
    """One decoder layer for ``[B, T]`` parallel chains, one new position per chain.

    Row r attends to the real keys its ``mask`` row allows and to the keys chain r wrote at
    its own earlier steps (``chain[i][:, r]``) and now. Equal to a causal pass with the
    chain's entries appended, but each chain's own entries are a per-row dot product, so a
    step costs one ``[T, P]`` attention instead of ``[T, P + steps * T]``.
    """
    from spectrio.models.ops.paddle_setup import paddle

    F = paddle.nn.functional

    attn = layer.self_attn
    b, t, _ = x.shape
    q, k, v = attn._qkv(layer.input_layernorm(x), cos, sin)
    qh = q.transpose([0, 2, 1, 3])  # [B, H, T, D]

    def heads(y: paddle.Tensor) -> paddle.Tensor:  # [B, T, kv, D] -> [B, H, T, D]
        return attn._expand_kv(y.transpose([0, 2, 1, 3]), 1)

    own = chain + [(k, v)]
    scores = [paddle.matmul(qh, heads(real[0]), transpose_y=True) * attn.scale + mask]
    scores += [(qh * heads(kk)).sum(axis=-1, keepdim=True) * attn.scale for kk, _ in own]
    probs = F.softmax(paddle.concat(scores, axis=-1), axis=-1)
    p = real[0].shape[1]
    out = paddle.matmul(probs[..., :p], heads(real[1]))
    for i, (_, vv) in enumerate(own):
        out = out + probs[..., p + i : p + i + 1] * heads(vv)
    x = x + attn.o_proj(out.transpose([0, 2, 1, 3]).reshape([b, t, -1]))
    return x + layer.mlp(layer.post_attention_layernorm(x)), (k, v)


def target_chain(
    model: SpectrioForCausalLM, ids: paddle.Tensor, depth: int
) -> tuple[list[paddle.Tensor], paddle.Tensor, list[paddle.Tensor]]:
    """The target's greedy continuation after every prefix of ``ids`` ``[B, T]``, ``depth``
    tokens deep, all prefixes in parallel.

    Returns ``(logits, hidden, tokens)``: ``logits[0]`` is the teacher-forced pass (row s
    follows ``ids[:, :s+1]``); ``logits[j]`` row s follows that prefix plus the target's
    own greedy tokens ``tokens[0][:, s] .. tokens[j-1][:, s]``; ``tokens[j]`` is the
    argmax of ``logits[j]``; ``hidden`` holds the teacher-forced pass's final normed
    hidden states.
    """
    from spectrio.models.ops.paddle_setup import paddle

    logits, hidden, real = model.forward_dense(ids)
    out, tokens = [logits], [paddle.argmax(logits, axis=-1)]
    t = ids.shape[1]
    mask = chain_mask(t, t, model.dtype)
    chains: list[list[KV]] = [[] for _ in model.model.layers]
    for j in range(1, depth):
        cos, sin = _rope(model, j, t)
        x = model.model.embed_tokens(tokens[-1])
        for i, layer in enumerate(model.model.layers):
            x, kv = chain_layer(cast("DecoderLayer", layer), x, cos, sin, real[i], mask, chains[i])
            chains[i].append(kv)
        logits = model.compute_logits(model.model.norm(x))
        out.append(logits)
        tokens.append(paddle.argmax(logits, axis=-1))
    return out, hidden, tokens


def mtp_chain(
    model: SpectrioForCausalLM,
    ids: paddle.Tensor,
    hidden: paddle.Tensor,
    chain_tokens: list[paddle.Tensor],
    depth: int,
) -> list[paddle.Tensor]:
    """The MTP layer drafting after every prefix ``ids[:, :s+1]`` in parallel, as the runtime does.

    The MTP cache first gets its real entries: position p pairs the target hidden
    ``hidden[:, p]`` with the token ``ids[:, p+1]``. Chain s then runs ``depth`` substeps:
    substep 1 at MTP position s pairs ``hidden[:, s]`` with ``chain_tokens[0][:, s]`` (the
    token the target just emitted); substep j+1 pairs substep j's own output hidden state
    with ``chain_tokens[j][:, s]`` at position s+j. Each attends to the real entries before
    s and to its own chain. Returns each substep's logits ``[B, T, V]``; row s of substep
    j predicts the token after ``chain_tokens[j-1][:, s]``.
    """
    from spectrio.models.loading.mtp_layout import layout_of

    mtp = model.mtp
    if mtp is None:
        raise RuntimeError("the model has no MTP layer")
    # A layer that ends in its norm (MiMo's, ERNIE's layout) hands the next substep the
    # normed state, as the runtime's mtp_forward does.
    norm_in_layer = layout_of(model.config).norm_in_layer
    t = ids.shape[1]
    _, _, real = model.mtp_forward_dense(ids[:, 1:], hidden[:, :-1])  # real entries 0..t-2
    mask = chain_mask(t, t - 1, model.dtype)
    x = hidden
    chain: list[KV] = []
    out = []
    for j in range(depth):
        cos, sin = _rope(model, j, t)
        fused = mtp.fuse(model.model.embed_tokens(chain_tokens[j]), x)
        x, kv = chain_layer(mtp, fused, cos, sin, real, mask, chain)
        chain.append(kv)
        normed = mtp.shared_head.norm(x)
        out.append(model.compute_logits(normed))
        x = normed if norm_in_layer else x
    return out


def chain_accepted(
    mtp_logits: list[paddle.Tensor], target_tokens: list[paddle.Tensor]
) -> np.ndarray:
    """Share of chains whose drafts 1..j all equal the target's greedy tokens, per j.

    ``mtp_logits[j]`` drafts ``target_tokens[j + 1]``. This is what greedy verification
    keeps, so it is exact for the runtime's drafting (a chain fed a wrong draft is
    already rejected, whatever it proposes next).
    """
    from spectrio.models.ops.paddle_setup import paddle

    hits = [
        (paddle.argmax(lg, axis=-1) == tok).numpy().reshape(-1)
        for lg, tok in zip(mtp_logits, target_tokens[1:], strict=False)
    ]
    return np.cumprod(np.stack(hits, axis=1), axis=1).mean(axis=0)


# ---- evaluation on held-out windows -------------------------------------------------


def heldout_eval(model: SpectrioForCausalLM, windows: np.ndarray, depth: int) -> dict[str, Any]:
    """Held-out next-token loss (and perplexity) and chained acceptance per substep."""
    from spectrio.models.ops.paddle_setup import paddle

    F = paddle.nn.functional

    was_training = model.training
    model.eval()
    losses, accepted = [], []
    with paddle.no_grad():
        for i in range(0, len(windows), 8):
            w = paddle.to_tensor(windows[i : i + 8])
            logits, hidden, tokens = target_chain(model, w[:, :-1], depth + 1)
            losses.append(float(F.cross_entropy(logits[0], w[:, 1:].unsqueeze(-1)).mean()))
            accepted.append(
                chain_accepted(mtp_chain(model, w[:, :-1], hidden, tokens, depth), tokens)
            )
    if was_training:
        model.train()
    loss = float(np.mean(losses))
    return {
        "heldout_loss": round(loss, 4),
        "heldout_ppl": round(math.exp(loss), 3),
        "accepted": [round(float(a), 4) for a in np.mean(accepted, axis=0)],
    }
