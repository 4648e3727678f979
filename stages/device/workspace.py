"""The rank's workspace: the model, the target's paged cache, and the draft side (the
configured proposer with its own device state, the token history it reads, and the
grammar state of constrained sequences).

It holds state and hands it out by seq id; the work on it lives in the stages
(:mod:`.draft`, :mod:`.verify`, :mod:`.sampler`). Messages never carry its tensors.
Only the device worker thread (:mod:`spectrio.runtime.device_worker`) touches it.
"""

from __future__ import annotations

import time

import numpy as np

from spectrio.core.config import SpeculativeConfig
from spectrio.core.messages import StepPlan, StepResult
from spectrio.models import PackedBatch, PagedKVCache, SpectrioForCausalLM
from spectrio.models.ops.paddle_setup import paddle, use_configured_threads
from spectrio.stages.device.draft import Proposer, TokenHistory, make_proposer
from spectrio.stages.device.grammar import GrammarCompiler
from spectrio.stages.device.grammar_book import GrammarBook


class Workspace:
    def __init__(
        self,
        model: SpectrioForCausalLM,
        num_blocks: int,
        block_size: int,
        speculative: SpeculativeConfig | None = None,
        *,
        num_kv_heads: int | None = None,
        draft_model: SpectrioForCausalLM | None = None,
        grammar: GrammarCompiler | None = None,
    ) -> None:
        """``num_kv_heads``: this rank's share of the KV heads (all of them by default).
        ``draft_model``: the loaded ``speculative.draft_model``, when one is named.
        ``grammar``: structured output's compiler (None: constrained requests fail)."""
        cfg = model.config
        kvh = cfg.num_key_value_heads if num_kv_heads is None else num_kv_heads
        self.model = model
        self.block_size = block_size
        self.target_cache = PagedKVCache(
            cfg.num_hidden_layers, num_blocks, block_size, kvh, cfg.head_dim, model.dtype
        )
        # constrained sequences' grammar state (stages/device/grammar_book.py)
        self.grammar: GrammarBook | None = None if grammar is None else GrammarBook(grammar)
        self.proposer: Proposer | None = (
            None
            if speculative is None
            else make_proposer(
                speculative, model, num_blocks, block_size, kvh, draft_model, self.grammar
            )
        )
        self.history = TokenHistory()
        # slot -> the distributions the step's drafts were sampled from (Proposal.draft_probs)
        self.draft_probs: dict[int, np.ndarray] = {}
        self.forward_seconds = 0.0  # wall time inside Paddle forward calls

    @property
    def grammar_seconds(self) -> float:
        """Wall time in structured output's grammar work (the book's own clock)."""
        return 0.0 if self.grammar is None else self.grammar.seconds

    def warmup(self, num_tokens: int, max_seq_len: int) -> float:
        """Profile run: one target pass (and the proposer's, if it runs a model) over
        ``num_tokens`` rows, split into sequences of at most ``max_seq_len``. Runs before
        any request holds a block, and every later step writes a position before reading
        it, so the scratch K/V it leaves behind is never read. Returns its wall time."""
        use_configured_threads()  # run on a worker thread: OpenMP counts per thread
        cache = self.target_cache
        lens: list[int] = []
        tables: list[np.ndarray] = []
        next_block = 0
        while num_tokens > 0 and next_block < cache.num_blocks:
            n = min(max_seq_len, num_tokens, (cache.num_blocks - next_block) * self.block_size)
            blocks = -(-n // self.block_size)
            lens.append(n)
            tables.append(np.arange(next_block, next_block + blocks))
            next_block += blocks
            num_tokens -= n
        batch = PackedBatch.from_sequences([[0] * n for n in lens], [0] * len(lens), tables)
        batch.logits_indices = batch.last_rows()
        t0 = time.perf_counter()
        with self.model.step_lock, paddle.no_grad():
            out = self.model.forward(batch, cache)
            if self.proposer is not None:
                self.proposer.warmup(batch, out.hidden)
        return time.perf_counter() - t0

    def end_step(self, plan: StepPlan, result: StepResult | None = None) -> None:
        """The one place a sequence's draft-side state is dropped: at the end of each
        step, for every sequence the plan lists in ``released`` (it finished, was
        preempted or was aborted since the plan before, and the step does not run it) and
        every sequence ``result`` finished, so a finished request leaves nothing behind
        even when no step follows. A follower rank of a tensor-parallel group does not
        sample: it passes no result, and drops a finished sequence's state with the next
        plan's ``released`` (where the leader finds it gone already)."""
        ended = list(plan.released)
        if result is not None:
            ended += [r.seq_id for r in result.results if r.finish_reason is not None]
        self.release(ended)

    def release(self, seq_ids: list[int]) -> None:
        """Drop these sequences' draft-side state (unknown ids are ignored); see
        :meth:`end_step`."""
        self.history.release(seq_ids)
        if self.grammar is not None:
            self.grammar.release(seq_ids)
        if self.proposer is not None:
            self.proposer.release(seq_ids)

    def holds(self, seq_id: int) -> bool:
        """Whether the workspace keeps state for this sequence."""
        return (
            self.history.holds(seq_id)
            or (self.proposer is not None and self.proposer.holds(seq_id))
            or (self.grammar is not None and self.grammar.holds(seq_id))
        )

    @property
    def num_states(self) -> int:
        """Sequences whose state the workspace keeps (history, proposer state)."""
        return sum(1 for s in self.history.seq_ids if self.holds(s))
