"""The pure logic under the wire server's outputs (no sockets, no Trio): each
destination's :class:`~spectrio.wire.outbox.Outbox` and its bounds, the record sliced to
a destination's slots, and how a client matches replies to its calls."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spectrio.core.acceptance import Acceptance
from spectrio.core.messages import PublishedStep
from spectrio.core.record import select_slots, unpack
from spectrio.cuda_kernels.reference import pack_step_record
from spectrio.wire.codec import decode_step, encode, encode_step, slice_step
from spectrio.wire.outbox import DROP_AFTER, RECONNECT_S, Outbox
from spectrio.wire.schema import Ack, Error, ErrorCode
from spectrio.wire.stream_connection import is_step_message, new_routing_id, reply_matches

# ---- Outbox -------------------------------------------------------------------------------


def test_messages_leave_in_order_and_progress_clears_a_stall() -> None:
    box = Outbox(limit=8, stall_s=2.0)
    for i in range(3):
        box.push([bytes([i])], now=float(i))
    assert len(box) == 3 and box.waited(now=2.5) == 2.5
    assert box.stalled(now=2.0) and not box.stalled(now=1.9)
    box.stalled_at = 2.0
    sent = []
    while (head := box.head()) is not None:
        sent.append(head)
        box.sent()
    assert sent == [[b"\x00"], [b"\x01"], [b"\x02"]]
    assert box.stalled_at is None and not box.stalled(now=100.0)
    assert box.stats.sent == 3 and box.handed_over == 3 and box.stats.max_depth == 3


def test_full_is_stalled_at_once_and_never_refuses_a_message() -> None:
    box = Outbox(limit=2, stall_s=60.0)
    box.push([b"a"], now=0.0)
    assert not box.full() and not box.stalled(now=0.0)
    box.push([b"b"], now=0.0)
    assert box.full() and box.stalled(now=0.0)
    box.push([b"final"], now=0.0)  # a request's final step is still queued
    assert len(box) == 3


def test_abandoned_only_when_nothing_runs_and_it_stayed_unread() -> None:
    box = Outbox(limit=4, stall_s=1.0)
    box.push([b"a"], now=0.0)
    assert not box.abandoned(now=100.0, running=0)  # never ended: a consumer may come
    box.stalled_at = 1.0
    assert not box.abandoned(now=1.0 + DROP_AFTER, running=1)  # still running
    assert not box.abandoned(now=1.0 + DROP_AFTER - 0.01, running=0)
    assert box.abandoned(now=1.0 + DROP_AFTER, running=0)
    assert box.drop_all() == 1 and box.stats.dropped == 1 and box.handed_over == 1
    assert not box.abandoned(now=1e9, running=0)  # empty: nothing to drop
    assert box.stalled_at is None  # the next stall starts its own grace
    box.push([b"b"], now=200.0)
    box.stalled_at = 210.0
    assert not box.abandoned(now=210.0 + DROP_AFTER - 0.01, running=0)


def test_a_client_reading_again_is_not_abandoned_while_it_makes_progress() -> None:
    """The drop waits for DROP_AFTER stall periods without progress, not since the stall:
    a client that resumes reading a long queue one message at a time keeps it."""
    box = Outbox(limit=1000, stall_s=1.0)
    for i in range(500):
        box.push([b"s", bytes([i % 256])], now=0.0)
    box.stalled_at = 1.0
    now = 1.0
    while len(box) > 1:  # one message every 10 ms: 5 s to read, past 3 stall periods
        now += 0.01
        box.sent(now)
        assert not box.abandoned(now, running=0)
    assert now - box.stalled_at > DROP_AFTER * box.stall_s
    assert box.abandoned(now + DROP_AFTER * box.stall_s, running=0)  # and then it stops
    box.sent(now + 4.0)
    assert box.stalled_at is None and box.progress_at is None


def test_a_gone_destination_drops_what_comes() -> None:
    box = Outbox(limit=4, stall_s=1.0)
    box.push([b"a"], now=0.0)
    box.gone = True
    assert box.stalled(now=0.0) and box.abandoned(now=0.0, running=3)
    box.drop_all()
    box.push([b"late"], now=1.0)
    assert len(box) == 0 and box.stats.dropped == 2


def test_a_closed_connection_has_a_short_grace_to_come_back() -> None:
    box = Outbox(limit=100, stall_s=10.0)
    box.push([b"a"], now=0.0)
    box.unreachable(now=1.0)
    box.unreachable(now=2.0)  # the first failure counts
    assert not box.stalled(now=1.0 + RECONNECT_S - 0.01)
    assert box.stalled(now=1.0 + RECONNECT_S)
    box.sent()  # it came back
    box.push([b"b"], now=5.0)
    assert box.unreachable_since is None and not box.stalled(now=5.0 + RECONNECT_S)


# ---- the record sliced per destination ----------------------------------------------------


def _record(accept: list[int], logprobs: list[int] | None) -> bytes:
    bsz = len(accept)
    k = max(max(accept), 1)
    tokens = np.arange(bsz * k).reshape(bsz, k) + 100
    counts = np.array([max(a, 0) for a in accept])
    preempted = np.array([a == -9 for a in accept])
    n = int(counts.sum())
    zeros = np.zeros(bsz, dtype=np.int64)
    if logprobs is None:
        return pack_step_record(tokens, counts, preempted, zeros, zeros)
    width = max(logprobs) + 1 if max(logprobs) >= 0 else 0
    return pack_step_record(
        tokens,
        counts,
        preempted,
        zeros,
        zeros,
        logprobs=np.array(logprobs),
        topk_ids=np.arange(n * max(width, 1)).reshape(n, max(width, 1)) + 7,
        topk_vals=-np.ones((n, max(width, 1)), dtype=np.float32),
        ranks=np.arange(n) + 1,
    )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from([-9, 0, 1, 2, 3]), min_size=1, max_size=6).flatmap(
        lambda accept: st.tuples(
            st.just(accept),
            st.one_of(
                st.none(),
                st.lists(st.integers(-1, 3), min_size=len(accept), max_size=len(accept)),
            ),
            st.sets(st.integers(0, len(accept) - 1)),
        )
    )
)
def test_a_slice_holds_exactly_its_slots(
    case: tuple[list[int], list[int] | None, set[int]],
) -> None:
    accept, logprobs, keep = case
    full = unpack(_record(accept, logprobs))
    slots = sorted(keep)
    part = unpack(select_slots(_record(accept, logprobs), slots))
    assert part.bsz == len(slots) and part.kind == full.kind
    assert part.accept_num.tolist() == [accept[i] for i in slots]
    off = full.offsets
    rows = [r for i in slots for r in range(off[i], off[i + 1])]
    assert part.token_ids.tolist() == full.token_ids[rows].tolist()
    if full.width == 0 or not rows:
        assert part.width == 0
        return
    assert full.lp_ids is not None and full.lp_vals is not None and full.ranks is not None
    # The width is the widest kept row's: no column a kept request did not ask for.
    widest = int((full.lp_ids[rows] != -1).sum(axis=1).max())
    assert part.width == widest
    if widest:
        assert part.lp_ids is not None and part.lp_vals is not None and part.ranks is not None
        assert part.lp_ids.tolist() == full.lp_ids[rows, :widest].tolist()
        assert part.lp_vals.tolist() == full.lp_vals[rows, :widest].tolist()
        assert part.ranks.tolist() == full.ranks[rows].tolist()


def test_select_slots_refuses_a_slot_outside_the_record() -> None:
    with pytest.raises(ValueError, match="outside a record of 2 slots"):
        select_slots(_record([1, 1], None), [2])


def test_a_sliced_step_keeps_its_number_ids_totals_and_seqnos() -> None:
    step = PublishedStep(
        step=9,
        request_ids=["a", "b", "c"],
        finish_reasons=[None, "stop", "abort"],
        record=_record([2, 1, -9], None),
        acceptance={"b": Acceptance(4, 3), "c": Acceptance()},
        cached_tokens={"b": 16},
    )
    part = slice_step(step, [1, 2])
    assert part.step == 9 and part.request_ids == ["b", "c"]
    assert part.finish_reasons == ["stop", "abort"]
    assert part.drafts == {"b": [4, 3], "c": [0, 0]} and part.cached_tokens == {"b": 16}
    assert slice_step(step, [0, 1, 2]) is step
    error = Error(code=ErrorCode.OUTPUT_STALLED, reason="ended", request_id="c")
    env, tokens = decode_step(encode_step(part, [5, 7], [error]))
    assert env.seqnos == [5, 7] and env.errors == [error]
    assert {rid: t.tolist() for rid, t in tokens.items()} == {"b": [102]}


# ---- a client's connection ----------------------------------------------------------------


def test_replies_are_matched_to_their_call() -> None:
    submit = reply_matches("submit", "r1")
    assert submit(Ack(of="submit", request_id="r1"))
    assert not submit(Ack(of="submit", request_id="r0"))  # a late reply to an earlier call
    assert not submit(Ack(of="abort", request_id="r1"))
    assert submit(Error(code=ErrorCode.RATE_LIMITED, reason="slow down"))  # no id: ours
    assert not submit(Error(code=ErrorCode.UNKNOWN_REQUEST, reason="x", request_id="r0"))
    assert reply_matches("ping", None)(Ack(of="ping"))
    assert not reply_matches("ping", None)(Ack(of="submit", request_id="r1"))
    assert reply_matches("raw", None)(Ack(of="abort", request_id="z"))


def test_step_messages_are_told_from_replies_by_their_type() -> None:
    step = PublishedStep(
        step=1, request_ids=["a"], finish_reasons=[None], record=_record([1], None)
    )
    frames = encode_step(step, [0])
    assert is_step_message(frames)
    assert not is_step_message([encode(Ack(of="ping"))])
    assert not is_step_message([b"", encode(Ack(of="ping"))])  # a REQ-framed reply
    assert not is_step_message([b"\xc1", b"x"])  # not msgpack
    rid = new_routing_id()
    assert len(rid) == 17 and rid[0] != 0
