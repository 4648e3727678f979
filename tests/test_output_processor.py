"""The output processor (pure): text with the stop-string hold-back, statistics that read
the scheduler's acceptance count, logprobs from a packed record."""

from __future__ import annotations

from dataclasses import dataclass

from spectrio.core.acceptance import Acceptance
from spectrio.core.messages import SeqResult, StepResult, TokenLogprob
from spectrio.core.record import unpack
from spectrio.models import BUNDLED_DIR, TextTokenizer
from spectrio.stages.output.output_processor import (
    RequestStats,
    RequestText,
    final_totals,
    hold_back,
    logprob_json,
    record_logprobs,
)
from spectrio.stages.output.records import publish_step

TOK = TextTokenizer.from_file(BUNDLED_DIR / "tokenizer.json")


def test_hold_back_is_the_longest_stop_string_minus_one() -> None:
    assert hold_back(()) == 0
    assert hold_back(["a"]) == 0
    assert hold_back(["ab", "wxyz"]) == 3


def test_text_without_stop_strings_is_the_decode_of_the_tokens() -> None:
    text = "def f(x):\n    return {'é': x}  # ok ✓"
    ids = TOK.encode(text)
    out = RequestText(TOK)
    pieces = [out.push([t], finished=False) for t in ids[:-1]]
    pieces.append(out.push(ids[-1:], finished=True))
    assert "".join(pieces) == TOK.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_stop_strings_hold_text_back_until_the_next_step_or_the_finish() -> None:
    ids = TOK.encode("hello world, hello")
    out = RequestText(TOK, stop=["xyz!"])  # hold 3 characters
    first = out.push(ids[:2], finished=False)
    full = TOK.decode(ids[:2])
    assert first == full[:-3]
    rest = out.push(ids[2:], finished=True)
    assert first + rest == TOK.decode(ids)


def test_text_len_cuts_the_final_text() -> None:
    ids = TOK.encode("one two three")
    out = RequestText(TOK, stop=["three"])
    a = out.push(ids[:2], finished=False)
    b = out.push(ids[2:], finished=True, text_len=len("one two "))
    assert a + b == "one two "


@dataclass
class _Out:
    token_ids: list[int]
    acceptance: Acceptance | None = None


def test_stats_take_acceptance_from_the_final_output_only() -> None:
    counted = Acceptance()
    counted.add(3, 2)
    counted.add(3, 0)
    stats = RequestStats()
    stats.add(_Out([1, 2, 3]))
    stats.add(_Out([]))  # no tokens: not a step
    stats.add(_Out([4], counted))
    assert (stats.num_steps, stats.num_tokens) == (2, 4)
    assert stats.proposed == [2, 2, 2] and stats.accepted == [1, 1, 0]
    assert stats.reached == [2, 1, 1]
    total = RequestStats()
    total.merge(stats)
    total.merge(stats)
    assert total.proposed == [4, 4, 4] and total.mean_accept_len == 2.0


def test_the_scheduler_count_survives_the_encoded_channel() -> None:
    import msgspec

    counted = Acceptance()
    counted.add(2, 1)
    r = SeqResult(slot=0, seq_id=1, request_id="r", num_drafts=2, num_accepted=1, token_ids=[5])
    r.acceptance = counted
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(r), type=SeqResult)
    assert back.acceptance == counted


def test_final_totals() -> None:
    @dataclass
    class Final:
        total_drafts: int | None
        total_accepted: int | None

    assert final_totals(Final(6, 4)) == (6, 4)
    assert final_totals(Final(None, None)) is None
    assert final_totals(object()) is None


def test_record_logprobs_read_back_what_the_sampler_gave() -> None:
    lps = [
        TokenLogprob(token_id=7, logprob=-0.5, rank=1, top=[(7, -0.5)]),
        TokenLogprob(token_id=8, logprob=-0.25, rank=2, top=[(3, -0.125)]),
    ]
    results = [
        SeqResult(
            slot=0,
            seq_id=1,
            request_id="a",
            num_drafts=1,
            num_accepted=1,
            token_ids=[7, 8],
            logprobs=lps,
            num_logprobs=1,
            num_computed=10,
            context_len=8,
        ),
        SeqResult(
            slot=1,
            seq_id=2,
            request_id="b",
            num_drafts=0,
            num_accepted=0,
            token_ids=[9],
            num_computed=5,
            context_len=4,
        ),
    ]
    published = publish_step(StepResult(step=1, results=results))
    got = record_logprobs(unpack(published.record), ["a", "b"])
    assert got == {"a": lps}
    assert logprob_json(TokenLogprob(token_id=1, logprob=-0.5, rank=2, top=[(3, -1.0)])) == {
        "token_id": 1,
        "logprob": -0.5,
        "rank": 2,
        "top": [[3, -1.0]],
    }
