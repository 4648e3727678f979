"""The adaptive policy's measured step times (pure): per batch bucket, each k's step time
from a window of recent steps (:class:`BucketTimes`), and the cost of a step's extra rows
whose cost does not depend on k (:class:`ExtraRowCost`: prompt rows and a proposer's
catch-up rows), which the policy takes off before timing k. :mod:`.spec_policy` decides
with them."""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Collection
from statistics import median
from typing import Any

__all__ = [
    "STEP_FIXED_SEQS",
    "BucketTimes",
    "Decayed",
    "ExtraRowCost",
    "batch_bucket",
    "scale_to_bucket",
]


def batch_bucket(num_seqs: int) -> int:
    """Power-of-two bucket of a batch size (1, 2, 4, ...)."""
    return 1 << max(0, num_seqs - 1).bit_length()


# A step's time grows about linearly with its sequences, from a fixed part worth about
# this many sequences' rows (docs/performance.md).
STEP_FIXED_SEQS = 8.0


def scale_to_bucket(seconds: float, num_seqs: int, bucket: int) -> float:
    """A step's time with ``num_seqs`` sequences, scaled to its bucket's full size."""
    return seconds * (STEP_FIXED_SEQS + bucket) / (STEP_FIXED_SEQS + num_seqs)


@dataclasses.dataclass
class Decayed:
    """An exponentially forgetting sum of observations and their count."""

    value: float = 0.0
    weight: float = 0.0

    def add(self, x: float, decay: float) -> None:
        self.value = self.value * decay + x
        self.weight = self.weight * decay + 1.0


class BucketTimes:
    """One batch bucket's step times, as ratios between neighbouring k measured side by
    side.

    The machine's speed drifts, so a k is compared with its neighbours where they ran
    next to it: a timing of k that follows one of k +/- 1
    within ``span`` timings, with no timing of k in between, gives one sample of
    ``log T(k) - log T(k +/- 1)`` against the median of that neighbour's last few times
    in the span. Only a timing that follows a step of its own k counts (``add``'s
    ``after``): the step after a switch carries the other k's MTP catch-up. A two-step
    probe among steps of the best k thus gives two samples: the probe's second step
    against the steps before it, and the second step back at the best k against it. Each
    neighbouring pair keeps its last ``pair_window`` samples; their median is its ratio,
    and chained from the k run most recently they give every k's time. The first timing
    of a k is dropped: it pays one-time costs (new tensor shapes, cold caches)."""

    def __init__(self, window: int, pair_window: int, span: int = 16) -> None:
        self.window, self.span = window, span
        self.pair_window = pair_window
        # k -> (timing no., seconds)
        self._recent: dict[int, deque[tuple[int, float]]] = {}
        self._pairs: dict[int, deque[float]] = {}  # k -> samples of log T(k+1) / T(k)
        self._seen: set[int] = set()
        self._timings = 0
        self._last_timed: dict[int, int] = {}  # k -> the number of its latest timing
        self._last_k: int | None = None
        self._seeded: dict[int, float] = {}  # k -> seconds, from an earlier run (seed())

    def add(self, k: int, seconds: float, after: int | None = None) -> None:
        """A timing of ``k``; ``after``, the k of the step before it, whose accepted rows
        this step's MTP pass caught up on (None: unknown, compared with any)."""
        if k not in self._seen:
            self._seen.add(k)
            return
        if after is not None and after != k:
            return
        self._timings += 1
        n = self._timings
        since = self._last_timed.get(k, 0)
        for j in (k - 1, k + 1):
            near = [t for m, t in self._recent.get(j, ()) if m > since and n - m <= self.span]
            if not near:
                continue
            sample = math.log(seconds / median(near[-4:]))
            low = min(j, k)
            pair = self._pairs.setdefault(low, deque(maxlen=self.pair_window))
            pair.append(sample if k > j else -sample)
        self._recent.setdefault(k, deque(maxlen=self.window)).append((n, seconds))
        self._last_timed[k] = n
        self._last_k = k

    def samples(self, low: int) -> int:
        """Samples of the pair of ``low`` and ``low + 1`` (kept ones included)."""
        pair = self._pairs.get(low)
        return 0 if pair is None else len(pair)

    def settled(self, low: int, gap: float, min_samples: int = 8, z: float = 3.0) -> bool:
        """Whether a rate ``gap`` (log) between ``low`` and ``low + 1`` is more than ``z``
        standard errors of their pair's median (a robust spread, from the samples' median
        absolute deviation), on ``min_samples`` samples at least."""
        pair = self._pairs.get(low)
        if pair is None or len(pair) < min_samples:
            return False
        mid = median(pair)
        spread = 1.4826 * median(abs(x - mid) for x in pair)
        return gap > z * 1.2533 * spread / math.sqrt(len(pair))

    @property
    def warm(self) -> Collection[int]:
        """The k with a timing that counts (past their first)."""
        return self._last_timed.keys()

    def estimates(self) -> dict[int, float]:
        """Seconds a step takes per k, for every k linked to the latest one by pairs."""
        anchor = self._last_k
        if anchor is None:
            return dict(self._seeded)
        out = {anchor: median([t for _, t in self._recent[anchor]])}
        for step in (-1, 1):
            log_t, k = math.log(out[anchor]), anchor
            while True:
                low = min(k, k + step)
                pair = self._pairs.get(low)
                if not pair or ((k + step) not in self.warm and (k + step) not in self._seeded):
                    break
                log_t += median(pair) * step
                k += step
                out[k] = math.exp(log_t)
        return out

    def last(self, k: int) -> int:
        """The number of ``k``'s latest timing that counts (0: none yet, or only its
        first, which is dropped)."""
        return self._last_timed.get(k, 0)

    def export(self, min_samples: int = 4) -> dict[str, dict[int, Any]]:
        """What this run learnt, for :meth:`seed`: the samples of each pair with at least
        ``min_samples``, and the estimated seconds of every k those pairs link to the k run
        last. A pair of fewer samples is not kept: the next run trusts kept pairs instead
        of exploring."""
        pairs = {k: list(v) for k, v in self._pairs.items() if len(v) >= min_samples}
        estimates = self.estimates()
        if self._last_k is None:  # nothing timed in this run: pass on what was seeded
            return {"pairs": pairs, "times": estimates}
        linked = {self._last_k}
        for step in (-1, 1):
            k = self._last_k
            while min(k, k + step) in pairs and (k + step) in estimates:
                k += step
                linked.add(k)
        return {"pairs": pairs, "times": {k: t for k, t in estimates.items() if k in linked}}

    def seed(self, pairs: dict[int, list[float]], times: dict[int, float]) -> None:
        """Start from an earlier run's pairs and times: every k they cover has an
        estimate before it runs, and this run's samples push the old ones out of each
        pair's window as they come in."""
        for low, samples in pairs.items():
            self._pairs[low] = deque(samples[-self.pair_window :], maxlen=self.pair_window)
        self._seeded = dict(times)

    @property
    def kept(self) -> bool:
        """Whether this bucket started from an earlier run's times (:meth:`seed`)."""
        return bool(self._seeded)


class ExtraRowCost:
    """One batch bucket's cost per row of the work a step may carry besides its decoding
    sequences: the target's prompt rows (a new request's prefill, chunked) and the MTP
    layer's catch-up rows beyond the ``k_max + 1`` a decoding sequence brings (a request's
    first decode step reads its whole prompt through the MTP layer). Its cost does not
    depend on k, so :meth:`SpecPolicy.observe_step` takes it off before timing the step:
    in a large batch's steady state nearly every step carries such rows, and untimed,
    the steady state would never be measured.

    Learnt from two steps of one k in a row (each after a step of that k) that differ in
    one kind of row only: one sample of seconds per row of that kind, their difference
    over the rows' difference. The machine's speed drifts slowly, so neighbouring steps
    compare best; the median of the
    last ``window`` samples is the cost, used once ``min_samples`` have come in, and only
    for as many rows as twice the largest difference a sample came from (a long prompt's
    attention costs more per row than the short ones it was learnt on)."""

    def __init__(self, window: int = 32, min_samples: int = 8) -> None:
        self.min_samples = min_samples
        self._samples = (deque[float](maxlen=window), deque[float](maxlen=window))
        self._reach = [0, 0]  # per kind: the largest row difference a sample came from
        self._last: tuple[int, int | None, tuple[int, int], float] | None = None

    def add(self, k: int, after: int | None, rows: tuple[int, int], seconds: float) -> None:
        """A step of ``k`` drafts after one of ``after``, with ``rows`` extra rows (prompt,
        catch-up), that took ``seconds``."""
        last, self._last = self._last, (k, after, rows, seconds)
        if last is None or not (k == after == last[0] == last[1]):
            return
        delta = (rows[0] - last[2][0], rows[1] - last[2][1])
        for kind in (0, 1):
            if delta[kind] != 0 and delta[1 - kind] == 0:
                self._samples[kind].append((seconds - last[3]) / delta[kind])
                self._reach[kind] = max(self._reach[kind], abs(delta[kind]))

    def export(self) -> dict[str, list[Any]]:
        """The learnt samples and reach per kind, for :meth:`seed`."""
        return {"samples": [list(d) for d in self._samples], "reach": list(self._reach)}

    def seed(self, samples: list[list[float]], reach: list[int]) -> None:
        """Start from an earlier run's samples (the newest ``window`` of them)."""
        for kind in (0, 1):
            self._samples[kind].extend(samples[kind])
            self._reach[kind] = max(self._reach[kind], int(reach[kind]))

    def cost(self, rows: tuple[int, int]) -> float | None:
        """Seconds the ``rows`` add to a step; None where a kind is not known well enough."""
        total = 0.0
        for kind in (0, 1):
            if rows[kind] == 0:
                continue
            samples = self._samples[kind]
            if len(samples) < self.min_samples or rows[kind] > 2 * self._reach[kind]:
                return None
            total += max(0.0, median(samples)) * rows[kind]
        return total
