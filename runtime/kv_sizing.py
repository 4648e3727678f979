"""What a runtime asks of its checkpoint, and how many KV blocks each cache gets.

Guarantees:

* **A config the checkpoint cannot serve is refused before anything is allocated**
  (:func:`check_checkpoint`): MTP drafting needs an MTP layer, and every verified row
  needs a position, so ``max_model_len + k`` must fit in ``max_position_embeddings``.
  Either failure is a :class:`~spectrio.core.config.ConfigError` naming the field.
* **Every rank gets the same number of blocks** (:func:`num_kv_blocks`): the count is
  planned per rank from the config alone (each rank's caches hold its share of the KV
  heads, ``num_key_value_heads / tensor_parallel_size``), by
  :meth:`~spectrio.core.config.RuntimeConfig.resolve_num_kv_blocks` (an explicit
  ``num_kv_blocks``, else a memory budget, else one full-length sequence per batch slot;
  never fewer than one ``max_model_len`` sequence needs). Rank 0 computes it and sends it
  to the followers. The MTP cache or a draft model's, when there is one, gets as many
  blocks as the target's and shares its block tables; a draft model's layers count in
  each block's bytes (:func:`draft_kv_layers`).
* **A draft model the target cannot verify is refused** (:func:`check_draft`): another
  vocabulary, a tokenizer that splits text otherwise, or too few layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spectrio.core.config import ConfigError, RuntimeConfig
from spectrio.models.architecture.config import ModelConfig

if TYPE_CHECKING:
    from spectrio.models import LoadedModel
    from spectrio.models.text.tokenizer import TextTokenizer

__all__ = ["check_checkpoint", "check_draft", "draft_kv_layers", "num_kv_blocks"]


def check_checkpoint(config: RuntimeConfig, model: ModelConfig) -> None:
    """Refuse a config that ``model`` (the checkpoint's config) cannot serve."""
    if config.speculative.needs.checkpoint_mtp and not model.has_mtp:
        raise ConfigError(
            "speculative: the checkpoint has no MTP layer; use SpeculativeConfig(method=None)"
            " or method='ngram' or 'draft_model'"
        )
    if config.max_model_len + config.speculative.num_draft_tokens > model.max_position_embeddings:
        raise ConfigError(
            f"max_model_len: {config.max_model_len} + k exceeds the model's "
            f"max_position_embeddings ({model.max_position_embeddings})"
        )


def num_kv_blocks(
    config: RuntimeConfig, model: ModelConfig, draft: ModelConfig | None = None
) -> int:
    """KV blocks per cache on each rank (a draft model's layers counted in: ``draft``,
    or the target drafting for itself). Raises :class:`ConfigError` when they cannot
    hold one ``max_model_len`` sequence."""
    return config.resolve_num_kv_blocks(
        model.num_hidden_layers + draft_kv_layers(config, model, draft),
        model.num_key_value_heads // config.tensor_parallel_size,
        model.head_dim,
    )


#: A text whose tokens two tokenizers must agree on for one to draft for the other.
_PROBE = 'The quick brown fox, 1234 jumps: "over" the lazy dog\'s naïve café.\n'


def check_draft(config: RuntimeConfig, target: ModelConfig, draft: LoadedModel | None,
                target_tokenizer: TextTokenizer | None) -> None:  # fmt: skip
    """Refuse a draft model the target cannot verify: a vocabulary of another size, a
    tokenizer that splits text otherwise, or fewer layers than ``draft_layers``.
    ``draft`` None: the target drafts for itself."""
    spec = config.speculative
    model = target if draft is None else draft.config
    if spec.draft_layers is not None and spec.draft_layers > model.num_hidden_layers:
        raise ConfigError(
            f"draft_layers: {spec.draft_layers} exceeds the draft model's "
            f"{model.num_hidden_layers} layers"
        )
    if draft is None:
        return
    if draft.config.vocab_size != target.vocab_size:
        raise ConfigError(
            f"draft_model: {draft.path} has a vocabulary of {draft.config.vocab_size} "
            f"tokens, the target's has {target.vocab_size}"
        )
    if draft.tokenizer is not None and target_tokenizer is not None:
        if draft.tokenizer.encode(_PROBE) != target_tokenizer.encode(_PROBE):
            raise ConfigError(f"draft_model: {draft.path} tokenizes text otherwise than the target")


def draft_kv_layers(config: RuntimeConfig, target: ModelConfig, draft: ModelConfig | None) -> int:
    """The layers a draft model's KV adds to each block, counted in target layers
    (rounded up where its KV heads or head size differ): 0 without a draft model."""
    spec = config.speculative
    if not spec.needs.draft_model:
        return 0
    model = target if draft is None else draft
    layers = spec.draft_layers or model.num_hidden_layers
    per_layer = model.num_key_value_heads * model.head_dim
    return -(-layers * per_layer // (target.num_key_value_heads * target.head_dim))
