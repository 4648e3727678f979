"""The scheduler's prefix caching (:class:`~.block_manager.BlockManager` with caching on)
(:class:`PrefixRules` holds the lookups and registrations) and the rules that
keep it exact and safe with steps in flight:

* **Hits.** A request being (re)admitted looks its context up (prompt, or prompt +
  output after preemption) under its :class:`~.block_manager.PrefixKey`: its cache salt,
  and lookahead 1 when its MTP KV is cached with the target's (the MTP layer's KV at a
  block's last position reads the next block's first token). The hit is whole blocks and
  at most ``length - 1`` positions, so the last context token is always computed and the
  first draft has its hidden state. It starts at ``num_computed = hit``; its first work
  carries the hit's tokens (``SeqWork.cached_ids``), so the proposer's history and MTP
  catch-up start there on every rank. A request with ``prompt_logprobs`` whose prompt
  rows are not all scored yet takes no hit beyond the rows already scored (cached
  positions are never computed, so they could not be scored), as vLLM does.
* **Registration.** A prompt block is registered only when a step's result is folded in
  and that step has written its KV: the target's for every position the step or an
  earlier one computed, and, for a sequence whose MTP KV is cached, the MTP layer's for
  the positions its catch-up covered: below a decode step's ``start_pos``, and all but
  the last row of a prompt chunk, which the proposer catches up in the chunk's own step
  (``stages/device/draft/mtp.py``). So a request that ends with its first token (``max_tokens``
  1, a client that closes) has registered its prompt blocks. A request aborted with a
  step in flight keeps its blocks until that step is folded in, registers what the step
  wrote, then frees them. A sequence preempted since the step was planned registers
  nothing from it. Every step in flight writes only at or after positions registered so
  far, so a registered block is never written again while it stays registered.
* **Waiting for a prefix.** An admitted request promises the prompt blocks it will
  register (:meth:`~.block_manager.BlockManager.promise`). The head of the queue whose
  prefix a running request is computing right now is not admitted until those blocks
  are registered (or the promise ends with its request): computing the same prefix
  twice at once would cost a whole prefill, waiting costs the steps until the first
  request's prompt chunk returns. Admission stays first in, first out, so requests
  behind it wait too.
* **Freeing with steps in flight.** Blocks are released as soon as a request is
  preempted or finished, and an aborted one's once no step in flight computes for it
  (at once with caching off; *Registration*): a block another table holds stays held, a
  registered one becomes evictable, and only an allocation that finds no free block
  evicts one and hands it out. Steps run on the device in plan order, and a step that
  may read a block (an in-flight step of its old owner, or of a request sharing it) was
  planned before the plan that reuses it, so its reads land before the new owner's
  writes; a block is never read and rewritten within one step, because an evicted block
  is no longer registered and so no request of that step shares it.
"""

from __future__ import annotations

from spectrio.core.config import SpeculativeConfig
from spectrio.core.messages import SeqWork
from spectrio.stages.planning.block_manager import BlockManager, PrefixKey
from spectrio.stages.planning.sequence import Sequence

__all__ = ["PrefixRules"]


class PrefixRules:
    """The scheduler's side of the prefix cache (module docstring): a sequence's key, its
    lookup when (re)admitted, its promise, and the registration of what a folded step
    wrote. Pure: it calls the block manager, nothing else."""

    def __init__(self, blocks: BlockManager, spec: SpeculativeConfig) -> None:
        self.blocks = blocks
        # A method with KV of its own keeps it in the target's blocks: a speculative
        # request's cached blocks carry it (under its own key), a target-only one's do not.
        self._draft_key = (
            (spec.needs.prefix_lookahead, spec.method or "") if spec.needs.draft_kv else None
        )

    def key(self, seq: Sequence) -> PrefixKey:
        if self._draft_key is None or not seq.speculative:
            return PrefixKey(seq.cache_salt)
        lookahead, draft = self._draft_key
        return PrefixKey(seq.cache_salt, lookahead, draft)

    def match(self, seq: Sequence) -> tuple[list[int], int]:
        """Cached blocks the sequence's context starts with (at most ``length - 1``
        positions: the last token is always computed), and how many more blocks running
        requests are computing now (module docstring, *Waiting for a prefix*)."""
        if not self.blocks.caching:
            return [], 0
        limit = seq.length - 1
        if seq.scoring_left:  # cached positions are not computed, so they cannot be scored
            limit = min(limit, seq.prompt_scored)
        return self.blocks.lookup(seq.tokens, self.key(seq), limit)

    def admitted_with(self, seq: Sequence, hit: int) -> None:
        """The sequence was admitted with ``hit`` positions from the cache: count the
        lookup, and promise the prompt blocks it will register."""
        if self.blocks.caching:
            self.blocks.note_lookup(seq.length, hit)
            key = self.key(seq)
            self.blocks.promise(seq.seq_id, seq.prompt_ids, key, len(seq.prompt_ids))
        seq.prefix_hit = hit
        if seq.cached_tokens is None:
            seq.cached_tokens = min(hit, len(seq.prompt_ids))

    def register(self, seq: Sequence, work: SeqWork) -> None:
        """Register the sequence's prompt blocks whose KV the folded step ``work`` (or an
        earlier one) has written: module docstring, *Registration*."""
        key = self.key(seq)
        prompt = len(seq.prompt_ids)
        if work.pending:  # planned after a sampling step: the whole prompt is behind it
            ready = prompt
        else:  # the step's rows, less those whose draft KV reads a token still to come
            ready = work.start_pos + len(work.token_ids) - key.lookahead
        self.blocks.register(seq.seq_id, seq.prompt_ids, key, min(ready, prompt))
