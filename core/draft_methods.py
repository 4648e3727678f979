"""What each draft method asks of the runtime, declared once (pure data).

Config checks, planning, prefix caching and KV sizing read a method's
:class:`DraftNeeds`, never its name; the methods themselves live in ``stages/device/draft/``
(one module each), and a new one is a module there and an entry here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DRAFT_METHODS", "DraftNeeds", "draft_slots", "needs_of"]


@dataclass(frozen=True)
class DraftNeeds:
    """A draft method's declaration.

    * ``draft_kv``: it keeps KV of its own per position, in blocks that share the
      target's block tables: KV sizing adds its layers, and a prompt block is cached
      with it (so a speculative request's blocks never match a plain one's).
    * ``prefix_lookahead``: tokens after a block that its KV at the block's positions
      also reads (the MTP layer's KV at ``p`` reads the token at ``p + 1``: 1).
    * ``model_steps``: its passes define the most drafts a step proposes
      (``SpeculativeConfig.num_model_steps``, when set, caps k for the adaptive policy).
    * ``checkpoint_mtp``: it runs the target checkpoint's MTP layer.
    * ``draft_model``: it runs a model of its own (``SpeculativeConfig.draft_model``).
    * ``draft_probs``: its drafts are sampled, and verification uses their
      probabilities (the full rejection rule); otherwise drafts are one-hot.
    * ``fields``: the ``SpeculativeConfig`` fields only this method reads (a trace's
      header of another method's run leaves them out).
    """

    draft_kv: bool = False
    prefix_lookahead: int = 0
    model_steps: bool = False
    checkpoint_mtp: bool = False
    draft_model: bool = False
    draft_probs: bool = False
    fields: tuple[str, ...] = ()


DRAFT_METHODS: dict[str, DraftNeeds] = {
    # the checkpoint's MTP layer (stages/device/draft/mtp.py)
    "mtp": DraftNeeds(
        draft_kv=True,
        prefix_lookahead=1,
        model_steps=True,
        checkpoint_mtp=True,
    ),
    # prompt lookup (stages/device/draft/ngram.py)
    "ngram": DraftNeeds(fields=("prompt_lookup_max", "prompt_lookup_min")),
    # a model of its own, sampled (stages/device/draft/draft_model.py)
    "draft_model": DraftNeeds(
        draft_kv=True,
        draft_model=True,
        draft_probs=True,
        fields=("draft_model", "draft_layers"),
    ),
}


def needs_of(method: str | None) -> DraftNeeds:
    """The declaration of ``method``; no speculation needs nothing."""
    return DraftNeeds() if method is None else DRAFT_METHODS[method]


def draft_slots(k: int, remaining_tokens: int, room: int) -> int:
    """Draft slots of a decoding sequence: the step's ``k``, but never more than it may
    still emit after the one token every step emits (``remaining_tokens - 1``) nor past
    ``max_model_len`` (``room`` positions left). The one draft budget: planning and
    overlap resolution (``stages/device/overlap.py``) both call it, on two threads."""
    return max(0, min(k, remaining_tokens - 1, room))
