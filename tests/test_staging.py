"""The staging arena: exact values, reuse across passes, distinct tensors within one,
and a bound on what it keeps."""

from __future__ import annotations

import numpy as np

from spectrio.models.ops.staging import Staging


def test_put_gives_the_array_and_reuses_tensors_across_passes() -> None:
    staging = Staging()
    a = staging.put(np.array([3, 1, 2], dtype=np.int64))
    b = staging.put(np.array([7, 8, 9], dtype=np.int64))  # same shape, same pass
    m = staging.put(np.full((2, 2), -np.inf, dtype=np.float32))
    assert a is not b
    assert a.numpy().tolist() == [3, 1, 2] and b.numpy().tolist() == [7, 8, 9]
    assert str(m.dtype).endswith("float32") and np.isneginf(m.numpy()).all()
    staging.reset()
    again = staging.put(np.array([4, 5, 6], dtype=np.int64))
    assert again is a and again.numpy().tolist() == [4, 5, 6]
    assert staging.put(np.zeros(0, dtype=np.int64)).shape == [0]


def test_shapes_not_in_use_are_dropped_past_the_byte_bound() -> None:
    staging = Staging(max_bytes=1000)
    for n in range(1, 60):  # a new shape every pass, 8 bytes per element
        staging.reset()
        kept = staging.put(np.arange(n, dtype=np.int64))
        assert kept.numpy().tolist() == list(range(n))
        assert staging.held_bytes <= max(1000, 8 * n)
    # What one pass holds is never dropped, whatever the bound.
    staging.reset()
    big = [staging.put(np.full(100, i, dtype=np.int64)) for i in range(5)]
    assert [int(t.numpy()[0]) for t in big] == [0, 1, 2, 3, 4]
