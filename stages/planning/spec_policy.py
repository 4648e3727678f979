"""Adaptive speculation: how many drafts a step should propose, from 0 to k.

Pure logic: no Trio, no device, no clock. The scheduler asks :meth:`SpecPolicy.choose`
once per step with the number of decoding sequences, and feeds back what happened
(:meth:`observe_acceptance` per sequence, :meth:`observe_step` and
:meth:`observe_occupancy` per step). Output never depends on the choice: acceptance is
lossless for any k, so the policy only changes speed.

The rule: pick the k that maximises expected tokens per second,

    rate(k, B) = E[tokens | k] / ((1 + o * E[tokens | k]) * T(B, k))

* ``E[tokens | k] = 1 + sum_{j=1..k} prod_{i<=j} a_i``, where ``a_i`` is the measured
  probability that draft i is accepted given that drafts 1..i-1 were, counted over every
  sequence that reached position i with exponential forgetting, and shrunk towards the
  position before it (``prior_weight`` pseudo-observations; position 1 towards
  ``prior_acceptance``): a deep position is seen only on steps that draft that far. A
  position a step that drafts does not reach forgets at ``stale_decay`` a step, so a stretch of
  rejections does not outlive the request that caused it.
* ``o`` is the slot-steps the batch lost while requests waited for a slot (prefill
  steps, unplanned slots, a request's last short step) per token emitted
  (:meth:`observe_occupancy`); without a queue it fades to 0. A request pays them
  whatever k is, at k's step time.
* ``T(B, k)`` is the measured step time with ``B`` decoding sequences in the same
  power-of-two bucket, each timing scaled to the bucket's full size
  (:func:`scale_to_bucket`). The machine's speed drifts, so k are compared only where
  they ran beside each other (:class:`BucketTimes`): neighbouring k form pairs whose
  median log-ratio, chained from the k run last, gives every k's time. Only a step that
  follows a step of its own k is timed (a step's MTP pass catches up on the rows the
  step before accepted, so the step after a switch carries the other k's work), and a
  step's prompt or catch-up rows are taken off at their learnt cost
  (:class:`ExtraRowCost`).

When no request waits for a slot the batch can only shrink, and a run's end matters as
much as its steps: speculation lets the requests that accept more finish first, and the
rest drain in small steps that cost more per token. The scheduler then passes every
decoding sequence's remaining tokens and own acceptance, and the rate becomes the rest of
the run's tokens over the time to emit them all (:meth:`SpecPolicy.closing_rate`); at
batch 1 it equals the steady rate.

Invariants of the search:

* A run drafts ``k_max`` until the first draft position has been seen
  ``acceptance_warmup`` times, whatever kept times say.
* Exploration times k = 1, 2 and 0 first (from a bucket's first ``warmup_steps``, which
  are untimed), then climbs or descends one k at a time from the best while the next k
  has no estimate (:meth:`SpecPolicy._explore`): the cheap k come first, so a batch where
  speculation does not pay loses little to finding that out. Each k runs twice, its
  first step untimed. A bucket not timed yet borrows a neighbouring bucket's times, and
  one started from kept times only extends them to the best's neighbours.
* Afterwards one step in ``probe_every`` (``early_probe_every`` while a pair of the best
  with a neighbour holds fewer than ``early_samples`` samples) starts a two-step probe
  of the best k's neighbour timed longer ago; a neighbour more than 3 standard errors behind
  (:meth:`BucketTimes.settled`) is probed half as often. Only neighbours are ever
  tried: above k = 0 the rate is unimodal in k, so a better k is reachable one step at
  a time.

What the policy learnt about the machine (pair samples, step times, extra-row costs; not
acceptance, which belongs to the requests) leaves and enters as JSON-ready data
(:meth:`SpecPolicy.export_timings`, :meth:`SpecPolicy.import_timings`), which the
runtime keeps between runs (:mod:`spectrio.runtime.timing_cache`): a bucket started from
kept times has an estimate for every k they cover and does not explore again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from spectrio.stages.planning.step_times import (
    STEP_FIXED_SEQS,
    BucketTimes,
    Decayed,
    ExtraRowCost,
    batch_bucket,
    scale_to_bucket,
)

__all__ = ["Remaining", "SpecPolicy", "batch_bucket", "scale_to_bucket"]


@dataclasses.dataclass(frozen=True)
class Remaining:
    """A decoding sequence, for the choice when no request waits (:meth:`SpecPolicy.
    closing_rate`): the tokens it may still emit, and its own first drafts so far."""

    tokens: int
    first_drafted: int = 0
    first_accepted: int = 0


class SpecPolicy:
    """Chooses drafts per step. ``adaptive=False`` always returns ``k_max`` (fixed k)."""

    def __init__(
        self,
        k_max: int,
        *,
        adaptive: bool = True,
        probe_every: int = 24,
        early_probe_every: int = 8,
        early_samples: int = 4,
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
        if early_probe_every < 1:
            raise ValueError(f"early_probe_every must be >= 1, got {early_probe_every}")
        self.early_probe_every = early_probe_every
        self.early_samples = early_samples
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        if pair_window < 1:
            raise ValueError(f"pair_window must be >= 1, got {pair_window}")
        self.pair_window = pair_window
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        # The first decode steps at a batch size run slower than the rest whatever k is;
        # timed, they would make the k tried first (k_max) look dearer than it is.
        self.warmup_steps = warmup_steps
        self._bucket_steps: dict[int, int] = {}
        # Acceptance is counted per sequence, so at batch B a step brings B observations;
        # a slow forgetting keeps its estimate steady at any batch size.
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
        # tokens are the prior's (0.5 a position), under which one draft looks best, so a
        # run started from kept step times would choose by them alone. k_max observes
        # every position at once.
        self.acceptance_warmup = acceptance_warmup
        self._first_position_seen = 0
        if not 0.0 < occupancy_decay <= 1.0:
            raise ValueError(f"occupancy_decay must be in (0, 1], got {occupancy_decay}")
        self.occupancy_decay = occupancy_decay
        self._overhead_slots = Decayed()  # .value: slot-steps lost while requests waited
        self._emitted = Decayed()  # .value: tokens emitted, every step
        self._reached = [Decayed() for _ in range(k_max)]  # per draft position
        self._times: dict[int, BucketTimes] = {}  # per batch bucket
        self._extra: dict[int, ExtraRowCost] = {}  # per batch bucket
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
        pays them, each priced at its dearer step; a step's expected tokens alone leave that
        out."""
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
        learnt cost (:class:`ExtraRowCost`) is taken off, and a step whose extra rows'
        cost is not known yet, or is more than half of it, is not timed."""
        if num_seqs <= 0 or not 0 <= k <= self.k_max:
            return
        bucket = batch_bucket(num_seqs)
        seen = self._bucket_steps[bucket] = self._bucket_steps.get(bucket, 0) + 1
        if seen <= self.warmup_steps:
            return
        scaled = scale_to_bucket(seconds, num_seqs, bucket)
        extra = self._extra.setdefault(bucket, ExtraRowCost())
        extra.add(k, previous_k, extra_rows, scaled)
        if any(extra_rows):
            cost = extra.cost(extra_rows)
            if cost is None or cost > 0.5 * scaled:
                return
            scaled -= cost
        times = self._times.setdefault(bucket, BucketTimes(self.window, self.pair_window))
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
            self._times.setdefault(bucket, BucketTimes(self.window, self.pair_window)).seed(
                pairs, times
            )
            if extra is not None:
                self._extra.setdefault(bucket, ExtraRowCost()).seed(*extra)

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

    def choose(self, num_seqs: int, closing: Sequence[Remaining] | None = None) -> int:
        """Drafts per sequence for a step with ``num_seqs`` decoding sequences.

        ``closing``, one entry per decoding sequence, is given when no request waits for
        a slot: the batch then only shrinks, and the choice weighs the time to finish
        every running request, its drain included (:meth:`closing_rate`)."""
        if not self.adaptive or self.k_max == 0 or num_seqs <= 0:
            return self.k_max
        k = self._choose(num_seqs, closing)
        if self._first_position_seen < self.acceptance_warmup:
            # Every position is observed at once, whatever the times say: one step at
            # a large batch, acceptance_warmup steps at batch 1.
            k, self._probing = self.k_max, None
        # The positions this step does not draft forget, so that rejections at a deep
        # position do not outlive the request that caused it. Not while no step drafts
        # at all: position 1 would then fade to the prior, and a head whose acceptance is
        # below the prior would look worth drafting again every few dozen steps (the
        # policy swung between k = 0 and k_max); the probes of k = 1 keep position 1
        # current instead.
        if k > 0:
            for r in self._reached[k:]:
                r.value *= self.stale_decay
                r.weight *= self.stale_decay
        return k

    def closing_rate(
        self, k: int, step_seconds: float, closing: Sequence[Remaining], tokens: list[float]
    ) -> float:
        """Tokens per second over the rest of a run that no request joins, if every
        step from now on drafts ``k`` (a step of a full bucket takes ``step_seconds``).

        Sequence ``i`` still has ``r_i`` tokens to emit and emits ``mu_i`` a step: the
        batch's expected tokens at k (``tokens``), their gain over one token scaled by
        the sequence's own first-draft acceptance against the batch's (shrunk towards it
        by ``prior_weight`` pseudo-observations). It needs ``s_i = max(1, r_i / mu_i)``
        more steps, and a step with ``b`` sequences left costs ``(F + b) / (F + B)`` of a
        full one (:data:`STEP_FIXED_SEQS`), so the rest of the run costs
        ``(F * max_i s_i + sum_i s_i)`` units of ``step_seconds / (F + B)``. The
        difference from the steady rate is the drain: requests that accept more finish
        first and leave the others to run in small, dearer-per-token steps, which no
        step's own tokens per second shows (at batch 1 both rates are the same)."""
        return self._closing_rate(k, step_seconds, self._closing_shares(closing), tokens)

    def _closing_shares(
        self, closing: Sequence[Remaining]
    ) -> tuple[float, list[tuple[int, float]]]:
        """The batch's first-draft acceptance, and each sequence's remaining tokens with
        its own (shrunk towards the batch's): what :meth:`closing_rate` weighs, the same
        for every k of one choice."""
        first = self.acceptance()[0] if self.k_max else 0.0
        w = self.prior_weight
        own = [
            (
                r.tokens,
                (r.first_accepted + w * first) / (r.first_drafted + w)
                if r.first_drafted + w
                else first,
            )
            for r in closing
        ]
        return first, own

    @staticmethod
    def _closing_rate(
        k: int,
        step_seconds: float,
        shares: tuple[float, list[tuple[int, float]]],
        tokens: list[float],
    ) -> float:
        first, own = shares
        gain = tokens[k] - 1.0
        longest = total_steps = remaining = 0.0
        for left, acceptance in own:
            mu = 1.0 + (gain * acceptance / first if first > 1e-9 else gain)
            steps = max(1.0, left / mu)
            longest = max(longest, steps)
            total_steps += steps
            remaining += left
        return remaining / (step_seconds * (STEP_FIXED_SEQS * longest + total_steps))

    def _choose(self, num_seqs: int, closing: Sequence[Remaining] | None) -> int:
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
        if closing is not None and len(closing) < 2:
            closing = None  # one sequence: the closing rate is the steady one
        shares = None if closing is None else self._closing_shares(closing)
        rates = {
            k: (
                self._closing_rate(k, t, shares, tokens)
                if shares is not None
                # Per token a sequence spends 1 / tokens[k] decode steps and ``overhead``
                # lost ones (observe_occupancy), all at this k's step time.
                else tokens[k] / ((1.0 + overhead * tokens[k]) * t)
            )
            for k, t in times.items()
        }
        timed = self._times.get(bucket)
        fresh = (timed is None or not timed.kept) and times.keys() <= self._timed(bucket).keys()
        explore = self._explore(rates, fresh)
        if explore is not None:
            return explore
        best = max(rates, key=rates.__getitem__)
        near = [k for k in (best - 1, best + 1) if 0 <= k <= self.k_max]
        # Until the best's pairs with its neighbours hold a few samples each, a choice
        # rests on one or two steps' timings, and a spike in either picks the wrong k
        # for a whole short run: probes come every ``early_probe_every`` steps then.
        young = timed is not None and any(
            timed.samples(min(best, k)) < self.early_samples for k in near
        )
        every = self.early_probe_every if young else self.probe_every
        if self._num_choices % every == 0:
            # Re-measure the neighbour of the best timed longest ago (ties: the larger,
            # which also measures the next position's acceptance), so one unlucky early
            # timing (or a borrowed one) cannot keep a good k out of use for good, and
            # both neighbours' estimates stay current.

            def last(k: int) -> int:
                return timed.last(k) if timed is not None else 0

            probe = min(near, key=lambda k: (last(k), -k))
            settled = (
                timed is not None
                and probe in rates
                and timed.settled(min(best, probe), abs(math.log(rates[best] / rates[probe])))
            )
            if settled and (self._num_choices // every) % 2 == 1:
                return best  # a neighbour clearly behind is probed half as often
            self._probing = (bucket, probe)
            return probe
        return best

    def _explore(self, rates: dict[int, float], fresh: bool) -> int | None:
        """The next k to time, or None when every k worth timing has an estimate.

        A bucket with nothing kept or borrowed (``fresh``) times k = 1, 2 and 0 first.
        One draft a sequence is cheap at any batch size, so where speculation does not
        pay (a large batch on a CPU) little is lost finding that out, where starting at
        k_max would run the dearest steps first. k = 0 is timed beside k = 1 and 2
        because the rate need not be unimodal there: a step of one row per sequence and
        a step of several can run different kernels, so k = 1 can do worse than both
        neighbours and hide a k = 0 that beats every k. Above k = 0 the rate is unimodal,
        so afterwards exploration climbs (or descends) one k at a time from the best
        while the next one has no estimate: a kept or borrowed estimate counts, and a
        better k is always a neighbour of the best."""
        if fresh:
            for k in (1, 2, 0):
                if k <= self.k_max and k not in rates:
                    return k
        if not rates:
            return min(1, self.k_max)
        best = max(rates, key=rates.__getitem__)
        for k in (best + 1, best - 1):
            if 0 <= k <= self.k_max and k not in rates:
                return k
        return None

    def _estimated_times(self, bucket: int) -> dict[int, float]:
        """Step time per k for this batch bucket: its own where timed; otherwise borrowed
        from a bucket next to it (twice or half the size) that timed it, scaled by the
        two buckets' ratio on the k both timed (unscaled when they share none: then only
        the argmax is used, which the scale does not move), so a batch that shrinks through
        the buckets at the end of a run does not spend its last steps re-timing every k."""
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
