"""The chat prompts ``spectrio train-mtp`` trains on and ``spectrio bench --prompts chat``
measures on: the held-out ones share nothing with the training ones."""

from __future__ import annotations

import numpy as np
import pytest

from spectrio.tools.training.chat_prompts import (
    HELDOUT_TASKS,
    HELDOUT_TOPICS,
    TRAIN_TASKS,
    TRAIN_TOPICS,
    chat_prompts,
    heldout_chat_prompts,
    usable_messages,
)


def _words(text: str) -> set[str]:
    return {w.strip(".,?!'").lower() for w in text.replace("{t}", " ").split()}


def test_held_out_topics_and_phrasings_are_not_trained_on() -> None:
    assert not {t.lower() for t in HELDOUT_TOPICS} & {t.lower() for t in TRAIN_TOPICS}
    assert not set(HELDOUT_TASKS) & set(TRAIN_TASKS)
    # no held-out phrasing is a training one with a word or two changed
    for held in HELDOUT_TASKS:
        for trained in TRAIN_TASKS:
            a, b = _words(held), _words(trained)
            assert len(a & b) / len(a | b) < 0.6, (held, trained)
    trained = set(chat_prompts(len(TRAIN_TOPICS) * len(TRAIN_TASKS), np.random.default_rng(0)))
    assert not trained & set(heldout_chat_prompts(len(HELDOUT_TOPICS) * len(HELDOUT_TASKS)))


def test_held_out_prompts_are_all_pairs_in_a_varied_order() -> None:
    everything = len(HELDOUT_TOPICS) * len(HELDOUT_TASKS)
    prompts = heldout_chat_prompts(everything)
    assert len(set(prompts)) == everything
    assert heldout_chat_prompts(10) == prompts[:10]
    topic_of = {p: next(t for t in HELDOUT_TOPICS if t in p) for p in prompts}
    for a, b in zip(prompts, prompts[1:], strict=False):
        assert topic_of[a] != topic_of[b]
    first = prompts[: len(HELDOUT_TASKS)]
    task_of = [
        next(i for i, k in enumerate(HELDOUT_TASKS) if k.split("{t}")[0] in p) for p in first
    ]
    assert sorted(task_of) == list(range(len(HELDOUT_TASKS)))
    with pytest.raises(ValueError, match=f"there are {everything} held-out chat prompts"):
        heldout_chat_prompts(everything + 1)


def test_usable_messages_keep_finished_distinct_ones_off_held_out_topics() -> None:
    written = [
        ("  How do I bake bread at home?  ", True),
        ("Tell me about a river that", False),  # cut by the token limit
        ("Hi there", True),  # too short
        ("how do I  bake bread at HOME?", True),  # the first again
        ("Write a poem about lighthouses and the sea.", True),  # a held-out topic
        ("What is a good name for a cat?", True),
        ("Plan a trip to the mountains for me.", True),
    ]
    assert usable_messages(written, 10) == [
        "How do I bake bread at home?",
        "What is a good name for a cat?",
        "Plan a trip to the mountains for me.",
    ]
    assert usable_messages(written, 2) == [
        "How do I bake bread at home?",
        "What is a good name for a cat?",
    ]
