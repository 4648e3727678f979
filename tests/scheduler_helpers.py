"""Helpers shared by the scheduler tests, which play the device's part by hand."""

from __future__ import annotations

from spectrio.core.messages import SeqResult, SeqWork


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
