"""Rejection sampling: greedy and random acceptance, keyed randomness, and losslessness."""

from __future__ import annotations

import math

import numpy as np
import pytest

from spectrio.stages.device.rejection import (
    Purpose,
    keyed_sample,
    keyed_uniforms,
    rejection_sample,
)

V = 5


def zeros(b: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys and positions for ``b`` rows (key 0, position 0)."""
    return np.zeros(b, dtype=np.uint64), np.zeros(b, dtype=np.int64)


def one_hot_rows(tokens: list[int], v: int = V) -> np.ndarray:
    probs = np.full((len(tokens), v), 0.01, dtype=np.float32)
    probs[np.arange(len(tokens)), tokens] = 1.0 - 0.01 * (v - 1)
    return probs


def point_masses(tokens: list[int], v: int = V) -> np.ndarray:
    probs = np.zeros((len(tokens), v))
    probs[np.arange(len(tokens)), tokens] = 1.0
    return probs


def greedy(drafts: list[list[int]], argmaxes: list[list[int]], bonus: list[int]) -> np.ndarray:
    """Run greedy rows: drafts[i], the target argmax at each draft position, and at the
    bonus position."""
    flat_d = [t for row in drafts for t in row]
    rows = [t for row, b in zip(argmaxes, bonus, strict=True) for t in [*row, b]]
    return rejection_sample(
        np.array(flat_d, dtype=np.int32),
        np.array([len(r) for r in drafts], dtype=np.int32),
        one_hot_rows(rows),
        np.ones(len(drafts), dtype=bool),
        None,
        *zeros(len(drafts)),
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


def test_greedy_rows_take_logits() -> None:
    logits = np.array([[0.0, -np.inf, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0, 0.0]])
    out = rejection_sample(np.array([2]), np.array([1]), logits, np.array([True]), None, *zeros(1))
    np.testing.assert_array_equal(out, [[2, 0]])


def test_all_rows_without_drafts() -> None:
    out = rejection_sample(
        np.zeros(0, dtype=np.int32),
        np.zeros(3, dtype=np.int32),
        point_masses([1, 2, 3]),
        np.array([True, False, False]),
        None,
        np.array([0, 7, 9], dtype=np.uint64),
        np.array([0, 3, 0]),
    )
    np.testing.assert_array_equal(out, [[1], [2], [3]])


def test_empty_batch() -> None:
    out = rejection_sample(
        np.zeros(0, dtype=np.int32),
        np.zeros(0, dtype=np.int32),
        np.zeros((0, V), dtype=np.float32),
        np.zeros(0, dtype=bool),
        None,
        *zeros(0),
    )
    assert out.shape == (0, 1)


# --------------------------------------------------------------------- random


def test_random_one_hot_certain_accept_and_certain_reject() -> None:
    # Row 0: p(d) == 1 at both positions, so the draws match them -> bonus (token 0).
    # Row 1: p(d) == 0 at position 0 -> always rejected; the token drawn there is p's
    # only token with mass, 4.
    p = point_masses([2, 3, 0, 4, 1])
    out = rejection_sample(
        np.array([2, 3, 1], dtype=np.int32),
        np.array([2, 1], dtype=np.int32),
        p,
        np.array([False, False]),
        None,
        np.array([1, 2], dtype=np.uint64),
        np.array([0, 5]),
    )
    np.testing.assert_array_equal(out, [[2, 3, 0], [4, -1, -1]])


def test_random_zero_draft_prob_is_a_rejection() -> None:
    p = np.full((2, V), 0.2, dtype=np.float32)
    q = np.zeros((1, V), dtype=np.float32)
    q[0, 0] = 1.0  # the draft token 2 has q == 0
    for key in range(20):
        out = rejection_sample(
            np.array([2], dtype=np.int32),
            np.array([1], dtype=np.int32),
            p,
            np.array([False]),
            q,
            np.array([key], dtype=np.uint64),
            np.array([0]),
        )
        # Residual max(p - q, 0) is 0.2 on tokens 1..4, zero on token 0.
        assert out[0, 0] in (1, 2, 3, 4)
        assert out[0, 1] == -1


def test_residual_without_mass_falls_back_to_target() -> None:
    # p == q, and the draft has q == 0 so it is rejected: residual is all zero.
    p = np.array([[0.0, 0.5, 0.5, 0.0, 0.0]] * 2, dtype=np.float32)
    for key in range(20):
        out = rejection_sample(
            np.array([0], dtype=np.int32),
            np.array([1], dtype=np.int32),
            p,
            np.array([False]),
            p[:1].copy(),
            np.array([key], dtype=np.uint64),
            np.array([0]),
        )
        assert out[0, 0] in (1, 2)


def test_mixed_greedy_and_random_rows() -> None:
    # Row 0 (greedy) matches both argmaxes, then the bonus argmax 4. Row 1 (random,
    # one-hot drafts): p(3) == 1 accepts draft 3; p(4) == 0 rejects draft 4, and the
    # token drawn there is p's only one, 0.
    p = np.concatenate([one_hot_rows([1, 2, 4]), point_masses([3, 0, 1])])
    out = rejection_sample(
        np.array([1, 2, 3, 4], dtype=np.int32),
        np.array([2, 2], dtype=np.int32),
        p,
        np.array([True, False]),
        None,
        np.array([0, 3], dtype=np.uint64),
        np.array([0, 0]),
    )
    np.testing.assert_array_equal(out, [[1, 2, 4], [3, 0, -1]])


def test_validation_errors() -> None:
    def call(**kw: object) -> None:
        args: dict[str, object] = {
            "draft_token_ids": np.array([1]),
            "num_draft_tokens": np.array([1]),
            "target_probs": np.zeros((2, V)),
            "is_greedy": np.array([True]),
            "draft_probs": None,
            "keys": np.zeros(1, dtype=np.uint64),
            "positions": np.zeros(1, dtype=np.int64),
        }
        args.update(kw)
        rejection_sample(**args)  # type: ignore[arg-type]

    call()
    with pytest.raises(ValueError, match="sums to"):
        call(num_draft_tokens=np.array([2]))
    with pytest.raises(ValueError, match="bonus row"):
        call(target_probs=np.zeros((1, V)))
    with pytest.raises(ValueError, match="keys"):
        call(keys=np.zeros(0, dtype=np.uint64))
    with pytest.raises(ValueError, match="positions"):
        call(positions=np.array([-1]))
    with pytest.raises(ValueError, match="draft_probs"):
        call(draft_probs=np.zeros((2, V)))


# ---------------------------------------------------------------- determinism


def test_keyed_uniforms_are_numpys_philox_keyed_by_request_and_purpose() -> None:
    keys = np.array([2**64 - 1, 12345, 12345, 0], dtype=np.uint64)
    starts = np.array([0, 7, 100, 2**40])
    counts = np.array([3, 2, 0, 1])
    draws = {}
    for purpose in Purpose:
        got = keyed_uniforms(keys, starts, counts, purpose)
        want = [
            np.random.Generator(
                np.random.Philox(key=int(key) + (int(purpose) << 64), counter=int(s) + j)
            ).random()
            for key, s, c in zip(keys, starts, counts, strict=True)
            for j in range(c)
        ]
        assert got.tolist() == want
        draws[purpose] = want
    assert len({tuple(d) for d in draws.values()}) == len(Purpose)  # independent streams


def test_a_uniform_depends_on_key_position_and_purpose_only() -> None:
    """However rows group into calls (alone, beside other rows of the same key, with
    gaps, far apart), every (key, position) gets the same uniform."""

    def single(key: int, pos: int) -> float:
        one = keyed_uniforms(
            np.array([key], dtype=np.uint64), np.array([pos]), np.array([1]), Purpose.ACCEPT
        )
        return float(one[0])

    keys = np.array([3, 4, 3, 3, 4, 3], dtype=np.uint64)
    starts = np.array([10, 10, 0, 390, 200, 10**9])
    counts = np.array([5, 3, 2, 10, 1, 2])
    got = keyed_uniforms(keys, starts, counts, Purpose.ACCEPT)
    want = [
        single(int(k), int(s) + j)
        for k, s, c in zip(keys, starts, counts, strict=True)
        for j in range(c)
    ]
    assert got.tolist() == want
    near = keyed_uniforms(keys[:5], starts[:5], counts[:5], Purpose.ACCEPT)
    assert near.tolist() == want[: int(counts[:5].sum())]


def _random_batch(seed: int, b: int = 6, k: int = 4) -> tuple[np.ndarray, ...]:
    """drafts [T], counts [B], target rows [T + B] (bonus rows included), draft probs [T]."""
    rng = np.random.default_rng(seed)
    n = rng.integers(1, k + 1, size=b).astype(np.int32)
    n[1] = 0  # one row without drafts
    t = int(n.sum())
    p = rng.dirichlet(np.full(V, 0.5), size=t + b)
    q = rng.dirichlet(np.full(V, 0.5), size=t)
    d = np.array([rng.choice(V, p=row / row.sum()) for row in q], dtype=np.int32)
    return d, n, p, q


@pytest.mark.parametrize("dense_q", [False, True], ids=["one-hot", "dense-q"])
def test_a_row_decides_the_same_alone_and_in_any_batch(dense_q: bool) -> None:
    d, n, p, q = _random_batch(11)
    b = n.size
    greedy_mask = np.zeros(b, dtype=bool)
    greedy_mask[-1] = True
    keys = np.arange(100, 100 + b, dtype=np.uint64)
    positions = np.arange(b) * 3
    d_start = np.cumsum(n) - n
    t_start = d_start + np.arange(b)

    def run(rows: list[int], step: int = 0) -> np.ndarray:
        dsel = np.concatenate([np.arange(d_start[i], d_start[i] + n[i]) for i in rows]).astype(int)
        tsel = np.concatenate([np.arange(t_start[i], t_start[i] + n[i] + 1) for i in rows])
        return rejection_sample(
            d[dsel],
            n[rows],
            p[tsel],
            greedy_mask[rows],
            q[dsel] if dense_q else None,
            keys[rows],
            positions[rows] + step,
        )

    full = run(list(range(b)))
    for i in range(b):
        alone = run([i])
        np.testing.assert_array_equal(alone[0, : n[i] + 1], full[i, : n[i] + 1])
    np.testing.assert_array_equal(run(list(range(b))[::-1])[::-1], full)
    # Other positions draw other uniforms, so the check is not vacuous.
    assert any(not np.array_equal(run(list(range(b)), step), full) for step in range(1, 6))


def test_one_hot_rows_emit_the_keyed_sample_whatever_the_drafts() -> None:
    """Sample, then match: the token emitted at output position n is keyed_sample of the
    target at n, whether it is an accepted draft, the token after a rejection or the bonus."""
    rng = np.random.default_rng(4)
    k = 3
    p = rng.dirichlet(np.full(V, 0.7), size=k + 1)
    key, start = np.array([77], dtype=np.uint64), 40
    sampled = [int(keyed_sample(p[j : j + 1], key, np.array([start + j]))[0]) for j in range(k + 1)]
    seen = set()
    for trial in range(60):
        m = int(rng.integers(0, k + 1))
        drafts = rng.integers(0, V, size=m)
        if trial % 3 == 0:
            drafts[: min(m, 2)] = sampled[: min(m, 2)]  # some drafts right
        rows = np.concatenate([p[:m], p[m : m + 1]])
        out = rejection_sample(
            drafts, np.array([m]), rows, np.array([False]), None, key, np.array([start])
        )[0]
        emitted = [int(t) for t in out if t >= 0]
        assert emitted == sampled[: len(emitted)]
        accepted = len(emitted) - 1
        assert drafts[:accepted].tolist() == sampled[:accepted]
        assert accepted == m or drafts[accepted] != sampled[accepted]
        seen.add((m, accepted))
    assert len(seen) > 4


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
    position-independent target p. Returns the [n, k+1] output. The requests share one
    random key and own disjoint output positions, so every draw has its own counter."""
    rng = np.random.default_rng(seed)
    t = n * k
    if q is None:
        assert onehot is not None
        drafts = np.full(t, onehot, dtype=np.int32)
        draft_probs = None
    else:
        drafts = _sample_categorical(rng, q, t).astype(np.int32)
        draft_probs = np.broadcast_to(q.astype(np.float32), (t, V))
    target = np.broadcast_to(p.astype(np.float32), (t + n, V))
    return rejection_sample(
        drafts,
        np.full(n, k, dtype=np.int32),
        target,
        np.zeros(n, dtype=bool),
        draft_probs,
        np.full(n, rng.integers(0, 2**63), dtype=np.uint64),
        np.arange(n) * (k + 1),
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


def test_greedy_run_decides_as_rejection_sample_does() -> None:
    """The all-greedy fast path (Sampler._accept) against the batched rule, on random
    rows with drafts that match the argmax for a while, then may not."""
    from spectrio.stages.device.rejection import greedy_run

    rng = np.random.default_rng(11)
    for _ in range(300):
        n = int(rng.integers(0, 5))
        rows = rng.standard_normal((n + 1, 9))
        if rng.random() < 0.3:
            rows[:, 3] = rows.max(axis=1)  # ties: the first index wins in both
        best = rows.argmax(axis=1)
        drafts = [int(b) if rng.random() < 0.7 else int(rng.integers(0, 9)) for b in best[:n]]
        want = rejection_sample(
            np.array(drafts, dtype=np.int64), np.array([n]), rows, np.array([True]), None,
            np.zeros(1, np.uint64), np.zeros(1, np.int64),
        )[0]  # fmt: skip
        assert greedy_run(rows, drafts) == [int(t) for t in want if t >= 0]
    with pytest.raises(ValueError, match="2 drafts need 3 rows"):
        greedy_run(np.zeros((2, 9)), [1, 2])
