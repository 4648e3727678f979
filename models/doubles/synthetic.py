"""A synthetic device: a model backend that costs a chosen time and accepts drafts at
chosen rates, so a benchmark measures the runtime alone.

Select it like any model: ``--model synthetic:step_ms=10,per_row_us=20,accept=0.8,0.6,0.4``
(``RuntimeConfig(model=...)``, ``spectrio.models.load(...)``). Every key is optional:

* ``step_ms`` (10): the fixed cost ``a`` of a target forward, in milliseconds;
* ``per_row_us`` (20): the cost ``b`` per packed row, in microseconds;
* ``accept`` (0.8,0.6,0.4): the acceptance rate at draft position 1, 2, ...; positions
  past the list use its last value. The rate at position ``i`` is *conditional*: the
  share of the drafts at position ``i`` that are right, among steps whose drafts
  ``1..i-1`` were all right (a draft after a wrong one is rejected anyway);
* ``draft_cost`` (0.1): an MTP forward costs ``draft_cost * (a + b * rows)``, i.e. the
  draft layer is a tenth of the target by default (one layer against many);
* ``seed`` (0): keys every decision below; the same seed gives the same tokens;
* ``vocab`` (512): the vocabulary size, 3..4096 (the bundled tokenizer's). The default
  keeps the sampler's per-row host work small; ``vocab=4096`` accepts any text prompt.

Why a backend and not a mock: the scheduler, KV blocks, sampler, records and wire all
run for real over it; only the device is replaced, by one whose cost is exactly known.

**Cost.** Each call measures the time it has spent already (the host work: building
the outputs) and sleeps the rest of its budget, so it takes ``a + b * rows`` of wall
time (more only if the host work alone exceeds the budget) and releases the GIL for
nearly all of it, as a GPU launch does. The sleep corrects for the OS waking it late
(:class:`DeadlineSleeper`), so the typical call is exact to some tens of microseconds
(a busy machine still wakes it late now and then).

**Tokens.** A deterministic *true next token* ``T(x, p)``: the token after token ``x``
at position ``p`` (splitmix64 hash mixing of the seed, ``x`` and ``p``; never the EOS
id 0, so a request ends only on its length). The target's logits at a row whose input
is ``x`` at position ``p`` are 0 except ``+20`` at ``T(x, p)``: greedy picks ``T``, and
a sampler at temperature 1 picks it with probability ``1 - 511 e^-20`` (about
``1 - 1e-6``). So the output of any request is the ``T``-chain of its prompt.

**Drafts.** An MTP row pairs a hidden state with token ``y`` at position ``q + 1``
(the MTP layer's contract, :meth:`SpectrioForCausalLM.mtp_forward`); its logits peak
at ``T(y, q + 1)`` with probability ``accept[i]`` and at another token otherwise,
decided by a keyed hash of ``(y, q + 1, i)``. The draft position ``i`` travels in the
hidden states, as real MTP chaining does: target hidden rows carry depth 0 in column
0, and each MTP forward returns its input depth plus one, so a catch-up call (fed
target rows) drafts position 1 and each later substep the next one, however the
caller batches them.

The KV caches are allocated for real from :data:`SYNTHETIC_CONFIG` (one layer, one KV
head of width 8: tiny; ``vocab`` replaces its vocabulary size) but never read; a
forward checks every row's block table reaches its position, as the real attention
plan does. The tokenizer is the bundled model's; every id decodes to text. There is no
dense path (training, the reference generator): those raise
:class:`~spectrio.errors.ConfigError`.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from spectrio.errors import ConfigError
from spectrio.models.architecture.batch import PackedBatch
from spectrio.models.architecture.config import BUNDLED_DIR, DType, ModelConfig
from spectrio.models.architecture.kv_cache import PagedKVCache
from spectrio.models.architecture.layers import KV
from spectrio.models.architecture.model import ForwardOutput, SpectrioForCausalLM
from spectrio.models.loading.loader import LoadedModel
from spectrio.models.ops.paddle_setup import paddle
from spectrio.models.text.tokenizer import TextTokenizer

__all__ = [
    "PREFIX",
    "SYNTHETIC_CONFIG",
    "SyntheticModel",
    "SyntheticSpec",
    "is_synthetic",
    "load_synthetic",
    "parse_spec",
]

PREFIX = "synthetic"
"""A model name that is ``synthetic`` or starts with ``synthetic:`` selects this backend."""

PEAK = 20.0
"""Logit of the chosen token; every other logit is 0."""

SYNTHETIC_CONFIG = ModelConfig(
    vocab_size=512,
    hidden_size=8,
    num_hidden_layers=1,
    num_attention_heads=1,
    num_key_value_heads=1,
    intermediate_size=16,
    max_position_embeddings=32768,
    num_nextn_predict_layers=1,
    eos_token_id=0,
)
"""The shape the runtime sizes its caches and checks requests from (at the default vocab)."""

MAX_VOCAB = 4096
"""The bundled tokenizer's size: every synthetic token id must decode."""


@dataclasses.dataclass(frozen=True)
class SyntheticSpec:
    step_ms: float = 10.0
    per_row_us: float = 20.0
    accept: tuple[float, ...] = (0.8, 0.6, 0.4)
    draft_cost: float = 0.1
    seed: int = 0
    vocab: int = SYNTHETIC_CONFIG.vocab_size

    @property
    def config(self) -> ModelConfig:
        """The model config this spec serves (:data:`SYNTHETIC_CONFIG` at its vocab)."""
        if self.vocab == SYNTHETIC_CONFIG.vocab_size:
            return SYNTHETIC_CONFIG
        return dataclasses.replace(SYNTHETIC_CONFIG, vocab_size=self.vocab)

    def target_seconds(self, rows: int) -> float:
        """Wall time of a target forward over ``rows`` packed rows."""
        return self.step_ms / 1e3 + self.per_row_us / 1e6 * rows

    def draft_seconds(self, rows: int) -> float:
        """Wall time of one MTP forward over ``rows`` packed rows."""
        return self.draft_cost * self.target_seconds(rows)

    def accept_at(self, depth: int) -> float:
        """Acceptance rate of draft position ``depth + 1`` (0-based depth)."""
        return self.accept[min(depth, len(self.accept) - 1)]


def is_synthetic(name: str | Path) -> bool:
    """Whether a model name selects the synthetic backend."""
    return isinstance(name, str) and (name == PREFIX or name.startswith(PREFIX + ":"))


def _number(key: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"model: synthetic key {key}: not a number: {raw!r}") from None
    if not np.isfinite(value) or value < 0:
        raise ConfigError(f"model: synthetic key {key}: must be finite and >= 0, got {raw!r}")
    return value


def parse_spec(name: str) -> SyntheticSpec:
    """``synthetic[:key=value,...]`` as a :class:`SyntheticSpec`.

    ``accept`` takes a comma-separated list, so a comma-separated item without ``=``
    continues the list of the key before it (only ``accept`` takes several values).
    Unknown, repeated, empty or out-of-range keys raise :class:`ConfigError` naming it.
    """
    if not is_synthetic(name):
        raise ConfigError(f"model: {name!r} is not a synthetic model spec ('{PREFIX}:...')")
    body = name[len(PREFIX) + 1 :]
    fields = {f.name for f in dataclasses.fields(SyntheticSpec)}
    values: dict[str, list[str]] = {}
    last: str | None = None
    for item in body.split(",") if body else []:
        if "=" in item:
            key, _, raw = item.partition("=")
            key = key.strip()
            if key not in fields:
                raise ConfigError(
                    f"model: unknown synthetic key {key!r} (keys: {', '.join(sorted(fields))})"
                )
            if key in values:
                raise ConfigError(f"model: synthetic key {key} given twice")
            values[key] = [raw.strip()]
            last = key
        elif last == "accept":
            values["accept"].append(item.strip())
        elif last is not None:
            raise ConfigError(
                f"model: synthetic key {last} takes one value, got another: {item!r} "
                f"(only accept takes a comma-separated list)"
            )
        else:
            raise ConfigError(
                f"model: synthetic spec item {item!r} is not key=value "
                f"(only accept takes a comma-separated list)"
            )
    kwargs: dict[str, object] = {}
    for key, raws in values.items():
        if any(not r for r in raws):
            raise ConfigError(f"model: synthetic key {key}: empty value")
        if key == "accept":
            rates = tuple(_number(key, r) for r in raws)
            if any(r > 1 for r in rates):
                raise ConfigError(f"model: synthetic key accept: rates must be in [0, 1]: {rates}")
            kwargs[key] = rates
        elif key in ("seed", "vocab"):
            try:
                value = int(raws[0])
            except ValueError:
                raise ConfigError(
                    f"model: synthetic key {key}: not an integer: {raws[0]!r}"
                ) from None
            lo, hi = (0, 2**63 - 1) if key == "seed" else (3, MAX_VOCAB)
            if not lo <= value <= hi:
                raise ConfigError(f"model: synthetic key {key}: must be in {lo}..{hi}: {raws[0]}")
            kwargs[key] = value
        else:
            kwargs[key] = _number(key, raws[0])
    return SyntheticSpec(**kwargs)  # type: ignore[arg-type]


# ---- keyed hashing (vectorised splitmix64; uint64 arithmetic wraps) -------------------

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_TRUE, _DRAW, _WRONG = (np.uint64(v) for v in (1, 2, 3))


def _mix(z: np.ndarray) -> np.ndarray:
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _hash(seed: int, purpose: np.uint64, *parts: np.ndarray) -> np.ndarray:
    """A 64-bit hash of ``(seed, purpose, parts...)``, element-wise over the parts."""
    with np.errstate(over="ignore"):
        h = _mix(np.full(np.shape(parts[0]), np.uint64(seed) ^ (purpose << np.uint64(56))))
        for part in parts:
            h = _mix(h ^ np.asarray(part).astype(np.uint64))
    return h


def true_next(seed: int, tokens: np.ndarray, positions: np.ndarray, vocab: int) -> np.ndarray:
    """``T(x, p)``: the token after ``tokens`` at ``positions``, in ``1..vocab-1``."""
    h = _hash(seed, _TRUE, tokens, positions)
    return (np.uint64(1) + h % np.uint64(vocab - 1)).astype(np.int64)


def draft_tokens(
    spec: SyntheticSpec, tokens: np.ndarray, positions: np.ndarray, depth: np.ndarray, vocab: int
) -> np.ndarray:
    """The MTP proposal after ``tokens`` at ``positions`` (the draft's own position is
    one later) for draft depth ``depth`` (0-based): ``T`` with probability
    ``accept[depth]``, else another non-EOS token, both keyed on ``(token, pos, depth)``."""
    truth = true_next(spec.seed, tokens, positions, vocab)
    u = (_hash(spec.seed, _DRAW, tokens, positions, depth) >> np.uint64(11)).astype(
        np.float64
    ) * 2.0**-53
    rates = np.asarray([spec.accept_at(int(d)) for d in range(int(depth.max(initial=0)) + 1)])
    right = u < rates[depth]
    # Another token of 1..vocab-1: shift T by 1..vocab-2 within that range.
    shift = np.uint64(1) + _hash(spec.seed, _WRONG, tokens, positions, depth) % np.uint64(vocab - 2)
    wrong = ((truth - 1).astype(np.uint64) + shift) % np.uint64(vocab - 1) + np.uint64(1)
    return np.where(right, truth, wrong.astype(np.int64))


def true_chain(
    prompt: list[int], num_tokens: int, seed: int = 0, vocab: int = SYNTHETIC_CONFIG.vocab_size
) -> list[int]:
    """The ``num_tokens`` tokens greedy decoding produces after ``prompt`` (no EOS)."""
    out: list[int] = []
    x, p = prompt[-1], len(prompt) - 1
    for _ in range(num_tokens):
        x = int(true_next(seed, np.asarray([x]), np.asarray([p]), vocab)[0])
        p += 1
        out.append(x)
    return out


# ---- the model -----------------------------------------------------------------------


def _check_tables(batch: PackedBatch, block_size: int) -> None:
    last = batch.positions[batch.last_rows()]
    lens = np.asarray([len(t) for t in batch.block_tables])
    short = np.flatnonzero(last // block_size >= lens)
    if short.size:
        i = int(short[0])
        raise ValueError(
            f"block table of {lens[i]} blocks cannot hold position {last[i]} "
            f"(block_size={block_size})"
        )


class DeadlineSleeper:
    """Sleeps (GIL released) until a ``perf_counter()`` deadline, on average exactly.

    ``time.sleep`` wakes late by the OS's timer slack and scheduling (a few percent of
    a 2 ms step), so each sleep is shortened by a running estimate of that
    lateness. A single call may end some tens of microseconds early or late; the median
    is the deadline. No spinning: a waiting device costs no CPU, which
    the runtime's own threads need."""

    def __init__(self) -> None:
        self.late = 0.0  # estimated oversleep in seconds (exponential moving average)

    def wait_until(self, deadline: float) -> None:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            return
        time.sleep(max(0.0, remaining - self.late))
        error = time.perf_counter() - deadline  # > 0: late
        # Clipped, so one descheduled wake-up (milliseconds late) cannot skew the estimate.
        self.late = min(max(self.late + 0.1 * min(max(error, -2e-4), 2e-4), 0.0), 1e-3)


class SyntheticModel(SpectrioForCausalLM):
    """:class:`SpectrioForCausalLM`'s serving interface (``config``, ``dtype``,
    ``forward``, ``mtp_forward``) over a known cost and known acceptance; see the
    module docstring. It subclasses the real model so everything typed for one takes
    it; its (tiny, random) weights only give ``dtype`` and are never used."""

    def __init__(self, spec: SyntheticSpec, dtype: DType = "float32") -> None:
        super().__init__(spec.config)
        if dtype not in ("float32", "float64"):
            raise ConfigError(f"dtype: must be 'float32' or 'float64', got {dtype!r}")
        if dtype != "float32":
            self.to(dtype=dtype)
        self.eval()
        self.spec = spec
        self._np_dtype = np.dtype(dtype)
        self._sleeper = DeadlineSleeper()
        self.num_target_calls = 0
        self.num_draft_calls = 0

    def _logits(self, picks: np.ndarray) -> paddle.Tensor:
        out = np.zeros((picks.size, self.config.vocab_size), dtype=self._np_dtype)
        out[np.arange(picks.size), picks] = PEAK
        return paddle.to_tensor(out)

    def _hidden(self, depth: np.ndarray) -> paddle.Tensor:
        out = np.zeros((depth.size, self.config.hidden_size), dtype=self._np_dtype)
        out[:, 0] = depth
        return paddle.to_tensor(out)

    @staticmethod
    def _rows(batch: PackedBatch) -> np.ndarray:
        if batch.logits_indices is None:
            return np.arange(batch.num_tokens)
        return batch.logits_indices

    def forward(
        self, batch: PackedBatch, cache: PagedKVCache, num_layers: int | None = None
    ) -> ForwardOutput:
        """Target pass: logits peak at ``T(x, p)``; hidden rows carry draft depth 0. It
        has no layers to cut, so ``num_layers`` changes nothing."""
        t0 = time.perf_counter()
        _check_tables(batch, cache.block_size)
        rows = self._rows(batch)
        picks = true_next(
            self.spec.seed,
            batch.input_ids[rows],
            batch.positions[rows],
            self.config.vocab_size,
        )
        out = ForwardOutput(
            logits=self._logits(picks),
            hidden=self._hidden(np.zeros(batch.num_tokens, dtype=np.int64)),
        )
        self.num_target_calls += 1
        self._sleeper.wait_until(t0 + self.spec.target_seconds(batch.num_tokens))
        return out

    def mtp_forward(
        self,
        batch: PackedBatch,
        prev_hidden: paddle.Tensor,
        cache: PagedKVCache,
        draft_vocab: bool = False,
    ) -> ForwardOutput:
        """MTP pass (over the whole vocabulary: the device has no draft vocabulary): row
        ``r`` holds the token at ``positions[r] + 1``; its logits peak at the draft for
        the position after, at depth ``prev_hidden[r, 0]``."""
        t0 = time.perf_counter()
        _check_tables(batch, cache.block_size)
        depth = np.rint(prev_hidden[:, 0].numpy()).astype(np.int64)
        if depth.shape != (batch.num_tokens,):
            raise ValueError(f"prev_hidden has {depth.shape[0]} rows for {batch.num_tokens}")
        rows = self._rows(batch)
        picks = draft_tokens(
            self.spec,
            batch.input_ids[rows],
            batch.positions[rows] + 1,
            depth[rows],
            self.config.vocab_size,
        )
        out = ForwardOutput(logits=self._logits(picks), hidden=self._hidden(depth + 1))
        self.num_draft_calls += 1
        self._sleeper.wait_until(t0 + self.spec.draft_seconds(batch.num_tokens))
        return out

    def forward_dense(
        self, input_ids: paddle.Tensor, past: list[KV] | None = None
    ) -> tuple[paddle.Tensor, paddle.Tensor, list[KV]]:
        raise ConfigError("model: the synthetic backend serves only (no dense forward)")

    def mtp_forward_dense(
        self, next_ids: paddle.Tensor, prev_hidden: paddle.Tensor, past: KV | None = None
    ) -> tuple[paddle.Tensor, paddle.Tensor, KV]:
        raise ConfigError("model: the synthetic backend serves only (no dense forward)")


def load_synthetic(name: str, dtype: DType = "float32") -> LoadedModel:
    """The :class:`LoadedModel` for a ``synthetic:...`` name (called by ``load``)."""
    t0 = time.perf_counter()
    spec = parse_spec(name)
    model = SyntheticModel(spec, dtype)
    tokenizer = TextTokenizer.from_file(
        BUNDLED_DIR / "tokenizer.json", eos_token_id=SYNTHETIC_CONFIG.eos_token_id
    )
    return LoadedModel(
        model=model,
        config=model.config,
        tokenizer=tokenizer,
        path=Path(name),
        load_seconds=time.perf_counter() - t0,
    )
