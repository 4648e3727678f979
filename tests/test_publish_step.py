"""The publisher's per-step record, packed from a StepResult and read back with unpack."""

from __future__ import annotations

import msgspec
import numpy as np

from spectrio.core.messages import Ended, PublishedStep, SeqResult, StepResult, TokenLogprob
from spectrio.core.record import KIND_TARGET, PREEMPTED, record_nbytes, unpack
from spectrio.stages.output.records import publish_step


def result(
    slot: int,
    tokens: list[int],
    *,
    computed: int = 10,
    context: int = 10,
    logprobs: int | None = None,
    reason: str | None = None,
) -> SeqResult:
    lps = None
    if logprobs is not None and tokens:
        lps = [
            TokenLogprob(
                token_id=t,
                logprob=-0.5 * (j + 1),
                rank=j + 1,
                top=[(100 + c, -0.1 * (c + 1)) for c in range(logprobs)],
            )
            for j, t in enumerate(tokens)
        ]
    return SeqResult(
        slot=slot,
        seq_id=slot + 1,
        request_id=f"r{slot}",
        num_drafts=2,
        num_accepted=len(tokens) - 1,
        token_ids=tokens,
        finish_reason=reason,
        logprobs=lps,
        num_logprobs=logprobs,
        num_computed=computed,
        context_len=context,
    )


def test_width_zero_record_with_prefill_preempted_and_aborted_slots() -> None:
    step = StepResult(
        step=7,
        results=[
            result(0, [5, 6, 7]),
            result(1, [], computed=32, context=50),
            result(2, [9], reason="stop"),
        ],
        ended=[Ended(0, "r9", "preempted"), Ended(0, "r8", "aborted")],
    )
    out = publish_step(step)
    rec = unpack(out.record)
    assert (rec.kind, rec.width, rec.bsz, rec.num_tokens) == (KIND_TARGET, 0, 5, 4)
    assert rec.accept_num.tolist() == [3, 0, 1, PREEMPTED, PREEMPTED]
    assert rec.token_ids.tolist() == [5, 6, 7, 9]
    assert out.request_ids == ["r0", "r1", "r2", "r9", "r8"]
    assert out.finish_reasons == [None, None, "stop", None, "abort"]
    assert len(out.record) == record_nbytes(5, 4, 0)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=PublishedStep) == out


def test_width_is_one_plus_the_widest_request_and_columns_follow_requests() -> None:
    step = StepResult(
        step=1,
        results=[result(0, [5, 6], logprobs=20), result(1, [7]), result(2, [8, 9, 10], logprobs=0)],
    )
    rec = unpack(publish_step(step).record)
    assert rec.width == 21 and rec.num_tokens == 6
    assert rec.lp_ids is not None and rec.lp_vals is not None and rec.ranks is not None
    assert rec.lp_ids[:, 0].tolist() == [5, 6, -1, 8, 9, 10]  # slot 1 asked for none
    assert rec.lp_ids[0, 1:].tolist() == list(range(100, 120))
    assert (rec.lp_ids[3:, 1:] == -1).all() and (rec.lp_vals[3:, 1:] == 0).all()
    np.testing.assert_allclose(rec.lp_vals[[0, 1, 3, 4, 5], 0], [-0.5, -1.0, -0.5, -1.0, -1.5])
    assert rec.ranks.tolist() == [1, 2, -1, 1, 2, 3]
    # logprobs=0 everywhere: a single column, the sampled token.
    rec = unpack(publish_step(StepResult(step=2, results=[result(0, [5, 6], logprobs=0)])).record)
    assert rec.width == 1 and rec.lp_ids is not None and rec.lp_ids.shape == (2, 1)


def test_empty_step() -> None:
    rec = unpack(
        publish_step(StepResult(step=3, results=[], ended=[Ended(0, "a", "preempted")])).record
    )
    assert (rec.bsz, rec.num_tokens, rec.accept_num.tolist()) == (1, 0, [PREEMPTED])
