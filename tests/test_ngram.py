"""Issue 41 item 1: n-gram (prompt-lookup) drafting, the second proposer. The matching
rule is a plain function checked against a brute-force reading of it; the token history
every proposer reads is checked on its own; end to end, n-gram runs on a checkpoint with
no MTP layer and its greedy output is the reference's (float64). The equality tests of
both proposers (greedy, seeded, overlap, preemption, TP) are parametrized by method in
their own files."""

from __future__ import annotations

import dataclasses

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace
from pipeline_helpers import collect, oracle, prompts

from spectrio import ConfigError, RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.core.messages import SeqWork, StepPlan
from spectrio.core.params import SamplingParams as Params
from spectrio.models import LoadedModel, load
from spectrio.stages.device.draft import TokenHistory
from spectrio.stages.device.draft.ngram import NgramProposer, lookup


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule as the docstring says it, one comparison at a time."""
    size = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > size - 1:
            continue
        suffix = tokens[size - n :]
        for i in range(size - n - 1, -1, -1):  # most recent earlier occurrence first
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def test_the_longest_suffix_wins_and_its_most_recent_occurrence_proposes() -> None:
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 2, 3, 8, 5, 1, 2, 3]
    # "1 2 3" occurred at 0: the 3-gram beats the more recent 2-gram "2 3" at 4
    assert lookup(tokens, 3, 1, 3) == [9, 2, 3]
    # with 2-grams at most, the most recent "2 3" (at 4) proposes what followed it
    assert lookup(tokens, 3, 1, 2) == [8, 5, 1]
    assert lookup(tokens, 1, 1, 2) == [8]  # at most k
    assert lookup([4, 5, 6, 7], 3, 1, 3) == []  # nothing repeats
    assert lookup([4, 5, 4], 3, 2, 3) == []  # only a 1-gram repeats; min_n is 2
    assert lookup([4, 5, 4], 3, 1, 3) == [5, 4]  # the continuation may run into the suffix
    assert lookup([7, 7, 7, 7], 2, 1, 4) == [7]  # "7 7 7" at 0: one token follows
    assert lookup([], 3, 1, 3) == [] and lookup([1, 1], 0, 1, 3) == []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=24),
    k=st.integers(1, 5),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
)
def test_lookup_is_the_rule(tokens: list[int], k: int, min_n: int, extra: int) -> None:
    assert lookup(tokens, k, min_n, min_n + extra) == brute_force(tokens, k, min_n, min_n + extra)


def work(seq_id: int, start: int, tokens: list[int], drafts: int = 0, **kw: object) -> SeqWork:
    fields: dict[str, object] = dict(
        slot=0,
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        block_table=[],
        start_pos=start,
        token_ids=tokens,
        sample=True,
        num_drafts=drafts,
        eos_token_ids=[],
        max_new_tokens=99,
        params=Params(),
        speculative=True,
    )
    fields.update(kw)
    return SeqWork(**fields)  # type: ignore[arg-type]


def test_the_history_fills_accepted_drafts_from_the_next_plans_start() -> None:
    h = TokenHistory()
    h.fold(StepPlan(step=1, seqs=[work(1, 0, [5, 6, 7])]))  # a prompt, sampled
    assert h.tokens(1) == [5, 6, 7]
    h.fold(StepPlan(step=2, seqs=[work(1, 3, [8], drafts=3)]))  # the first output token
    h.drafted(StepPlan(step=2, seqs=[replace(work(1, 3, [8], drafts=3), drafts=[1, 2, 3])]))
    # two drafts accepted, then a third token: the next work starts at 3 + 1 + 2
    h.fold(StepPlan(step=3, seqs=[work(1, 6, [4], drafts=3)]))
    assert h.tokens(1) == [5, 6, 7, 8, 1, 2, 4] and h.accepted(1) == 2
    with pytest.raises(RuntimeError, match="to fill the gap"):  # no drafts at step 3
        h.fold(StepPlan(step=4, seqs=[work(1, 9, [4])]))
    h.release([1])
    assert not h.holds(1)
    h.fold(StepPlan(step=5, seqs=[work(1, 0, [5, 6, 7, 8, 1])]))  # recomputed from 0
    assert h.tokens(1) == [5, 6, 7, 8, 1]
    h.fold(StepPlan(step=6, seqs=[work(2, 0, [3], speculative=False)]))
    assert not h.holds(2)  # a request that does not speculate has no history


def test_the_ngram_proposer_fills_only_draft_slots() -> None:
    h = TokenHistory()
    plan = StepPlan(
        step=1,
        seqs=[
            work(1, 0, [1, 2, 3, 1, 2], drafts=2),
            work(2, 0, [1, 2, 1, 2], slot=1),
        ],
    )
    h.fold(plan)
    proposal = NgramProposer(1, 3).propose(plan, h)
    assert proposal.drafts == {0: [3, 1]}  # slot 1 has no draft slots
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


def without_mtp(loaded: LoadedModel) -> LoadedModel:
    """The checkpoint with its MTP layer taken out, as one saved without it loads."""
    cfg = dataclasses.replace(loaded.config, num_nextn_predict_layers=0)
    loaded.model.mtp = None
    loaded.model.config = cfg
    return dataclasses.replace(loaded, config=cfg)


async def test_ngram_runs_on_a_checkpoint_with_no_mtp_layer() -> None:
    plain = without_mtp(load("bundled", dtype="float64"))
    assert not plain.config.has_mtp
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
    cfg = RuntimeConfig(dtype="float64", max_model_len=256, max_num_seqs=8, speculative=spec)
    batch = prompts(plain.tokenizer)[:8]
    with trio.fail_after(300):
        async with open_runtime(cfg, encoded_channels=True, loaded=plain) as rt:
            got = [await collect(rt, p, SamplingParams(max_tokens=24)) for p in batch]
            assert rt.num_drafts_accepted > 0
    for prompt, tokens in zip(batch, got, strict=True):
        assert tokens == oracle("float64", prompt, 24)
    mtp = dataclasses.replace(cfg, speculative=SpeculativeConfig(num_speculative_tokens=3))
    with pytest.raises(ConfigError, match="no MTP layer"), trio.fail_after(60):
        async with open_runtime(mtp, loaded=plain):
            pass
