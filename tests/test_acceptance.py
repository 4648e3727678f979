"""Greedy acceptance and exact stops inside an accepted run."""

from __future__ import annotations

import pytest

from spectrio.stages.acceptance import greedy_accept, truncate_at_stop


@pytest.mark.parametrize(
    "drafts,target,accepted,emitted",
    [
        ([5, 6, 7], [5, 6, 7, 8], 3, [5, 6, 7, 8]),  # all accepted + bonus
        ([5, 6, 7], [9, 6, 7, 8], 0, [9]),  # first draft rejected
        ([5, 6, 7], [5, 1, 7, 8], 1, [5, 1]),  # mismatch in the middle
        ([5, 6, 7], [5, 6, 2, 8], 2, [5, 6, 2]),
        ([], [4], 0, [4]),  # no drafts: the target's own token
    ],
)
def test_greedy_accept(drafts: list[int], target: list[int], accepted: int, emitted: list[int]) -> None:
    assert greedy_accept(drafts, target) == (accepted, emitted)


def test_greedy_accept_checks_lengths() -> None:
    with pytest.raises(ValueError, match="need 3 target tokens"):
        greedy_accept([1, 2], [1, 2])


def test_stop_beats_length() -> None:
    assert truncate_at_stop([10, 11, 99, 20, 21], [99], 5) == ([10, 11, 99], "stop")
    assert truncate_at_stop([10, 11, 99, 20, 21], [99], 2) == ([10, 11], "length")
    assert truncate_at_stop([10, 11, 99], [99], 3) == ([10, 11, 99], "stop")


def test_no_stop() -> None:
    assert truncate_at_stop([1, 2], [99], 5) == ([1, 2], None)
    assert truncate_at_stop([1, 2], [], 2) == ([1, 2], "length")
