"""The draft stage: MTP catch-up over the previous step's verified rows, then substeps.

Runs on the device worker. Each substep reads the target hidden state at the last
position plus the embedding of the token there, and proposes the argmax token; the
draft of substep ``i + 1`` reads substep ``i``'s output hidden state."""

from __future__ import annotations

import time

import numpy as np
from msgspec.structs import replace

from spectrio.core.messages import StepPlan
from spectrio.models import ForwardOutput, PackedBatch
from spectrio.models.paddle_setup import paddle
from spectrio.stages.workspace import Workspace

__all__ = ["draft"]


def draft(ws: Workspace, plan: StepPlan) -> StepPlan:
    """``plan`` with ``drafts`` filled in for every sequence that wants them (a copy; the
    plan is not changed). Writes real MTP cache entries for the catch-up positions."""
    ws.release(plan.released)
    catch_up = [w for w in plan.seqs if w.mtp_token_ids]
    if not catch_up:
        return plan
    if ws.mtp_cache is None:
        raise RuntimeError("speculation needs a checkpoint with an MTP layer")
    prev = ws.hidden_rows_of([(w.seq_id, w.mtp_start, len(w.mtp_token_ids)) for w in catch_up])
    batch = PackedBatch.from_sequences(
        [w.mtp_token_ids for w in catch_up],
        [w.mtp_start for w in catch_up],
        [np.asarray(w.block_table) for w in catch_up],
    )
    wanting = [i for i, w in enumerate(catch_up) if w.num_drafts > 0]
    batch.logits_indices = batch.last_rows()[wanting]
    drafts: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    with paddle.no_grad():
        out = ws.model.mtp_forward(batch, prev, ws.mtp_cache)
        active = [catch_up[i] for i in wanting]
        hidden = _picked(ws, out, batch.logits_indices) if active else None
        logits = out.logits
        substep = 0
        while active:
            tokens = paddle.argmax(logits, axis=-1).numpy().tolist()
            for w, tok in zip(active, tokens, strict=True):
                drafts.setdefault(w.slot, []).append(int(tok))
            substep += 1
            keep = [i for i, w in enumerate(active) if w.num_drafts > substep]
            if not keep:
                break
            assert hidden is not None
            if len(keep) < len(active):
                active = [active[i] for i in keep]
                hidden = paddle.gather(
                    hidden, ws.model.staging.put(np.asarray(keep, dtype=np.int64)), axis=0
                )
            step_batch = PackedBatch.from_sequences(
                [[drafts[w.slot][-1]] for w in active],
                [w.mtp_start + len(w.mtp_token_ids) - 1 + substep for w in active],
                [np.asarray(w.block_table) for w in active],
            )
            out = ws.model.mtp_forward(step_batch, hidden, ws.mtp_cache)
            hidden, logits = out.hidden, out.logits
    ws.forward_seconds += time.perf_counter() - t0
    if not drafts:
        return plan
    seqs = [replace(w, drafts=drafts[w.slot]) if w.slot in drafts else w for w in plan.seqs]
    return replace(plan, seqs=seqs)


def _picked(ws: Workspace, out: ForwardOutput, rows: np.ndarray) -> paddle.Tensor:
    """The MTP hidden states of ``rows`` (the ones with logits): gathered by the pass
    already where it could."""
    if out.picked_hidden is not None:
        return out.picked_hidden
    return paddle.gather(out.hidden, ws.model.staging.put(rows), axis=0)
