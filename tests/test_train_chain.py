"""The training's unrolled, distilled MTP chain computes exactly what the runtime drafts.

``target_chain``/``mtp_chain`` run every chain of a window in parallel with chained masks;
the reference (``reference.greedy_mtp_drafts``, the dense form of the draft actor) runs one
context at a time. In float64 they must agree on every token and logit.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from conftest import tiny_model

from spectrio.models import reference
from spectrio.tools.training.chain import chain_accepted, chain_mask, mtp_chain, target_chain
from spectrio.tools.training.optim import lr_at

DEPTH = 3


def test_chain_mask_layout() -> None:
    # MTP form: real entries strictly before the chain's start (one fewer than the rows)
    np.testing.assert_array_equal(
        np.isfinite(chain_mask(3, 2, "float64").numpy()), [[0, 0], [1, 0], [1, 1]]
    )
    # target form: real entries up to and including the row
    np.testing.assert_array_equal(
        np.isfinite(chain_mask(3, 3, "float64").numpy()), np.tril(np.ones((3, 3), bool))
    )


def _chains(
    model: object, ids: np.ndarray
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    with paddle.no_grad():
        t_logits, hidden, tokens = target_chain(model, paddle.to_tensor(ids), DEPTH + 1)  # type: ignore[arg-type]
        m_logits = mtp_chain(model, paddle.to_tensor(ids), hidden, tokens, DEPTH)  # type: ignore[arg-type]
    return [x.numpy() for x in t_logits], [x.numpy() for x in tokens], [x.numpy() for x in m_logits]


def test_parallel_chains_equal_the_runtime_drafts() -> None:
    """Chain s of the parallel pass is what the runtime drafts after context ids[:s+1]."""
    model = tiny_model("float64", seed=3)
    ids = (
        np.random.default_rng(0).integers(1, model.config.vocab_size, size=(2, 12)).astype(np.int64)
    )
    _, tokens, m_logits = _chains(model, ids)
    for s in range(ids.shape[1]):
        target, drafts = reference.greedy_mtp_drafts(model, ids[:, : s + 1].tolist(), DEPTH)
        for j in range(DEPTH + 1):
            np.testing.assert_array_equal(target[:, j], tokens[j][:, s])
        np.testing.assert_array_equal(drafts[:, 0], m_logits[0][:, s].argmax(-1))
        for j in range(1, DEPTH):
            # Equal wherever the runtime's chain was fed the target's own tokens, the only
            # chains greedy verification keeps (the training feeds exactly those). A random
            # model rarely gets there; the logit-level test below covers every substep.
            fed_target = np.all(drafts[:, :j] == target[:, 1 : j + 1], axis=1)
            np.testing.assert_array_equal(
                drafts[fed_target, j], m_logits[j][fed_target, s].argmax(-1)
            )


def test_parallel_chain_logits_equal_incremental_logits() -> None:
    """Logit-level check against one-token-at-a-time passes fed the target's tokens."""
    model = tiny_model("float64", seed=5)
    ids = (
        np.random.default_rng(1).integers(1, model.config.vocab_size, size=(1, 9)).astype(np.int64)
    )
    t_logits, tokens, m_logits = _chains(model, ids)
    s = 5
    with paddle.no_grad():
        ctx = paddle.to_tensor(ids[:, : s + 1])
        logits, h, past = model.forward_dense(ctx)
        np.testing.assert_allclose(t_logits[0][:, s], logits.numpy()[:, -1], rtol=1e-10, atol=1e-10)
        g = [paddle.to_tensor(tokens[j][:, s : s + 1]) for j in range(DEPTH + 1)]
        for j in range(1, DEPTH + 1):
            lg, _, past = model.forward_dense(g[j - 1], past)
            np.testing.assert_allclose(t_logits[j][:, s], lg.numpy()[:, -1], rtol=1e-10, atol=1e-10)
        shifted = paddle.concat([ctx[:, 1:], g[0]], axis=1)
        ml, mh, mpast = model.mtp_forward_dense(shifted, h)
        np.testing.assert_allclose(m_logits[0][:, s], ml.numpy()[:, -1], rtol=1e-10, atol=1e-10)
        for j in range(1, DEPTH):
            ml, mh, mpast = model.mtp_forward_dense(g[j], mh[:, -1:], mpast)
            np.testing.assert_allclose(m_logits[j][:, s], ml.numpy()[:, -1], rtol=1e-10, atol=1e-10)


def test_chain_accepted_is_a_prefix_rate() -> None:
    v = 5
    target = [paddle.to_tensor(np.array([[a, b]])) for a, b in ((9, 9), (1, 2), (3, 4), (0, 0))]

    def onehot(xs: list[int]) -> paddle.Tensor:
        return paddle.to_tensor(np.eye(v)[np.array([xs])])

    drafts = [onehot([1, 0]), onehot([3, 4]), onehot([0, 0])]  # chain 2 misses substep 1
    np.testing.assert_allclose(chain_accepted(drafts, target), [0.5, 0.5, 0.5])


@pytest.mark.parametrize("progress,expected", [(0.0, 1.0), (0.5, 0.55), (1.0, 0.1), (2.0, 0.1)])
def test_lr_follows_progress_after_warmup(progress: float, expected: float) -> None:
    assert lr_at(10, progress, 1.0, 5) == pytest.approx(expected)
    assert lr_at(1, progress, 1.0, 5) == pytest.approx(0.4)
