"""The sampler's pure logic on synthetic logits: greedy exactness, seeding, stops,
logprobs trimmed with tokens, top-k/top-p membership, penalties at draft positions."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import pytest

from spectrio import SamplingParams
from spectrio.core.messages import SeqWork, StepPlan
from spectrio.models import load
from spectrio.stages.device.logits_processing import log_softmax, sampling_probs
from spectrio.stages.device.sampler import Sampler

V = 32
EOS = 0


def work(
    slot: int,
    drafts: Sequence[int],
    params: SamplingParams,
    *,
    seq_id: int | None = None,
    num_output: int = 0,
    eos: Sequence[int] = (EOS,),
    max_new: int = 100,
    sample: bool = True,
    prompt: Sequence[int] = (),
) -> SeqWork:
    seq_id = slot + 1 if seq_id is None else seq_id
    return SeqWork(
        slot=slot,
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        block_table=[],
        start_pos=9 + num_output,
        token_ids=[5],
        sample=sample,
        num_drafts=len(drafts),
        eos_token_ids=list(eos),
        max_new_tokens=max_new,
        params=params,
        num_output=num_output,
        context_len=10 + num_output,
        prompt_ids=list(prompt),
        drafts=list(drafts),
    )


def peaked(tokens: Sequence[int], rng: np.random.Generator | None = None) -> np.ndarray:
    """Rows whose argmax is ``tokens[i]`` by a clear margin, noise elsewhere."""
    rng = rng or np.random.default_rng(0)
    rows = rng.normal(0, 0.5, size=(len(tokens), V))
    rows[np.arange(len(tokens)), tokens] = 6.0
    return rows


def step(
    sampler: Sampler,
    works: list[SeqWork],
    logits: list[np.ndarray],
    step_no: int = 1,
    **plan: object,
) -> list[tuple[list[int], str | None]]:
    result = sampler.step(
        StepPlan(step=step_no, seqs=works, **plan),  # type: ignore[arg-type]
        {w.slot: lg for w, lg in zip(works, logits, strict=True)},
    )
    return [(r.token_ids, r.finish_reason) for r in result.results]


GREEDY = SamplingParams()


def test_greedy_accepts_matching_drafts_then_the_argmax_or_bonus() -> None:
    s = Sampler(V)
    works = [work(0, [10, 11, 12], GREEDY), work(1, [10, 11, 12], GREEDY), work(2, [], GREEDY)]
    got = step(s, works, [peaked([10, 11, 12, 13]), peaked([10, 14, 12, 13]), peaked([7])])
    assert got == [([10, 11, 12, 13], None), ([10, 14], None), ([7], None)]


def test_stop_beats_length_inside_an_accepted_run() -> None:
    s = Sampler(V)
    w = work(0, [10, 11, 30, 20], GREEDY, eos=[EOS, 30], max_new=5)
    result = s.step(StepPlan(step=1, seqs=[w]), {0: peaked([10, 11, 30, 20, 21])})
    r = result.results[0]
    assert (r.token_ids, r.finish_reason, r.num_accepted) == ([10, 11, 30], "stop", 4)
    assert s.num_states == 0  # finished: its state is gone


def test_eos_mid_run_unless_ignored() -> None:
    rows = peaked([10, EOS, 12, 13])
    assert step(Sampler(V), [work(0, [10, EOS, 12], GREEDY)], [rows]) == [([10, EOS], "stop")]
    ignore = SamplingParams(ignore_eos=True)  # the runtime leaves EOS out of eos_token_ids
    assert step(Sampler(V), [work(0, [10, EOS, 12], ignore, eos=[])], [rows]) == [
        ([10, EOS, 12, 13], None)
    ]


def test_length_limit_inside_a_run() -> None:
    assert step(
        Sampler(V), [work(0, [10, 11, 12], GREEDY, max_new=2)], [peaked([10, 11, 12, 13])]
    ) == [([10, 11], "length")]


def test_greedy_is_the_argmax_of_penalised_logits_at_every_draft_position() -> None:
    p = SamplingParams(repetition_penalty=2.0)
    rows = np.zeros((3, V))
    rows[0, 7] = 4.0  # row 0 picks 7, the first draft
    rows[1, 7], rows[1, 8] = 3.0, 2.5  # unpenalised argmax 7; after d1=7 it is 3.0/2 < 2.5
    rows[2, 9] = 1.0
    assert step(Sampler(V), [work(0, [7, 7], p)], [rows]) == [([7, 8], None)]
    assert step(Sampler(V), [work(0, [7, 7], GREEDY)], [rows]) == [([7, 7, 9], None)]


def test_repetition_penalty_sees_the_prompt() -> None:
    p = SamplingParams(repetition_penalty=4.0)
    rows = np.zeros((1, V))
    rows[0, 3], rows[0, 4] = 2.0, 1.0
    assert step(Sampler(V), [work(0, [], p, prompt=[3])], [rows]) == [([4], None)]


def test_min_tokens_masks_eos_counting_drafts() -> None:
    p = SamplingParams(min_tokens=2)
    rows = peaked([EOS, EOS, EOS])
    rows[:, 9] = 5.0  # the runner-up
    # Row 0 scores token 1 and row 1 token 2 (masked); row 2 scores token 3 (EOS allowed).
    assert step(Sampler(V), [work(0, [9, 9], p)], [rows]) == [([9, 9, EOS], "stop")]


def random_rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1.0, size=(n, V))


def run_steps(sampler: Sampler, params: SamplingParams, steps: int = 6) -> list[int]:
    """Feed a fixed sequence of logits and drafts to one request; return its tokens."""
    out: list[int] = []
    for i in range(steps):
        drafts = np.random.default_rng(100 + i).integers(0, V, size=2).tolist()
        w = work(0, drafts, params, seq_id=1, num_output=len(out))
        ((tokens, _),) = step(sampler, [w], [random_rows(3, i)], step_no=i + 1)
        out += tokens
    return out


def test_seeded_requests_reproduce_and_seeds_differ() -> None:
    p = SamplingParams(temperature=1.0, seed=1234)
    a = run_steps(Sampler(V), p)
    assert a == run_steps(Sampler(V, seed=999), p)  # the shared generator does not matter
    assert a != run_steps(Sampler(V), SamplingParams(temperature=1.0, seed=4321))
    # The generator lives across steps: two steps with identical inputs draw differently.
    s = Sampler(V)
    w = [work(0, [], p, seq_id=1)]
    first = step(s, w, [random_rows(1, 0)])[0][0]
    outs = [first] + [
        step(s, [work(0, [], p, seq_id=1, num_output=i)], [random_rows(1, 0)])[0][0]
        for i in range(1, 12)
    ]
    assert len({tuple(o) for o in outs}) > 1


def test_unseeded_requests_follow_the_shared_generator() -> None:
    p = SamplingParams(temperature=1.0)
    assert run_steps(Sampler(V, seed=5), p) == run_steps(Sampler(V, seed=5), p)


def test_a_neighbour_does_not_change_a_seeded_request() -> None:
    p = SamplingParams(temperature=0.9, seed=77)
    alone = step(Sampler(V), [work(0, [3, 4], p, seq_id=1)], [random_rows(3, 1)])[0]
    other = SamplingParams(temperature=1.0)
    both = step(
        Sampler(V),
        [work(0, [1, 2], other, seq_id=2), work(1, [3, 4], p, seq_id=1)],
        [random_rows(3, 2), random_rows(3, 1)],
    )[1]
    assert alone == both


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.5, top_k=3),
        SamplingParams(temperature=1.5, top_p=0.4),
        SamplingParams(temperature=1.5, top_k=5, top_p=0.6, min_p=0.2),
    ],
    ids=["top_k", "top_p", "all"],
)
def test_every_emitted_token_lies_in_the_allowed_set(params: SamplingParams) -> None:
    s = Sampler(V, seed=0)
    rng = np.random.default_rng(1)
    for i in range(200):
        rows = random_rows(4, i)
        drafts = rng.integers(0, V, size=3).tolist()
        # Half the time propose the row's best tokens, so runs get accepted.
        if i % 2:
            drafts = np.argmax(rows[:3], axis=1).tolist()
        r = s.step(
            StepPlan(step=i, seqs=[work(0, drafts, params, seq_id=i + 1)]), {0: rows}
        ).results[0]
        allowed = sampling_probs(rows, params) > 0
        for j, t in enumerate(r.token_ids):
            assert allowed[j, t], (i, j, t)


def test_first_token_follows_the_processed_target() -> None:
    params = SamplingParams(temperature=0.8, top_k=6)
    rows = random_rows(3, 7)
    want = sampling_probs(rows, params)[0]
    drafts = [int(np.argsort(-want)[1]), 3]  # a plausible but not best draft
    s = Sampler(V, seed=3)
    n = 6000
    counts = np.zeros(V)
    for i in range(n):
        r = s.step(
            StepPlan(step=i, seqs=[work(0, drafts, params, seq_id=i + 1)]), {0: rows}
        ).results[0]
        counts[r.token_ids[0]] += 1
    assert np.abs(counts / n - want).max() < 0.03


def test_logprobs_are_trimmed_with_tokens_raw_and_processed() -> None:
    rows = peaked([10, 11, EOS, 20, 21])
    p = SamplingParams(logprobs=2)
    r = (
        Sampler(V)
        .step(StepPlan(step=1, seqs=[work(0, [10, 11, EOS, 20], p)]), {0: rows})
        .results[0]
    )
    assert r.token_ids == [10, 11, EOS] and r.logprobs is not None and len(r.logprobs) == 3
    lp = log_softmax(rows)
    for j, entry in enumerate(r.logprobs):
        assert entry.token_id == r.token_ids[j] and entry.rank == 1
        assert entry.logprob == pytest.approx(lp[j, entry.token_id])
        assert [t for t, _ in entry.top] == np.argsort(-lp[j])[:2].tolist()
    # processed mode, random request: the log of the distribution drawn from (-inf off top-k).
    p = SamplingParams(temperature=0.7, top_k=2, seed=1, logprobs=4, logprobs_mode="processed")
    rows = random_rows(1, 3)
    r = Sampler(V).step(StepPlan(step=1, seqs=[work(0, [], p)]), {0: rows}).results[0]
    assert r.logprobs is not None
    (entry,) = r.logprobs
    probs = sampling_probs(rows, p)[0]
    assert entry.logprob == pytest.approx(np.log(probs[entry.token_id]))
    assert [v for _, v in entry.top][2:] == [-np.inf, -np.inf]
    assert r.num_logprobs == 4
    # No logprobs asked: none computed.
    assert (
        Sampler(V).step(StepPlan(step=1, seqs=[work(0, [], GREEDY)]), {0: rows}).results[0].logprobs
        is None
    )


def test_stop_string_in_the_sampler_sets_the_text_cut() -> None:
    tok = load("bundled").tokenizer
    assert tok is not None
    ids = tok.encode("x = 1\ny = 2\n")
    vocab = tok.vocab_size
    rows = np.zeros((len(ids), vocab))
    rows[np.arange(len(ids)), ids] = 5.0
    s = Sampler(vocab, tok)
    w = work(0, ids[:-1], SamplingParams(stop=["1\ny"]), eos=[])
    r = s.step(StepPlan(step=1, seqs=[w]), {0: rows}).results[0]
    assert r.finish_reason == "stop" and r.text_len == len("x = ")
    assert tok.decode(r.token_ids).startswith("x = 1\ny") and r.token_ids == ids[: len(r.token_ids)]
    assert len(r.token_ids) < len(ids)


def test_state_lifecycle() -> None:
    s = Sampler(V)
    p = SamplingParams(temperature=1.0, seed=1)
    step(
        s,
        [work(0, [], p, seq_id=1), work(1, [], p, seq_id=2, sample=False)],
        [random_rows(1, 0), random_rows(1, 0)],
    )
    assert s.num_states == 1  # the prefill slot has no state yet
    with pytest.raises(RuntimeError, match="scheduler reports"):
        step(s, [work(0, [], p, seq_id=1, num_output=5)], [random_rows(1, 0)])
    step(s, [work(0, [], p, seq_id=3)], [random_rows(1, 0)], retired=[1])
    assert s.num_states == 1  # seq 1 retired (aborted), seq 3 new
    with pytest.raises(RuntimeError, match="no sampler state"):
        step(s, [work(0, [], p, seq_id=9, num_output=2)], [random_rows(1, 0)])


def test_prefill_slots_emit_nothing_and_report_progress() -> None:
    w = work(0, [], SamplingParams(logprobs=3), sample=False)
    r = Sampler(V).step(StepPlan(step=1, seqs=[w]), {}).results[0]
    assert (r.token_ids, r.num_computed, r.context_len, r.num_logprobs) == ([], 10, 10, 3)


def test_logprobs_of_a_request_do_not_depend_on_its_neighbours() -> None:
    """Exact ties at the top-N boundary and -inf alternatives (processed mode, top-k):
    a request's logprobs are the same alone and beside requests asking for other widths."""
    vocab = 4096
    rng = np.random.default_rng(3)
    tied = np.round(rng.normal(size=(3, vocab)), 1)  # exact ties everywhere
    greedy = SamplingParams(logprobs=3)
    masked = SamplingParams(temperature=1.0, top_k=2, seed=9, logprobs=5, logprobs_mode="processed")
    wide = SamplingParams(logprobs=20)
    subjects = [
        (work(0, [], greedy, seq_id=1), tied[:1]),
        (work(0, [], masked, seq_id=2), tied[1:2]),
    ]

    def logprobs_of(batch: list[tuple[SeqWork, np.ndarray]], seq_id: int) -> object:
        works = [msgspec.structs.replace(w, slot=i) for i, (w, _) in enumerate(batch)]
        result = Sampler(vocab).step(
            StepPlan(step=1, seqs=works), {i: lg for i, (_, lg) in enumerate(batch)}
        )
        (r,) = [r for r in result.results if r.seq_id == seq_id]
        return r.logprobs

    neighbours = [(work(0, [], wide, seq_id=3), tied[2:3]), (work(0, [], wide, seq_id=4), tied[:1])]
    for w, logits in subjects:
        alone = logprobs_of([(w, logits)], w.seq_id)
        assert alone == logprobs_of([*neighbours, (w, logits)], w.seq_id)
        assert alone == logprobs_of([(w, logits), *neighbours[::-1]], w.seq_id)
        (entry,) = alone  # type: ignore[misc]
        # Best first, ties by lower id.
        assert all(
            (a, -i) > (b, -j) for (i, a), (j, b) in zip(entry.top, entry.top[1:], strict=False)
        )
        assert len(entry.top) == w.params.logprobs
    (entry,) = logprobs_of([subjects[1]], 2)  # type: ignore[misc]
    assert [v for _, v in entry.top][2:] == [-np.inf] * 3
    assert [t for t, _ in entry.top][2:] == sorted(t for t, _ in entry.top[2:])
