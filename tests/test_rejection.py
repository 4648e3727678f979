"""Rejection sampling: greedy and random acceptance, seeding, and losslessness."""

from __future__ import annotations

import math

import numpy as np
import pytest

from spectrio.stages.rejection import rejection_sample, uniforms_per_row

V = 5


def one_hot_rows(tokens: list[int], v: int = V) -> np.ndarray:
    probs = np.full((len(tokens), v), 0.01, dtype=np.float32)
    probs[np.arange(len(tokens)), tokens] = 1.0 - 0.01 * (v - 1)
    return probs


def greedy(
    drafts: list[list[int]], argmaxes: list[list[int]], bonus: list[int]
) -> np.ndarray:
    """Run greedy rows: drafts[i] and the target argmax at each draft position."""
    flat_d = [t for row in drafts for t in row]
    flat_a = [t for row in argmaxes for t in row]
    return rejection_sample(
        np.array(flat_d, dtype=np.int32),
        np.array([len(r) for r in drafts], dtype=np.int32),
        one_hot_rows(flat_a),
        np.array(bonus, dtype=np.int32),
        np.ones(len(drafts), dtype=bool),
        None,
        [None] * len(drafts),
    )


# --------------------------------------------------------------------- greedy


def test_greedy_perfect_match_emits_bonus() -> None:
    out = greedy([[1, 2, 3]], [[1, 2, 3]], [4])
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, [[1, 2, 3, 4]])


def test_greedy_early_mismatch_emits_argmax_and_stops() -> None:
    out = greedy([[1, 2, 3]], [[0, 2, 3]], [4])
    np.testing.assert_array_equal(out, [[0, -1, -1, -1]])


def test_greedy_mid_mismatch() -> None:
    out = greedy([[1, 2, 3]], [[1, 4, 3]], [0])
    np.testing.assert_array_equal(out, [[1, 4, -1, -1]])


def test_greedy_ragged_batch_with_zero_drafts_and_several_mismatches() -> None:
    drafts = [[1, 2], [], [3, 3, 3], [0], [2, 2, 2]]
    argmx = [[1, 2], [], [3, 0, 3], [4], [2, 2, 1]]
    bonus = [4, 1, 2, 3, 0]
    out = greedy(drafts, argmx, bonus)
    np.testing.assert_array_equal(
        out,
        [
            [1, 2, 4, -1],  # all accepted + bonus
            [1, -1, -1, -1],  # no drafts: bonus only
            [3, 0, -1, -1],  # mismatch at position 1
            [4, -1, -1, -1],  # mismatch at position 0
            [2, 2, 1, -1],  # mismatch at the last position
        ],
    )


def test_all_rows_without_drafts() -> None:
    out = rejection_sample(
        np.zeros(0, dtype=np.int32),
        np.zeros(3, dtype=np.int32),
        np.zeros((0, V), dtype=np.float32),
        np.array([1, 2, 3], dtype=np.int32),
        np.array([True, False, False]),
        None,
        [None, np.random.default_rng(0), None],
    )
    np.testing.assert_array_equal(out, [[1], [2], [3]])


def test_empty_batch() -> None:
    out = rejection_sample(
        np.zeros(0, dtype=np.int32),
        np.zeros(0, dtype=np.int32),
        np.zeros((0, V), dtype=np.float32),
        np.zeros(0, dtype=np.int32),
        np.zeros(0, dtype=bool),
        None,
        [],
    )
    assert out.shape == (0, 1)


# --------------------------------------------------------------------- random


def test_random_one_hot_certain_accept_and_certain_reject() -> None:
    # Row 0: p(d) == 1 at both positions, so u < 1 always accepts -> bonus.
    # Row 1: p(d) == 0 at position 0 -> always rejected; the residual is p
    # with p(d) zeroed, which is all on token 4.
    p = np.zeros((3, V), dtype=np.float32)
    p[0, 2] = 1.0
    p[1, 3] = 1.0
    p[2, 4] = 1.0
    out = rejection_sample(
        np.array([2, 3, 1], dtype=np.int32),
        np.array([2, 1], dtype=np.int32),
        p,
        np.array([0, 0], dtype=np.int32),
        np.array([False, False]),
        None,
        [None, None],
        shared_generator=np.random.default_rng(1),
    )
    np.testing.assert_array_equal(out, [[2, 3, 0], [4, -1, -1]])


def test_random_zero_draft_prob_is_a_rejection() -> None:
    p = np.full((1, V), 0.2, dtype=np.float32)
    q = np.zeros((1, V), dtype=np.float32)
    q[0, 0] = 1.0  # the draft token 2 has q == 0
    out = rejection_sample(
        np.array([2], dtype=np.int32),
        np.array([1], dtype=np.int32),
        p,
        np.array([3], dtype=np.int32),
        np.array([False]),
        q,
        [np.random.default_rng(5)],
    )
    # Residual max(p - q, 0) is 0.2 on tokens 1..4, zero on token 0.
    assert out[0, 0] in (1, 2, 3, 4)
    assert out[0, 1] == -1


def test_residual_without_mass_falls_back_to_target() -> None:
    # p == q, and the draft has q == 0 so it is rejected: residual is all zero.
    p = np.array([[0.0, 0.5, 0.5, 0.0, 0.0]], dtype=np.float32)
    for seed in range(20):
        out = rejection_sample(
            np.array([0], dtype=np.int32),
            np.array([1], dtype=np.int32),
            p,
            np.array([3], dtype=np.int32),
            np.array([False]),
            p.copy(),
            [np.random.default_rng(seed)],
        )
        assert out[0, 0] in (1, 2)


def test_mixed_greedy_and_random_rows() -> None:
    # Row 0 (greedy) matches both argmaxes. Row 1 (random, one-hot drafts):
    # p(3) == 1 accepts draft 3 for any u; p(4) == 0 rejects draft 4, and the
    # residual (p with p(4) zeroed) is all on token 0.
    p = one_hot_rows([1, 2, 0, 0])
    p[2:] = 0.0
    p[2, 3] = 1.0
    p[3, 0] = 1.0
    out = rejection_sample(
        np.array([1, 2, 3, 4], dtype=np.int32),
        np.array([2, 2], dtype=np.int32),
        p,
        np.array([4, 1], dtype=np.int32),
        np.array([True, False]),
        None,
        [None, np.random.default_rng(3)],
    )
    np.testing.assert_array_equal(out, [[1, 2, 4], [3, 0, -1]])


def test_validation_errors() -> None:
    with pytest.raises(ValueError, match="sums to"):
        rejection_sample(
            np.array([1], dtype=np.int32),
            np.array([2], dtype=np.int32),
            np.zeros((1, V), dtype=np.float32),
            np.array([0], dtype=np.int32),
            np.array([True]),
            None,
            [None],
        )
    with pytest.raises(ValueError, match="generators"):
        rejection_sample(
            np.array([1], dtype=np.int32),
            np.array([1], dtype=np.int32),
            np.zeros((1, V), dtype=np.float32),
            np.array([0], dtype=np.int32),
            np.array([True]),
            None,
            [],
        )


# ---------------------------------------------------------------- determinism


def _random_batch(seed: int, b: int = 6, k: int = 4) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    n = rng.integers(1, k + 1, size=b).astype(np.int32)
    n[1] = 0  # one row without drafts
    t = int(n.sum())
    p = rng.dirichlet(np.full(V, 0.5), size=t).astype(np.float32)
    q = rng.dirichlet(np.full(V, 0.5), size=t).astype(np.float32)
    d = np.array([rng.choice(V, p=row / row.sum()) for row in q], dtype=np.int32)
    bonus = rng.integers(0, V, size=b).astype(np.int32)
    return d, n, p, bonus, q


def test_seeded_rows_are_reproducible_regardless_of_neighbours() -> None:
    d, n, p, bonus, q = _random_batch(11)
    b = n.size
    greedy_mask = np.zeros(b, dtype=bool)
    greedy_mask[-1] = True

    def run(shared_seed: int, steps: int) -> list[np.ndarray]:
        gens: list[np.random.Generator | None] = [
            np.random.default_rng(100 + i) if i % 2 == 0 else None for i in range(b)
        ]
        shared = np.random.default_rng(shared_seed)
        return [
            rejection_sample(d, n, p, bonus, greedy_mask, q, gens, shared_generator=shared)
            for _ in range(steps)
        ]

    a = run(0, 5)
    c = run(999, 5)
    seeded = np.arange(b) % 2 == 0
    for x, y in zip(a, c, strict=True):
        np.testing.assert_array_equal(x[seeded], y[seeded])
    # The steps differ from each other (generators advance), so the check is not vacuous.
    assert any(not np.array_equal(a[0], z) for z in a[1:])
    # Same shared seed: whole batch reproducible.
    for x, y in zip(a, run(0, 5), strict=True):
        np.testing.assert_array_equal(x, y)


def test_uniform_consumption_contract() -> None:
    n = np.array([0, 2, 3, 0, 1], dtype=np.int32)
    g = np.array([False, False, True, False, False])
    np.testing.assert_array_equal(uniforms_per_row(n, g), [0, 3, 0, 0, 2])
    # A seeded row with no drafts does not touch its generator.
    gen = np.random.default_rng(7)
    before = gen.bit_generator.state
    rejection_sample(
        np.zeros(0, dtype=np.int32),
        np.zeros(1, dtype=np.int32),
        np.zeros((0, V), dtype=np.float32),
        np.array([1], dtype=np.int32),
        np.array([False]),
        None,
        [gen],
    )
    assert gen.bit_generator.state == before
    # A seeded row with 2 drafts consumes exactly 3 uniforms.
    gen = np.random.default_rng(7)
    ref = np.random.default_rng(7)
    rejection_sample(
        np.array([0, 1], dtype=np.int32),
        np.array([2], dtype=np.int32),
        np.full((2, V), 0.2, dtype=np.float32),
        np.array([1], dtype=np.int32),
        np.array([False]),
        None,
        [gen],
    )
    ref.random(3)
    assert gen.random() == ref.random()


# ------------------------------------------------------- distribution equality


def chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution (closed forms)."""
    h = x / 2.0
    if df % 2 == 0:
        term, total = 1.0, 1.0
        for i in range(1, df // 2):
            term *= h / i
            total += term
        return math.exp(-h) * total
    total = math.erfc(math.sqrt(h))
    term = math.sqrt(h) / math.gamma(1.5)
    for i in range(1, (df + 1) // 2):
        total += math.exp(-h) * term
        term *= h / (i + 0.5)
    return total


def test_chi2_sf_known_values() -> None:
    # Critical values at alpha = 0.05.
    assert chi2_sf(3.841459, 1) == pytest.approx(0.05, abs=1e-6)
    assert chi2_sf(5.991465, 2) == pytest.approx(0.05, abs=1e-6)
    assert chi2_sf(7.814728, 3) == pytest.approx(0.05, abs=1e-6)
    assert chi2_sf(9.487729, 4) == pytest.approx(0.05, abs=1e-6)


def _sample_categorical(rng: np.random.Generator, probs: np.ndarray, n: int) -> np.ndarray:
    cdf = np.cumsum(probs.astype(np.float64))
    return np.minimum(np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right"), V - 1)


P_TARGET = [
    np.array([0.4, 0.3, 0.15, 0.1, 0.05]),
    np.array([0.05, 0.05, 0.1, 0.3, 0.5]),
    np.array([0.0, 0.6, 0.2, 0.2, 0.0]),
]
Q_DRAFT = [
    np.array([0.1, 0.1, 0.2, 0.3, 0.3]),
    np.array([0.5, 0.2, 0.1, 0.1, 0.1]),
    np.array([0.25, 0.25, 0.25, 0.0, 0.25]),
]
PAIRS = [
    # (id, target p, draft q or None, one-hot draft token for None)
    ("dense-q-0", P_TARGET[0], Q_DRAFT[0], None),
    ("dense-q-1", P_TARGET[1], Q_DRAFT[1], None),
    ("dense-q-zeros", P_TARGET[2], Q_DRAFT[2], None),
    ("one-hot-likely", P_TARGET[0], None, 0),
    ("one-hot-unlikely", P_TARGET[1], None, 0),
    ("one-hot-impossible", P_TARGET[2], None, 4),
]


def _first_tokens(
    p: np.ndarray, q: np.ndarray | None, onehot: int | None, n: int, k: int, seed: int
) -> np.ndarray:
    """Emitted tokens for n independent requests with k drafts each, at a
    position-independent target p. Returns the [n, k+1] output."""
    rng = np.random.default_rng(seed)
    t = n * k
    if q is None:
        assert onehot is not None
        drafts = np.full(t, onehot, dtype=np.int32)
        draft_probs = None
    else:
        drafts = _sample_categorical(rng, q, t).astype(np.int32)
        draft_probs = np.broadcast_to(q.astype(np.float32), (t, V))
    target = np.broadcast_to(p.astype(np.float32), (t, V))
    bonus = _sample_categorical(rng, p, n).astype(np.int32)
    return rejection_sample(
        drafts,
        np.full(n, k, dtype=np.int32),
        target,
        bonus,
        np.zeros(n, dtype=bool),
        draft_probs,
        [None] * n,
        shared_generator=rng,
    )


def _tv_and_pvalue(tokens: np.ndarray, p: np.ndarray) -> tuple[float, float]:
    counts = np.bincount(tokens, minlength=V).astype(np.float64)
    n = counts.sum()
    # Tokens with zero target probability must never be emitted.
    assert counts[p == 0].sum() == 0
    tv = 0.5 * float(np.abs(counts / n - p).sum())
    support = p > 0
    expected = n * p[support]
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    return tv, chi2_sf(chi2, int(support.sum()) - 1)


@pytest.mark.parametrize(("name", "p", "q", "onehot"), PAIRS, ids=[x[0] for x in PAIRS])
def test_first_token_distribution_converges_to_target(
    name: str, p: np.ndarray, q: np.ndarray | None, onehot: int | None
) -> None:
    drafted = q if q is not None else np.eye(V)[onehot]
    # The draft distribution differs from the target: accepting blindly would fail.
    assert 0.5 * np.abs(drafted - p).sum() > 0.1

    tvs = []
    for i, n in enumerate((2_000, 20_000, 200_000)):
        out = _first_tokens(p, q, onehot, n, k=1, seed=1000 + i)
        tv, pval = _tv_and_pvalue(out[:, 0], p)
        tvs.append(tv)
        # Sampling noise of the TV distance shrinks like sqrt(V / n).
        assert tv < 2.0 * math.sqrt(V / n), (name, n, tv)
        assert pval > 1e-4, (name, n, pval)
    assert tvs[-1] < 0.01
    assert tvs[-1] < tvs[0]


@pytest.mark.parametrize(("name", "p", "q", "onehot"), PAIRS[:4], ids=[x[0] for x in PAIRS[:4]])
def test_every_emitted_position_follows_target(
    name: str, p: np.ndarray, q: np.ndarray | None, onehot: int | None
) -> None:
    # With a position-independent target, the token emitted at every position
    # (accepted draft, residual sample or bonus) is distributed as p.
    out = _first_tokens(p, q, onehot, 100_000, k=2, seed=77)
    for j in range(3):
        col = out[:, j]
        emitted = col[col >= 0]
        if emitted.size < 5_000:
            continue
        tv, pval = _tv_and_pvalue(emitted, p)
        assert tv < 3.0 * math.sqrt(V / emitted.size), (name, j, tv)
        assert pval > 1e-4, (name, j, pval)
