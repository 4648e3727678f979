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
  to the followers. The MTP cache, when there is one, gets as many blocks as the target's
  and shares its block tables.
"""

from __future__ import annotations

from spectrio.core.config import ConfigError, RuntimeConfig
from spectrio.models.config import ModelConfig

__all__ = ["check_checkpoint", "num_kv_blocks"]


def check_checkpoint(config: RuntimeConfig, model: ModelConfig) -> None:
    """Refuse a config that ``model`` (the checkpoint's config) cannot serve."""
    if config.speculative.method == "mtp" and not model.has_mtp:
        raise ConfigError(
            "speculative: the checkpoint has no MTP layer; use SpeculativeConfig(method=None)"
            " or method='ngram'"
        )
    if config.max_model_len + config.speculative.num_draft_tokens > model.max_position_embeddings:
        raise ConfigError(
            f"max_model_len: {config.max_model_len} + k exceeds the model's "
            f"max_position_embeddings ({model.max_position_embeddings})"
        )


def num_kv_blocks(config: RuntimeConfig, model: ModelConfig) -> int:
    """KV blocks per cache on each rank. Raises :class:`ConfigError` when they cannot
    hold one ``max_model_len`` sequence."""
    return config.resolve_num_kv_blocks(
        model.num_hidden_layers,
        model.num_key_value_heads // config.tensor_parallel_size,
        model.head_dim,
    )
