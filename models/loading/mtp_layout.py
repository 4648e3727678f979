"""Where the models that ship an MTP layer store it, mapped onto spectrio's one MTP layer.

spectrio's :class:`~spectrio.models.architecture.mtp_layer.MTPLayer` computes, for the row
at position ``p`` (target hidden state ``h_p``, next token ``t_{p+1}``)::

    x = eh_proj(concat[enorm(embed(t_{p+1})), hnorm(h_p)])   # fuse: embedding first
    x = block(x)                                             # one decoder layer
    logits = head(shared_head.norm(x))                       # the target's shared head

Three checkpoint layouts store such a layer (``L`` = ``num_hidden_layers``; spectrio
holds one MTP layer, so ``i`` is 0):

========  =============================================  ===============================
layout    MTP tensors                                    the same parts in spectrio
========  =============================================  ===============================
deepseek  ``model.layers.{L}.enorm/hnorm/eh_proj``,      identical (DeepSeek-V3's names;
          ``.shared_head.norm``, ``.<block>``            spectrio writes this layout)
mimo      ``model.mtp_layers.{i}.token_layernorm``,      enorm, hnorm, eh_proj (its two
          ``.hidden_layernorm``, ``.input_proj``,        column halves swapped), shared
          ``.final_layernorm``, ``.<block>``             head norm, block
ernie     ``model.mtp_emb_norm.{i}``,                    enorm, hnorm, eh_proj, block;
          ``model.mtp_hidden_norm.{i}``,                 the head norm is the target's
          ``model.mtp_linear_proj.{i}``,                 final norm ``model.norm``, read
          ``model.mtp_block.{i}.<block>``                a second time
========  =============================================  ===============================

``<block>`` is a decoder layer under the target's own names (``input_layernorm``,
``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``,
with the family's biases and norms), so ERNIE's block q/k rows get the same interleaved-
RoPE permutation as its target layers.

Facts, read in the engines that serve these models (never their code):

* MiMo (XiaomiMiMo/MiMo-7B, ``MiMoForCausalLM``): vLLM ``mimo_mtp.py`` (upstream and
  XiaomiMiMo's fork) and SGLang ``mimo_mtp.py``: ``input_proj(cat[hidden_layernorm(h),
  token_layernorm(e)])``, hidden first, so spectrio's eh_proj is ``input_proj`` with its
  two column halves swapped; then a Qwen2 decoder layer (q/k/v bias), then
  ``final_layernorm``, whose output is both what the head reads and what the layer
  returns (so a next substep reads the normed state). vLLM's ``mimo.py`` (upstream and
  Xiaomi's fork) returns the target's hidden state *before* its final norm and applies
  the norm only in ``compute_logits``: the MTP layer reads the pre-norm state. (SGLang's
  ``MiMoModel`` inherits Qwen2's normed output; we follow the model authors' engine.)
* ERNIE 4.5, as FastDeploy serves it (``ernie4_5_mtp.py``): ``eh_proj(cat[enorm(e),
  hnorm(h)])`` with ``enorm`` = ``mtp_emb_norm.0``, ``hnorm`` = ``mtp_hidden_norm.0``,
  ``eh_proj`` = ``mtp_linear_proj.0`` (no bias: ``ParallelEHProjection`` defaults to
  none), ``mtp_block.{i}`` an ERNIE decoder layer, and then the *target's* final norm
  (``sharing_model.ernie.norm``), whose output the layer returns and the next substep
  reads. The target hands the MTP layer its normed hidden state. The layer count is the
  config's ``num_nextn_predict_layers``. FastDeploy reads Paddle checkpoints
  (``ernie.`` prefix, fused ``qkv_proj``); spectrio reads ERNIE 4.5 in the Hugging Face
  names its target already uses (``model.``, separate q/k/v), which is also how vLLM's
  ``ernie_mtp.py`` reads the MTP tensors.

Where the sources disagree, spectrio follows the model's own serving engine and says so:
SGLang feeds MiMo's layer the normed target state; vLLM's ``ernie_mtp.py`` puts no norm
before the head; a Paddle ERNIE 4.5 training implementation (``Ernie4_5_Model`` with
``mtp_block``) feeds and chains unnormed states and norms only for the logits. vLLM and
SGLang also zero the embedding at position 0 before every MTP layer they run, DeepSeek's
included (a serving choice; FastDeploy does not); spectrio does not, for any layout. Such
choices change which tokens are drafted, never what is emitted.

A layout is recognised from the tensor names a checkpoint holds (:func:`detect`); the
dataflow switches it implies (:class:`MTPLayout`) travel in ``ModelConfig.mtp_layout``.
Everything here is pure: names, flags and one column permutation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import TYPE_CHECKING, Literal

import numpy as np

from spectrio.errors import CheckpointError

if TYPE_CHECKING:  # config.py imports this module, so ModelConfig is for the checker only
    from spectrio.models.architecture.config import ModelConfig

__all__ = [
    "LAYOUTS",
    "MTPLayout",
    "MTPLayoutName",
    "convert",
    "detect",
    "hf_name",
    "is_layout_tensor",
    "layout_of",
    "tolerated",
    "transforms",
    "with_layout",
]

MTPLayoutName = Literal["deepseek", "mimo", "ernie"]


@dataclasses.dataclass(frozen=True)
class MTPLayout:
    """How a layout's MTP layer is wired around the parts spectrio's layer has."""

    name: MTPLayoutName
    #: the layer reads the target's hidden state before its final norm (MiMo), not after
    reads_prenorm: bool
    #: the layer's own output is normed (MiMo's ``final_layernorm``, FastDeploy's shared
    #: norm): the head and the next substep both read the normed state. Otherwise the
    #: norm belongs to the head and the next substep reads the unnormed state (DeepSeek).
    norm_in_layer: bool


LAYOUTS: dict[MTPLayoutName, MTPLayout] = {
    "deepseek": MTPLayout("deepseek", reads_prenorm=False, norm_in_layer=False),
    "mimo": MTPLayout("mimo", reads_prenorm=True, norm_in_layer=True),
    "ernie": MTPLayout("ernie", reads_prenorm=False, norm_in_layer=True),
}

# The layout a family's own checkpoints use, for a config that promises an MTP layer
# whose tensors are all missing: the "missing tensor" message then names what that
# family's checkpoints call it.
_NATIVE: dict[str, MTPLayoutName] = {"mimo": "mimo", "ernie4_5": "ernie"}

# spectrio's MTP-only parts (under ``mtp.``) in each layout; every other ``mtp.`` name is
# the decoder block, stored under the layout's block prefix with its own name.
_MIMO_PARTS = {
    "enorm.weight": "token_layernorm.weight",
    "hnorm.weight": "hidden_layernorm.weight",
    "eh_proj.weight": "input_proj.weight",
    "shared_head.norm.weight": "final_layernorm.weight",
}
_ERNIE_PARTS = {
    "enorm.weight": "model.mtp_emb_norm.0.weight",
    "hnorm.weight": "model.mtp_hidden_norm.0.weight",
    "eh_proj.weight": "model.mtp_linear_proj.0.weight",
    # FastDeploy's MTP model norms its output with the target's own final norm.
    "shared_head.norm.weight": "model.norm.weight",
}
_ERNIE_PREFIXES = (
    "model.mtp_block.", "model.mtp_emb_norm.", "model.mtp_hidden_norm.", "model.mtp_linear_proj.",
)  # fmt: skip

# DeepSeek-V3 stores copies of the shared embedding and head inside its MTP layer; spectrio
# shares the target's, so those copies are not loaded.
_DEEPSEEK_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def layout_of(cfg: ModelConfig) -> MTPLayout:
    return LAYOUTS[cfg.mtp_layout]


def _prefixes(layout: MTPLayoutName, cfg: ModelConfig) -> tuple[str, ...]:
    if layout == "deepseek":
        return (f"model.layers.{cfg.num_hidden_layers}.",)
    if layout == "mimo":
        return ("model.mtp_layers.",)
    return _ERNIE_PREFIXES


def hf_name(paddle_name: str, cfg: ModelConfig) -> str:
    """The stored name of an MTP parameter (``mtp.*``) in ``cfg.mtp_layout``."""
    part = paddle_name.removeprefix("mtp.")
    if cfg.mtp_layout == "mimo":
        return "model.mtp_layers.0." + _MIMO_PARTS.get(part, part)
    if cfg.mtp_layout == "ernie":
        return _ERNIE_PARTS.get(part) or "model.mtp_block.0." + part
    return f"model.layers.{cfg.num_hidden_layers}.{part}"


def convert(paddle_name: str, hf: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """A stored tensor (Hugging Face ``[out, in]`` layout) as spectrio's parameter wants
    it, and back: MiMo's ``input_proj`` reads ``[hidden, embedding]`` where eh_proj reads
    ``[embedding, hidden]``, so its two column halves swap. Swapping twice is the
    identity, so loading and saving share this. Every other tensor passes unchanged."""
    if cfg.mtp_layout != "mimo" or paddle_name != "mtp.eh_proj.weight":
        return hf
    d = hf.shape[1] // 2
    return np.ascontiguousarray(np.concatenate([hf[:, d:], hf[:, :d]], axis=1))


def transforms(paddle_name: str, cfg: ModelConfig) -> bool:
    """Whether :func:`convert` changes this tensor (it must then be read whole)."""
    return cfg.mtp_layout == "mimo" and paddle_name == "mtp.eh_proj.weight"


def is_layout_tensor(name: str, cfg: ModelConfig) -> bool:
    """Whether a stored name lies in ``cfg.mtp_layout``'s MTP namespace."""
    return name.startswith(_prefixes(cfg.mtp_layout, cfg))


def tolerated(name: str, cfg: ModelConfig) -> bool:
    """A stored tensor that is known and deliberately not loaded: DeepSeek-V3's copies of
    the shared embedding and head inside its MTP layer."""
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    return (
        cfg.mtp_layout == "deepseek"
        and name.startswith(prefix)
        and name[len(prefix) :] in _DEEPSEEK_COPIES
    )


def detect(names: Collection[str], cfg: ModelConfig, where: str) -> MTPLayoutName:
    """The layout whose MTP tensors ``names`` holds. Tensors of two layouts are refused
    (naming one of each): which one is the draft layer would be a guess. With none, the
    family's own layout when the config promises an MTP layer (so a missing tensor is
    named as that family stores it), else spectrio's own."""
    found: dict[MTPLayoutName, str] = {}
    for layout in LAYOUTS:
        prefixes = _prefixes(layout, cfg)
        hit = next((n for n in sorted(names) if n.startswith(prefixes)), None)
        if hit is not None:
            found[layout] = hit
    if len(found) > 1:
        (a, na), (b, nb) = list(found.items())[:2]
        raise CheckpointError(
            f"{where}: MTP tensors in two layouts, {na!r} ({a}) and {nb!r} ({b}); a "
            "checkpoint holds one MTP layer in one layout"
        )
    if found:
        return next(iter(found))
    return _NATIVE.get(cfg.family, "deepseek") if cfg.has_mtp else "deepseek"


def with_layout(cfg: ModelConfig, names: Collection[str], where: str) -> ModelConfig:
    """``cfg`` with the MTP layout of the checkpoint holding ``names``."""
    return dataclasses.replace(cfg, mtp_layout=detect(names, cfg, where))
