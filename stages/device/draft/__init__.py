"""Drafting: the draft stage, and the seam between the generic step and a draft method.

The scheduler gives each sequence a number of draft slots and knows nothing of how
drafts are made. On the device worker, each resolved plan goes through :func:`draft`:
the workspace's :class:`~.base.TokenHistory` folds the plan in, then the configured
:class:`~.base.Proposer` (:func:`make_proposer`: ``mtp``, ``ngram`` or ``draft_model``)
fills the slots. After verify, in the same step, the proposer writes the draft state of
the step's prompt rows (:meth:`~.base.Proposer.after_verify`), with the target's hidden
rows when it asks for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgspec.structs import replace

from spectrio.core.config import SpeculativeConfig
from spectrio.core.messages import StepPlan
from spectrio.errors import ConfigError
from spectrio.stages.device.draft.base import Proposal, Proposer, TokenHistory

if TYPE_CHECKING:
    from spectrio.models import SpectrioForCausalLM
    from spectrio.stages.device.grammar_book import GrammarBook
    from spectrio.stages.device.workspace import Workspace

__all__ = ["Proposal", "Proposer", "TokenHistory", "draft", "make_proposer"]


def make_proposer(
    spec: SpeculativeConfig,
    model: SpectrioForCausalLM,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int | None = None,
    draft: SpectrioForCausalLM | None = None,
    grammar: GrammarBook | None = None,
) -> Proposer | None:
    """The proposer ``spec.method`` names; None with no speculation. ``draft``: the
    loaded ``spec.draft_model`` (None: the target drafts for itself). ``grammar``: the
    workspace's grammar state, which MTP drafts under (the others' drafts are cut by it
    in :func:`draft`)."""
    if spec.method is None:
        return None
    if spec.method == "mtp":
        from spectrio.stages.device.draft.mtp import MTPProposer

        return MTPProposer(
            model,
            num_blocks,
            block_size,
            k_max=spec.effective_num_model_steps,
            num_kv_heads=num_kv_heads,
            grammar=grammar,
        )
    if spec.method == "ngram":
        from spectrio.stages.device.draft.ngram import NgramProposer

        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "draft_model":
        from spectrio.stages.device.draft.draft_model import DraftModelProposer

        return DraftModelProposer(
            model if draft is None else draft,
            num_blocks,
            block_size,
            k_max=spec.effective_num_model_steps,
            num_layers=spec.draft_layers,
            num_kv_heads=num_kv_heads if draft is None else None,
        )
    raise ConfigError(f"method: no proposer for {spec.method!r}")


def draft(ws: Workspace, plan: StepPlan) -> StepPlan:
    """``plan`` with ``drafts`` filled in where the proposer found any (a copy; the plan
    is not changed) and ``draft_rows`` set. A constrained sequence's grammar state is
    brought up to date here, and its drafts are its grammar's forced tokens or the
    proposer's cut where the grammar refuses one (:mod:`..grammar_book`)."""
    ws.draft_probs = {}
    proposer = ws.proposer
    constrained = any(w.params.constraint is not None for w in plan.seqs)
    if proposer is None and not constrained:
        return plan
    ws.history.fold(plan)
    if constrained:  # before the proposer, which drafts under the grammar (MTP)
        if ws.grammar is None:
            raise RuntimeError("a constrained request reached a workspace without a grammar")
        ws.grammar.fold(plan, ws.history)
    proposal = (
        Proposal({}) if proposer is None else proposer.propose(_proposer_view(plan), ws.history)
    )
    ws.forward_seconds += proposal.forward_seconds
    ws.draft_probs = proposal.draft_probs
    found = proposal.drafts
    forced: dict[int, int] = {}
    if constrained:
        assert ws.grammar is not None
        found, forced, replaced = ws.grammar.constrain_drafts(
            plan, found, sampled=set(ws.draft_probs)
        )
        ws.draft_probs = {s: q for s, q in ws.draft_probs.items() if s not in replaced}
    if found:
        seqs = [
            replace(w, drafts=found[w.slot][: w.num_drafts], forced=forced.get(w.slot, 0))
            if w.slot in found
            else w
            for w in plan.seqs
        ]
        plan = replace(plan, seqs=seqs)
        ws.history.drafted(plan)
    if proposal.extra_rows:
        plan = replace(plan, draft_rows=proposal.extra_rows)
    return plan


def _proposer_view(plan: StepPlan) -> StepPlan:
    """The plan as the proposer sees it. The scheduler gives a constrained sequence every
    slot forced tokens may fill (``k_max``), but the proposer drafts only the policy's
    ``k`` for it, as for any other: past the forced tokens its drafts are as uncertain."""
    if not any(w.params.constraint is not None and w.num_drafts > plan.k for w in plan.seqs):
        return plan
    return replace(
        plan,
        seqs=[
            replace(w, num_drafts=plan.k)
            if w.params.constraint is not None and w.num_drafts > plan.k
            else w
            for w in plan.seqs
        ],
    )
