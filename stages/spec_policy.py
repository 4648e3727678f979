"""Adaptive speculation: how many drafts a step should propose, from 0 to k.

Pure logic: no Trio, no device, no clock. The scheduler asks :meth:`SpecPolicy.choose`
once per step with the number of decoding sequences, and feeds back what happened
(:meth:`observe_acceptance` per sequence, :meth:`observe_step` and
:meth:`observe_occupancy` per step).

The rule: pick the k that maximises expected tokens per second,

    rate(k, B) = E[tokens per sequence | k] / ((1 + o * E[tokens | k]) * T(B, k))

* ``E[tokens | k] = 1 + sum_{j=1..k} prod_{i<=j} a_i``, where ``a_i`` is the measured
  probability that draft i is accepted given that drafts 1..i-1 were (counted over
  every sequence that reached position i, with exponential forgetting), shrunk towards
  the position before it (``prior_weight`` pseudo-observations; position 1 towards
  ``prior_acceptance``). A deeper position is observed only on steps that draft that
  far, so at batch 1 it may have one or two observations when the choice is made: two
  early rejections read as ``a_2 = 0`` kept ``spectrio generate`` at k = 1, 23% slower
  than k = 2, for its whole run; shrunk, it reads 0.62 and the next probe decides.
  A position the step does not draft also forgets its record at ``stale_decay`` a step,
  so one that has not been seen for a while leans on the position before it again:
  acceptance comes in stretches per request (at batch 1 one bench request accepts
  exactly one draft on 28 steps running, the next three 97% at positions 2 and 3), and
  a stretch of rejections at position 2 that sent the policy to k = 1 otherwise stayed
  in the record, seen again only by a probe one step in 16: it ran the next request at
  k = 1 too. Replayed on recorded acceptance and step times (``tools/policy_replay``,
  48 runs of 4 requests at batch 1 on the machine's step times, up to k = 4), the worst
  run rose from 0.80 to 0.94 of the best fixed k and the mean from 0.981 to 0.991 (up to
  k = 3: 0.86 to 0.96, 0.986 to 0.989). It costs a little where acceptance is steady and
  falls with depth: deep positions revisited more often than needed (simulated at
  batch 4, 0.992 of the best k against 0.995);
* ``o`` is the batch's slot-steps lost while requests wait for a slot, per token emitted
  over the last hundred or so steps (:meth:`SpecPolicy.observe_occupancy`: prefill
  steps, unplanned slots, a request's last short step); without a queue it fades to 0. A
  request pays them whatever k is, at k's step time, so under a queue they take back
  part of what a larger k gains a step;
* ``T(B, k)`` is the measured wall time of a step (draft substeps plus verification)
  with ``B`` decoding sequences in the same power-of-two bucket and k drafts each, each
  timing first scaled to the bucket's full size (:func:`scale_to_bucket`). Unscaled, the
  bucket of 33-64 sequences compared k = 3 timed on the 40 sequences of a draining batch
  with k = 2 timed on 64: at batch 64 with a queue behind it, its estimate for k = 3 read
  48 ms against the 66 ms such a step takes when full. The machine's speed drifts
  (a shared 2-core host: a step's time correlates 0.67 with the step before it, 0.4 with
  one 16 steps back, and about one step in ten is a spike of 1.5-3x), so k are compared
  where they ran beside each other (:class:`_BucketTimes`): a timing of k right after
  steps of k - 1 or k + 1 gives a sample of their ratio against those neighbours' last
  few times, a two-step probe among steps of the best k gives two (its second step
  against the steps before it, the second step back at the best k against the probe;
  the first step after a switch is not timed, below), every neighbouring pair keeps the median
  of its last ``pair_window`` samples, and the ratios chained from the k run last give
  every k's time. Before, each k's times were ratios to the level of the k run most
  over its last 16 steps, and their mean of the faster half: replayed on a batch-1 tape
  (``tools/policy_replay``, 32 requests, 16 starts) the policy read k = 4 at 1.25-1.3x
  k = 3 where the tape's medians give 1.12, ran k = 3 on a third of its steps and made
  0.970 of fixed k = 4 (worst start 0.939); paired, 0.991 (worst 0.977), against 0.995
  for the same policy told the tape's true medians. Only a step that follows a step of
  its own k is timed: a step's MTP pass first catches up on the rows the step before
  accepted (at k = 4 about 4 a sequence, at 3 about 3.4), so the step right after a
  switch carries the other k's catch-up, and timed, both steps around every probe read
  the smaller k dearer than it is. At batch 64, where the catch-up is real work, steady
  steps of k = 4 take 1.27-1.31x those of k = 3 (cycled step by step) while the policy
  read 1.17 and ran k = 4, 4-6% slower than k = 3 on the bench, on 86% of its steps.

A run drafts ``k_max`` until the first draft position has been seen
``acceptance_warmup`` times, whatever kept times say: before that the expected tokens are
only the prior's. Exploration starts at ``k_max`` (after a batch size's first
``warmup_steps`` steps, which are not timed) and goes down one k at a time while the
smaller k does better (each k runs twice: its first step pays one-time costs and is not
counted); a batch bucket not timed yet borrows the times of a neighbouring one, scaled,
instead of exploring again. One step in ``probe_every`` starts a probe that re-measures, for two
steps (the first, after the best k, is not timed), whichever of the best k's two
neighbours was timed longer ago (the larger on ties), so a noisy early timing is
corrected, both neighbours' ratios stay current, and the next position's acceptance keeps
being measured while the policy prefers fewer drafts. A neighbour whose rate is more than
3 standard errors of its pair's median behind the best (:meth:`_BucketTimes.settled`) is
probed half as often: a probe of a k that is clearly worse mostly costs.
Only neighbours: the rate is unimodal in k (each extra draft adds less, and costs at
least as much), so a better k is always reachable one step at a time, and a probe never
spends a step on a k far from the best (at batch 1 a probe of k = 0 cost about 1/16 of
the gain, measured as 0.97 of the best fixed k). At a large batch the device is busy
anyway and verification rows cost real time, so the measured T grows with k and
the policy settles on small k or 0; at batch 1 extra rows are nearly free and it keeps
speculating. Output never depends on the choice: acceptance is lossless for any k.

What the policy learnt about the machine (every bucket's pair samples, step times and
extra-row costs; not acceptance, which belongs to the requests) leaves and enters as
JSON-ready data (:meth:`SpecPolicy.export_timings`, :meth:`SpecPolicy.import_timings`),
which the runtime keeps between runs (:mod:`spectrio.runtime.timing_cache`): a bucket
started from kept times has an estimate for every k they cover before it runs, so it
does not explore again, and its own samples replace the kept ones in each pair's window.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Collection
from statistics import median
from typing import Any

__all__ = ["SpecPolicy", "batch_bucket", "scale_to_bucket"]


def batch_bucket(num_seqs: int) -> int:
    """Power-of-two bucket of a batch size (1, 2, 4, ...)."""
    return 1 << max(0, num_seqs - 1).bit_length()


# A step's time grows about linearly with its sequences, from a fixed part worth about
# this many sequences' rows: target forward at 1 and 64 sequences, 2-core CPU, 3.1 and
# 20.0 ms with 1 row each (about 10 sequences' worth), 3.7 and 45.6 ms with 4 (about 5);
# whole steps at k = 3, 6.8 and 66 ms (about 6).
STEP_FIXED_SEQS = 8.0


def scale_to_bucket(seconds: float, num_seqs: int, bucket: int) -> float:
    """A step's time with ``num_seqs`` sequences, scaled to its bucket's full size."""
    return seconds * (STEP_FIXED_SEQS + bucket) / (STEP_FIXED_SEQS + num_seqs)


@dataclasses.dataclass
class _Decayed:
    """An exponentially forgetting sum of observations and their count."""

    value: float = 0.0
    weight: float = 0.0

    def add(self, x: float, decay: float) -> None:
        self.value = self.value * decay + x
        self.weight = self.weight * decay + 1.0


class _BucketTimes:
    """One batch bucket's step times, as ratios between neighbouring k measured side by
    side.

    The machine's speed drifts (on a 2-core host a step's time correlates 0.67 with the
    step before it and still 0.4 sixteen steps apart), so a k is compared with its
    neighbours where they ran next to it: a timing of k that follows one of k +/- 1
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

    def settled(self, low: int, gap: float, min_samples: int = 8, z: float = 3.0) -> bool:
        """Whether a rate ``gap`` (log) between ``low`` and ``low + 1`` is more than ``z``
        standard errors of their pair's median (a robust spread, from the samples' median
        absolute deviation), on ``min_samples`` samples at least. At batch 1 fixed k = 3
        is 8% behind k = 4, and a probe of it every 24 steps cost 0.7% of the run (9% of
        the steps at k = 3, `spectrio bench`, fourteenth session)."""
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
        last. A pair of one or two samples is not kept: a 64-token ``spectrio generate``
        (22 steps) kept such pairs, and the next run, trusting them instead of exploring,
        drafted less (27 steps for the same 64 tokens)."""
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


class _ExtraRowCost:
    """One batch bucket's cost per row of the work a step may carry besides its decoding
    sequences: the target's prompt rows (a new request's prefill, chunked) and the MTP
    layer's catch-up rows beyond the ``k_max + 1`` a decoding sequence brings (a request's
    first decode step reads its whole prompt through the MTP layer). Its cost does not
    depend on k, so :meth:`SpecPolicy.observe_step` takes it off before timing the step.

    At batch 64 in a server's steady state nearly every step carries such rows (a new
    request every step or two), so steps were timed only at a run's start and its tail:
    the bench's batch-64 case (256 requests, 128 tokens) timed 84 of its 173 steps, all
    but a few at its start and its draining tail, and the steady state between kept the
    k its first comparisons chose (k = 4 on 88% of the steps). Side by side with the old
    rule at batch 64 it measured level (README, twelfth session): the estimates it feeds
    are the same kind, only many more of them.

    Learnt from two steps of one k in a row (each after a step of that k) that differ in
    one kind of row only: one sample of seconds per row of that kind, their difference
    over the rows' difference. The machine's speed drifts slowly (a step's time correlates
    0.67 with the one before it), so neighbouring steps compare best; the median of the
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


class SpecPolicy:
    """Chooses drafts per step. ``adaptive=False`` always returns ``k_max`` (fixed k)."""

    def __init__(
        self,
        k_max: int,
        *,
        adaptive: bool = True,
        probe_every: int = 24,
        window: int = 8,
        warmup_steps: int = 6,
        acceptance_decay: float = 0.999,
        prior_acceptance: float = 0.5,
        prior_weight: float = 4.0,
        stale_decay: float = 0.95,
        pair_window: int = 32,
        acceptance_warmup: int = 8,
        occupancy_decay: float = 0.99,
    ) -> None:
        if k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {k_max}")
        self.k_max = k_max
        self.adaptive = adaptive
        self.probe_every = probe_every
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        if pair_window < 1:
            raise ValueError(f"pair_window must be >= 1, got {pair_window}")
        self.pair_window = pair_window
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        # The first decode steps at a batch size run slower than the rest whatever k is:
        # at batch 1, 8.5-12.7 ms for the first, 7-10 ms until the fourth to ninth, then
        # 6.7-7.5 ms (k = 2 and 3, 2-core CPU). Timed then, the k tried first (k_max)
        # looked dearer than it is, and a 64-token `spectrio generate` stayed at k = 1.
        self.warmup_steps = warmup_steps
        self._bucket_steps: dict[int, int] = {}
        # Acceptance is counted per sequence, so at batch B a step brings B observations;
        # a slower forgetting keeps its estimate steady at any batch size (a window of
        # ~100 observations flipped the choice between two k within 3% at batch 16).
        self.acceptance_decay = acceptance_decay
        self.prior_acceptance = prior_acceptance
        if prior_weight < 0:
            raise ValueError(f"prior_weight must be >= 0, got {prior_weight}")
        self.prior_weight = prior_weight
        if not 0.0 < stale_decay <= 1.0:
            raise ValueError(f"stale_decay must be in (0, 1], got {stale_decay}")
        self.stale_decay = stale_decay
        if acceptance_warmup < 0:
            raise ValueError(f"acceptance_warmup must be >= 0, got {acceptance_warmup}")
        # Until the first draft position has been seen this many times, the expected
        # tokens are the prior's (0.5 a position), under which one draft looks best. A
        # run started from kept step times then chose by them before its first
        # acceptance came in: `spectrio bench` at batch 16 drafted k = 0 on its first 9-11
        # steps of every warm round (the kept times had no k = 0 to compare with, so it
        # was explored), about 1% of the round. k_max observes every position at once;
        # a cold run starts there anyway.
        self.acceptance_warmup = acceptance_warmup
        self._first_position_seen = 0
        if not 0.0 < occupancy_decay <= 1.0:
            raise ValueError(f"occupancy_decay must be in (0, 1], got {occupancy_decay}")
        self.occupancy_decay = occupancy_decay
        self._overhead_slots = _Decayed()  # .value: slot-steps lost while requests waited
        self._emitted = _Decayed()  # .value: tokens emitted, every step
        self._reached = [_Decayed() for _ in range(k_max)]  # per draft position
        self._times: dict[int, _BucketTimes] = {}  # per batch bucket
        self._extra: dict[int, _ExtraRowCost] = {}  # per batch bucket
        self._num_choices = 0
        self._probing: tuple[int, int] | None = None  # (bucket, k) of a probe's second step

    # ---- feedback ---------------------------------------------------------------------

    def observe_acceptance(self, num_drafts: int, num_accepted: int) -> None:
        """One sequence's step: drafts 1..num_accepted were accepted and, when
        ``num_accepted < num_drafts``, draft ``num_accepted + 1`` was rejected."""
        if num_drafts > 0:
            self._first_position_seen += 1
        for j in range(min(num_drafts, num_accepted + 1, self.k_max)):
            self._reached[j].add(1.0 if j < num_accepted else 0.0, self.acceptance_decay)

    def observe_occupancy(self, overhead_slots: float, tokens: int) -> None:
        """One step: ``tokens`` emitted, and ``overhead_slots`` of the batch's slots that
        advanced no request's decoding while requests waited for one (0 when none waited):
        a request's prefill steps, slots left unplanned, and about half a step for each
        request that finished (its last step stops short of a full step's tokens).

        Under a queue a slot's every step costs a step's time, and each request pays such
        steps however fast it decodes: a larger k finishes requests in fewer steps but still
        pays them, each priced at its dearer step. A step's expected tokens alone leave that
        out: at batch 64 (`spectrio bench`'s 384 requests of 128 tokens) k = 4 emitted 1.164x
        the tokens of k = 3 a step where acceptance gave 1.189 (k = 3 over 2: 1.223 and
        1.254), so a pair of k read level by step times ran 2-3% apart on throughput."""
        self._overhead_slots.add(max(0.0, overhead_slots), self.occupancy_decay)
        self._emitted.add(max(0, tokens), self.occupancy_decay)

    def overhead_per_token(self) -> float:
        """Slot-steps lost while requests waited, per token emitted (both decayed at
        ``occupancy_decay`` a step: without a queue it fades towards 0)."""
        emitted = self._emitted.value
        return self._overhead_slots.value / emitted if emitted > 0 else 0.0

    def observe_step(
        self,
        num_seqs: int,
        k: int,
        seconds: float,
        previous_k: int | None = None,
        extra_rows: tuple[int, int] = (0, 0),
    ) -> None:
        """Wall time of a step that ran ``k`` drafts for ``num_seqs`` decoding sequences
        (filed under their bucket, scaled to its full size). ``previous_k``, the k of the
        step before it: a step's MTP pass first catches up on the rows the step before
        accepted, so a step's time carries the catch-up of the k before it, and two
        steps are compared only when the steps before them ran the same k. Compared
        regardless, the step of k after a probe of k - 1 carried the probe's smaller
        catch-up against the probe's larger one (of the k before it), which read k - 1
        dearer against k than it is, every probe the same way. ``extra_rows``: the step's
        target prompt rows and MTP catch-up rows beyond ``k_max + 1`` a sequence; their
        learnt cost (:class:`_ExtraRowCost`) is taken off, and a step whose extra rows'
        cost is not known yet, or is more than half of it, is not timed."""
        if num_seqs <= 0 or not 0 <= k <= self.k_max:
            return
        bucket = batch_bucket(num_seqs)
        seen = self._bucket_steps[bucket] = self._bucket_steps.get(bucket, 0) + 1
        if seen <= self.warmup_steps:
            return
        scaled = scale_to_bucket(seconds, num_seqs, bucket)
        extra = self._extra.setdefault(bucket, _ExtraRowCost())
        extra.add(k, previous_k, extra_rows, scaled)
        if any(extra_rows):
            cost = extra.cost(extra_rows)
            if cost is None or cost > 0.5 * scaled:
                return
            scaled -= cost
        times = self._times.setdefault(bucket, _BucketTimes(self.window, self.pair_window))
        times.add(k, scaled, previous_k)

    def export_timings(self) -> dict[str, Any]:
        """Everything this policy learnt about the machine (not the workload: acceptance
        stays out), as JSON-ready data for :meth:`import_timings` in a later run."""
        buckets: dict[str, Any] = {}
        for bucket, times in self._times.items():
            entry: dict[str, Any] = times.export()
            extra = self._extra.get(bucket)
            learnt = None if extra is None else extra.export()
            if learnt is not None and any(learnt["samples"]):
                entry["extra"] = learnt
            if entry["pairs"] or entry["times"] or "extra" in entry:
                buckets[str(bucket)] = entry
        return {"k_max": self.k_max, "buckets": buckets}

    def import_timings(self, data: dict[str, Any]) -> None:
        """Start from an earlier run's :meth:`export_timings`. Raises ``ValueError`` on
        data of another shape or another ``k_max``; nothing is changed then."""
        if data.get("k_max") != self.k_max:
            raise ValueError(f"timings are for k_max={data.get('k_max')}, not {self.k_max}")
        parsed: list[tuple[int, dict[int, list[float]], dict[int, float], Any]] = []
        try:
            for key, entry in dict(data["buckets"]).items():
                bucket = int(key)
                if bucket < 1 or bucket & (bucket - 1):
                    raise ValueError(f"bucket {bucket} is not a power of two")
                pairs = {
                    int(k): [float(x) for x in v]
                    for k, v in dict(entry.get("pairs", {})).items()
                    if 0 <= int(k) < self.k_max
                }
                times = {
                    int(k): float(t)
                    for k, t in dict(entry.get("times", {})).items()
                    if 0 <= int(k) <= self.k_max and float(t) > 0
                }
                extra = entry.get("extra")
                if extra is not None:
                    extra = (
                        [[float(x) for x in extra["samples"][kind]] for kind in (0, 1)],
                        [int(extra["reach"][kind]) for kind in (0, 1)],
                    )
                parsed.append((bucket, pairs, times, extra))
        except (KeyError, TypeError, IndexError, AttributeError) as exc:
            raise ValueError(f"malformed timings: {exc!r}") from exc
        for bucket, pairs, times, extra in parsed:
            self._times.setdefault(bucket, _BucketTimes(self.window, self.pair_window)).seed(
                pairs, times
            )
            if extra is not None:
                self._extra.setdefault(bucket, _ExtraRowCost()).seed(*extra)

    # ---- decision ---------------------------------------------------------------------

    def acceptance(self) -> list[float]:
        """Conditional acceptance per draft position, each shrunk towards the one before
        (the first towards ``prior_acceptance``) by ``prior_weight`` pseudo-observations."""
        out: list[float] = []
        prior, w0 = self.prior_acceptance, self.prior_weight
        for r in self._reached:
            total = r.weight + w0
            prior = (r.value + w0 * prior) / total if total > 0 else prior
            out.append(prior)
        return out

    def step_times(self) -> dict[tuple[int, int], float]:
        """Estimated step time per (batch bucket, k) (see the module docstring)."""
        return {
            (bucket, k): t
            for bucket, times in self._times.items()
            for k, t in times.estimates().items()
        }

    def expected_tokens(self, k: int) -> float:
        """Tokens one sequence emits per step with ``k`` drafts."""
        return self._expected_tokens_all()[k]

    def _expected_tokens_all(self) -> list[float]:
        """Expected tokens per sequence for k = 0..k_max, from one pass over the
        acceptance (choose() runs every step, on the scheduler's thread)."""
        out, total, run = [1.0], 1.0, 1.0
        for a in self.acceptance():
            run *= a
            total += run
            out.append(total)
        return out

    def choose(self, num_seqs: int) -> int:
        """Drafts per sequence for a step with ``num_seqs`` decoding sequences."""
        if not self.adaptive or self.k_max == 0 or num_seqs <= 0:
            return self.k_max
        k = self._choose(num_seqs)
        if self._first_position_seen < self.acceptance_warmup:
            # Where nothing is timed yet, the choice was k_max already (exploration
            # starts there): a cold run is not changed.
            k, self._probing = self.k_max, None
        for r in self._reached[k:]:  # the positions this step does not draft
            r.value *= self.stale_decay
            r.weight *= self.stale_decay
        return k

    def _choose(self, num_seqs: int) -> int:
        self._num_choices += 1
        bucket = batch_bucket(num_seqs)
        if self._probing is not None and self._probing[0] == bucket:
            # A probe runs twice: its first step carries the catch-up of the k before it
            # and is not timed (observe_step), the second is.
            k, self._probing = self._probing[1], None
            return k
        self._probing = None
        times = self._estimated_times(bucket)
        tokens = self._expected_tokens_all()
        overhead = self.overhead_per_token()

        def rate(k: int) -> float:
            # Per token a sequence spends 1 / tokens[k] decode steps and ``overhead`` lost
            # ones (observe_occupancy), all at this k's step time.
            return tokens[k] / ((1.0 + overhead * tokens[k]) * times[k])

        # Explore downwards from k_max while each smaller k does better (the rate is
        # unimodal in k): at batch 1 the k below the best is timed, and k = 0 is not. A k
        # borrowed from a neighbouring batch size needs no step of its own. Above a known
        # pair whose smaller k does better (kept times may cover only the k around the
        # best), every k is worse, so exploration starts there.
        top = next(
            (
                j
                for j in range(self.k_max)
                if j in times and j + 1 in times and rate(j) > rate(j + 1)
            ),
            self.k_max,
        )
        for k in range(top, -1, -1):
            if k not in times:
                return k
            if k < top and rate(k) < rate(k + 1):
                break
        best = max(times, key=rate)
        if self._num_choices % self.probe_every == 0:
            # Re-measure the neighbour of the best timed longest ago (ties: the larger,
            # which also measures the next position's acceptance), so one unlucky early
            # timing (or a borrowed one) cannot keep a good k out of use for good, and
            # both neighbours' estimates stay current.
            timed = self._times.get(bucket)

            def last(k: int) -> int:
                return timed.last(k) if timed is not None else 0

            near = [k for k in (best - 1, best + 1) if 0 <= k <= self.k_max]
            probe = min(near, key=lambda k: (last(k), -k))
            settled = (
                timed is not None
                and probe in times
                and timed.settled(min(best, probe), abs(math.log(rate(best) / rate(probe))))
            )
            if settled and (self._num_choices // self.probe_every) % 2 == 1:
                return best  # a neighbour clearly behind is probed half as often
            self._probing = (bucket, probe)
            return probe
        return best

    def _estimated_times(self, bucket: int) -> dict[int, float]:
        """Step time per k for this batch bucket: its own where timed; otherwise borrowed
        from a bucket next to it (twice or half the size) that timed it, scaled by the
        two buckets' ratio on the k both timed (unscaled when they share none: then only
        the argmax is used, which the scale does not move). A batch that shrinks through
        the buckets at the end of a run (16, 8, 4, 2, 1 running sequences) would
        otherwise spend its last steps re-timing k = 3, 2 and 1 in each: traced at batch
        16, 15 of the last 23 steps."""
        own = self._timed(bucket)
        if len(own) == self.k_max + 1:
            return own
        # Only from a bucket twice or half the size: the cost of a draft relative to the
        # step grows with the batch, so a farther one would mislead (batch 1's nearly
        # free drafts would keep batch 16 at k_max untested).
        others = sorted(
            {
                b
                for b, t in self._times.items()
                if t.warm and abs(b.bit_length() - bucket.bit_length()) == 1
            },
            key=lambda b: -b,  # the larger first: it is the one a shrinking batch just left
        )
        for source in others:
            theirs = self._timed(source)
            shared = [k for k in own if k in theirs]
            scale = sum(own[k] / theirs[k] for k in shared) / len(shared) if shared else 1.0
            if own and not shared:
                continue  # nothing to scale by: mixing the two would compare apples with pears
            return {**{k: t * scale for k, t in theirs.items()}, **own}
        return own

    def _timed(self, bucket: int) -> dict[int, float]:
        """The bucket's own step-time estimate of every k timed past its warm-up step."""
        times = self._times.get(bucket)
        return {} if times is None else times.estimates()
