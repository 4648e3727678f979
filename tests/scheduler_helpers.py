"""Helpers shared by the scheduler tests, which play the device's part by hand."""

from __future__ import annotations

from msgspec.structs import replace

from spectrio.core.messages import SeqResult, SeqWork, StepPlan
from spectrio.stages.device.draft import TokenHistory
from spectrio.stages.device.draft.mtp import CatchUp, extra_rows


def seq_result(
    w: SeqWork, accepted: int, token_ids: list[int], finish_reason: str | None = None
) -> SeqResult:
    """The result a device returns for ``w``: ``accepted`` of its drafts accepted and
    ``token_ids`` emitted, its rows verified (``num_computed``)."""
    return SeqResult(
        slot=w.slot,
        seq_id=w.seq_id,
        request_id=w.request_id,
        num_drafts=w.num_drafts,
        num_accepted=accepted,
        token_ids=token_ids,
        finish_reason=finish_reason,
        num_computed=w.start_pos + len(w.token_ids),
        context_len=w.context_len,
    )


class MTPCatchUp:
    """The MTP proposer's bookkeeping without a model: folds each plan into a token
    history, advances the catch-up positions, and drafts token 7 in every slot (what
    ``finish_step``-style helpers emit)."""

    def __init__(self, k_max: int) -> None:
        self.k_max = k_max
        self.history = TokenHistory()
        self.catch_up = CatchUp()

    def run(self, plan: StepPlan) -> tuple[dict[int, tuple[int, list[int]]], int]:
        """seq id -> (first catch-up position, tokens), and the step's draft rows."""
        self.history.release(plan.released)
        self.catch_up.release(plan.released)
        self.history.fold(plan)
        out = {
            w.seq_id: self.catch_up.advance(
                w.seq_id, w.start_pos, self.history.tokens(w.seq_id), len(w.cached_ids)
            )
            for w in plan.seqs
            if w.speculative
        }
        self.history.drafted(
            replace(plan, seqs=[replace(w, drafts=[7] * w.num_drafts) for w in plan.seqs])
        )
        return out, extra_rows((len(t) for _, t in out.values()), self.k_max)
