"""User messages for an instruct model: the ones ``spectrio train-mtp`` trains a head on,
and held-out ones ``spectrio bench --prompts chat`` measures it on.

Training messages are either topic x task pairs (:func:`chat_prompts`) or ones the target
wrote itself, sampled from its chat template's opened user turn and filtered by
:func:`usable_messages`: a head trained on a few dozen topics learns their answers
rather than the target.

Invariant: the two sets share no topic and no task phrasing (``tests/test_chat_prompts.py``
checks it), so a head is never measured on a request it was trained on, nor on one that
differs from such a request only in its topic. The training lists are part of the
shipped heads' recipe: changing them changes what ``models/heads/*/train.sh`` makes.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "HELDOUT_TASKS",
    "HELDOUT_TOPICS",
    "TRAIN_TASKS",
    "TRAIN_TOPICS",
    "chat_prompts",
    "heldout_chat_prompts",
    "usable_messages",
]

TRAIN_TOPICS = (
    "photosynthesis", "the French Revolution", "binary search", "compound interest",
    "black holes", "the water cycle", "recursion in programming", "climate change",
    "the immune system", "supply and demand", "machine learning", "the Roman Empire",
    "plate tectonics", "healthy sleep", "public speaking", "time management",
    "the theory of evolution", "electric cars", "the stock market", "volcanoes",
    "hash tables", "the human heart", "renewable energy", "the printing press",
    "learning a new language", "the solar system", "vaccines", "sorting algorithms",
    "the Internet", "ancient Egypt", "gardening for beginners", "the moon landing",
    "saving money", "coffee", "the history of mathematics", "prime numbers",
    "writing a good essay", "friendship", "ocean tides", "databases",
    "linked lists", "the Great Wall of China", "bees and pollination", "inflation",
    "regular expressions", "the Renaissance", "earthquakes", "nutrition", "chess",
    "the Pythagorean theorem", "cloud computing", "rainforests", "the Olympic Games",
    "probability", "memory in the brain", "airplanes and lift", "recycling",
    "unit testing", "the industrial revolution", "music theory", "DNA", "glaciers",
    "operating systems", "the scientific method", "budgeting", "dinosaurs",
    "encryption", "the periodic table", "meditation", "bridges", "web browsers",
    "the Silk Road", "magnets", "version control with git", "photography",
    "the Cold War", "fractions", "bacteria", "open source software", "weather forecasts",
    "graph algorithms", "the Amazon river", "electricity", "job interviews",
    "the speed of light", "ancient Greece", "bicycles", "spreadsheets", "the ocean floor",
    "object-oriented programming", "cooking pasta", "satellites", "democracy",
    "the human eye", "dynamic programming", "wind power", "the Moon's phases",
)  # fmt: skip
TRAIN_TASKS = (
    "Explain {t} in simple terms.",
    "Write a short paragraph about {t}.",
    "Give me three interesting facts about {t}.",
    "What are the main ideas behind {t}?",
    "Describe {t} to a ten-year-old.",
    "Write a short story that involves {t}.",
    "List the pros and cons of {t}.",
    "Summarize the history of {t}.",
    "How would you teach {t} to a beginner?",
    "Write a Python function related to {t}, with a docstring.",
    "What are common misconceptions about {t}?",
    "Write a haiku about {t}, then explain it.",
    "Write a short dialogue between two friends about {t}.",
    "Give a step-by-step guide to understanding {t}.",
    "Compare {t} with something from everyday life.",
    "Write five quiz questions about {t}, with answers.",
)


def chat_prompts(count: int, rng: np.random.Generator) -> list[str]:
    """``count`` distinct training user messages (topic x task), in a seeded order."""
    pairs = [(t, k) for t in TRAIN_TOPICS for k in TRAIN_TASKS]
    picks = rng.permutation(len(pairs))[:count]
    return [pairs[i][1].format(t=pairs[i][0]) for i in picks]


HELDOUT_TOPICS = (
    "lighthouses", "the Byzantine Empire", "quicksort", "mortgages", "neutron stars",
    "the nitrogen cycle", "tail calls", "ocean acidification", "allergies", "tariffs",
    "neural networks", "the Mongol Empire", "coral reefs", "hydration", "negotiation",
    "procrastination", "natural selection", "hydrogen fuel cells", "bonds and interest rates",
    "geysers", "bloom filters", "the human lungs", "solar panels", "the telegraph",
    "learning to play the guitar", "comets", "antibiotics", "binary trees", "email",
    "the Maya civilization", "composting", "the first flight of the Wright brothers",
    "retirement savings", "tea", "the history of zero", "Fibonacci numbers",
    "writing a cover letter", "teamwork", "rivers and deltas", "caching",
    "stacks and queues", "the Eiffel Tower", "ants", "exchange rates", "JSON",
    "the Enlightenment", "tsunamis", "vitamins", "the game of Go", "the law of cosines",
    "containers and Docker", "deserts", "the Tour de France", "statistics", "dreams",
    "how birds fly", "plastic pollution", "continuous integration", "the steam engine",
    "rhythm in music", "proteins", "icebergs", "compilers", "the placebo effect",
)  # fmt: skip
HELDOUT_TASKS = (
    "Can you tell me about {t}?",
    "I'm curious about {t}. What should I know?",
    "Write a brief blog post introducing {t}.",
    "Explain {t} as if I were a high school student.",
    "What is the most surprising thing about {t}?",
    "Write a limerick about {t}.",
    "Outline a five-minute presentation on {t}.",
    "Why does {t} matter today?",
    "Write a JavaScript snippet that illustrates {t}, with comments.",
    "Describe a typical mistake people make with {t} and how to avoid it.",
    "Write a letter to a friend explaining {t}.",
    "Give an analogy that makes {t} easy to understand.",
)


def heldout_chat_prompts(count: int) -> list[str]:
    """The first ``count`` held-out user messages, in a fixed order in which consecutive
    messages differ in topic and task and no pair repeats (at most
    ``len(HELDOUT_TOPICS) * len(HELDOUT_TASKS)``)."""
    n_topics, n_tasks = len(HELDOUT_TOPICS), len(HELDOUT_TASKS)
    if count > n_topics * n_tasks:
        raise ValueError(
            f"there are {n_topics * n_tasks} held-out chat prompts, not the {count} requested"
        )
    # message i: topic i mod T, task (i + i // T) mod K; for one topic the tasks step by
    # T + 1 (mod K), and gcd(T + 1, K) = 1 makes them all distinct.
    return [
        HELDOUT_TASKS[(i + i // n_topics) % n_tasks].format(t=HELDOUT_TOPICS[i % n_topics])
        for i in range(count)
    ]


def usable_messages(written: list[tuple[str, bool]], count: int, min_words: int = 3) -> list[str]:
    """Up to ``count`` of the messages a model wrote, in order: each ``(text, finished)``
    is kept when it ended its turn (``finished``, not cut by the token limit), holds at
    least ``min_words`` words, names no held-out topic and repeats no earlier one."""
    banned = [t.lower() for t in HELDOUT_TOPICS]
    kept: dict[str, str] = {}  # normalised text -> the text as written
    for text, finished in written:
        text = text.strip()
        key = " ".join(text.lower().split())
        if not finished or len(key.split()) < min_words or key in kept:
            continue
        if any(topic in key for topic in banned):
            continue
        kept[key] = text
        if len(kept) == count:
            break
    return list(kept.values())
