"""Logits processing: penalties exact at draft positions, min_tokens, temperature,
top-k, top-p, min-p, and logprob extraction."""

from __future__ import annotations

import numpy as np
import pytest

from spectrio import SamplingParams
from spectrio.stages.device.logits_processing import (
    History,
    apply_penalties,
    log_softmax,
    mask_stop_tokens,
    process_rows,
    sampling_probs,
    token_logprobs,
)

V = 12


def history(params: SamplingParams, prompt: list[int], output: list[int]) -> History:
    h = History.start(params, V, prompt)
    h.extend(output)
    return h


def test_repetition_penalty_hand_worked() -> None:
    p = SamplingParams(repetition_penalty=2.0)
    logits = np.array([[4.0, -4.0, 4.0, -4.0] + [0.0] * (V - 4)])
    # token 0 in the prompt (positive: divided), 1 in the output (negative: multiplied),
    # 2 and 3 unseen.
    out = apply_penalties(logits, p, history(p, [0], [1]), [])
    np.testing.assert_allclose(out[0, :4], [2.0, -8.0, 4.0, -4.0])


def test_frequency_and_presence_count_output_only() -> None:
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    logits = np.zeros((1, V))
    out = apply_penalties(logits, p, history(p, [3, 3, 3], [5, 5, 6]), [])
    want = np.zeros(V)
    want[5] = -0.5 * 2 - 0.25
    want[6] = -0.5 - 0.25
    np.testing.assert_allclose(out[0], want)  # token 3 (prompt only) untouched


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(frequency_penalty=0.8, presence_penalty=-0.6),
        SamplingParams(repetition_penalty=0.6, frequency_penalty=-1.1, presence_penalty=1.3),
    ],
    ids=["repetition", "frequency+presence", "all"],
)
def test_penalties_at_draft_positions_equal_one_token_at_a_time(params: SamplingParams) -> None:
    rng = np.random.default_rng(0)
    prompt, output, drafts = [1, 2, 2, 9], [4, 7, 4], [7, 11, 4, 1]
    logits = rng.normal(0, 3, size=(len(drafts) + 1, V))
    batched = apply_penalties(logits, params, history(params, prompt, output), drafts)
    for i in range(len(drafts) + 1):
        # Row i as a one-token-at-a-time decoder sees it: drafts[:i] already emitted.
        alone = apply_penalties(
            logits[i : i + 1], params, history(params, prompt, output + drafts[:i]), []
        )
        np.testing.assert_array_equal(batched[i], alone[0])
    assert not np.array_equal(batched[0], batched[-1])  # the drafts did change later rows


def test_penalties_off_returns_the_logits_as_float64() -> None:
    logits = np.arange(2 * V, dtype=np.float32).reshape(2, V)
    out = apply_penalties(logits, SamplingParams(), History(V), [3])
    assert out.dtype == np.float64 and np.array_equal(out, logits)
    as64 = logits.astype(np.float64)
    assert apply_penalties(as64, SamplingParams(), History(V), [3]) is as64
    # With penalties the input is never written to.
    before = as64.copy()
    apply_penalties(
        as64,
        SamplingParams(presence_penalty=1.0),
        history(SamplingParams(presence_penalty=1.0), [], [1]),
        [2],
    )
    assert np.array_equal(as64, before)


def test_min_tokens_masks_stop_tokens_until_reached_counting_drafts() -> None:
    raw = np.zeros((4, V))
    # 1 token emitted before the step, min_tokens=3: rows 0 and 1 score tokens 2 and 3.
    logits = mask_stop_tokens(raw, num_output=1, min_tokens=3, stop_token_ids=[0, 5])
    assert np.isneginf(logits[:2, [0, 5]]).all()
    assert np.isfinite(logits[2:]).all() and np.isfinite(logits[:2, 1:5]).all()
    assert np.isfinite(raw).all()  # a masked copy, the input untouched
    untouched = np.zeros((2, V))
    assert mask_stop_tokens(untouched, num_output=3, min_tokens=3, stop_token_ids=[0]) is untouched


def test_greedy_rows_are_penalised_logits_without_probs() -> None:
    p = SamplingParams(repetition_penalty=1.5, min_tokens=5)
    logits = np.random.default_rng(1).normal(size=(2, V))
    processed, probs = process_rows(logits, p, history(p, [1], []), [2], [0])
    assert probs is None
    assert np.isneginf(processed[:, 0]).all()
    with pytest.raises(ValueError, match="greedy"):
        sampling_probs(logits, SamplingParams())


def test_temperature_scales_before_softmax() -> None:
    logits = np.random.default_rng(2).normal(size=(3, V))
    probs = sampling_probs(logits, SamplingParams(temperature=0.5))
    want = np.exp(logits / 0.5)
    np.testing.assert_allclose(probs, want / want.sum(axis=1, keepdims=True))


def allowed_top_k(logits: np.ndarray, k: int) -> set[int]:
    return set(np.argsort(-logits)[:k].tolist())


def allowed_top_p(probs: np.ndarray, top_p: float) -> set[int]:
    order = sorted(range(len(probs)), key=lambda t: (-probs[t], t))
    kept, mass = set(), 0.0
    for t in order:
        kept.add(t)
        mass += probs[t]
        if mass >= top_p:
            break
    return kept


def test_top_k_keeps_exactly_the_k_best() -> None:
    logits = np.random.default_rng(3).normal(size=(5, V))
    probs = sampling_probs(logits, SamplingParams(temperature=1.3, top_k=3))
    for row, p in zip(logits, probs, strict=True):
        assert set(np.flatnonzero(p).tolist()) == allowed_top_k(row, 3)
        assert p.sum() == pytest.approx(1.0)


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass() -> None:
    logits = np.random.default_rng(4).normal(size=(6, V))
    for top_p in (0.05, 0.3, 0.75, 0.999):
        probs = sampling_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        full = sampling_probs(logits, SamplingParams(temperature=1.0))
        for p, f in zip(probs, full, strict=True):
            assert set(np.flatnonzero(p).tolist()) == allowed_top_p(f, top_p)
            kept = p > 0
            np.testing.assert_allclose(p[kept], f[kept] / f[kept].sum())


def test_top_p_then_top_k_and_min_p() -> None:
    logits = np.array([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0] + [-9.0] * (V - 6)])
    p = sampling_probs(logits, SamplingParams(temperature=1.0, top_k=4, top_p=0.99))
    assert set(np.flatnonzero(p[0]).tolist()) <= {0, 1, 2, 3}
    p = sampling_probs(logits, SamplingParams(temperature=1.0, min_p=0.3))
    assert set(np.flatnonzero(p[0]).tolist()) == {0, 1}  # e^-1 = 0.37 >= 0.3, e^-2 < 0.3


def test_masked_stop_tokens_get_zero_probability() -> None:
    p = SamplingParams(temperature=1.0, min_tokens=2)
    logits = np.zeros((2, V))
    _, probs = process_rows(logits, p, History(V), [3], [0])
    assert probs is not None and probs[0, 0] == 0.0 and probs[1, 0] == 0.0


def test_token_logprobs_value_rank_and_top() -> None:
    logits = np.array([[1.0, 3.0, 2.0, 3.0, 0.0], [0.0, 0.0, 5.0, 1.0, 2.0]])
    lp = log_softmax(logits)
    rows = token_logprobs(lp, [2, 2], top=3)
    np.testing.assert_allclose(rows.token_logprobs, [lp[0, 2], lp[1, 2]])
    assert rows.ranks.tolist() == [3, 1]  # two tokens tie above token 2 in row 0
    assert rows.top_ids.tolist() == [[1, 3, 2], [2, 4, 3]]  # ties broken by lower id
    np.testing.assert_allclose(rows.top_logprobs, np.take_along_axis(lp, rows.top_ids, axis=1))
    assert token_logprobs(lp, [0, 1], top=0).top_ids.shape == (2, 0)


def test_log_softmax_normalises_and_keeps_minus_inf() -> None:
    x = np.array([[0.0, -np.inf, 2.0]])
    lp = log_softmax(x)
    assert np.isneginf(lp[0, 1])
    assert np.exp(lp).sum() == pytest.approx(1.0)


def _by_value_then_id(row: np.ndarray) -> list[int]:
    return sorted(range(row.size), key=lambda i: (-row[i], i))


def test_top_alternatives_break_exact_ties_by_token_id_at_the_boundary() -> None:
    """Large rows full of exact ties (and of -inf, as top-k masking leaves them in the
    processed mode): the alternatives are the (value desc, id asc) prefix for every width,
    so a wider request in the batch never changes a narrower one's alternatives."""
    vocab = 4096
    rng = np.random.default_rng(0)
    lp = np.round(rng.normal(size=(6, vocab)), 1)  # about 80 distinct values: ties everywhere
    lp[1, rng.choice(vocab, vocab - 3, replace=False)] = -np.inf
    lp[2] = -np.inf
    lp[2, [4000, 7]] = [-0.5, -0.5]
    lp[3] = -2.0  # a flat row
    tokens = [int(np.argmax(r)) for r in lp]
    for top in (1, 2, 5, 20):
        rows = token_logprobs(lp, tokens, top)
        for r in range(lp.shape[0]):
            assert rows.top_ids[r].tolist() == _by_value_then_id(lp[r])[:top], (top, r)
    assert token_logprobs(lp, tokens, 5).top_ids[2].tolist() == [7, 4000, 0, 1, 2]
    assert token_logprobs(lp, tokens, 3).top_ids[3].tolist() == [0, 1, 2]
