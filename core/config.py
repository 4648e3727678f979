"""Runtime configuration and capacity planning (pure: no I/O, no Trio, no Paddle).

The planning rules (docs/architecture.md, *Capacity planning*):

* every speculating sequence verifies ``k + 1`` tokens per step, so the decode
  role's largest chunk is ``max_num_seqs * (k + 1)`` and
  ``max_num_batched_tokens`` must be at least that (with no speculation the
  multiplier is 1);
* graph capture sizes are a fixed base list times ``k + 1``, capped at
  ``max_num_seqs * (k + 1)``; the target runs at batch size
  ``capture_size // (k + 1)``;
* KV planning counts the MTP layer as one extra layer.

Every validation failure raises :class:`ConfigError`, whose message starts with
the offending field's name and states the rule it broke.
"""

from __future__ import annotations

import bisect
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast, overload

from spectrio.core.draft_methods import DRAFT_METHODS, DraftNeeds, needs_of
from spectrio.errors import ConfigError
from spectrio.models.architecture.config import DType

__all__ = [
    "BASE_CAPTURE_SIZES",
    "CaptureSizes",
    "ConfigError",
    "DTYPE_BYTES",
    "MAX_SPECULATIVE_TOKENS",
    "RuntimeConfig",
    "SpeculativeConfig",
    "kv_bytes_per_block",
]

MAX_SPECULATIVE_TOKENS = 5
"""Largest accepted ``num_speculative_tokens`` (k)."""

DTYPE_BYTES: dict[str, int] = {"float32": 4, "float64": 8}
"""Accepted compute dtypes and their element sizes."""

ROLES: tuple[str, ...] = ("mixed", "prefill", "decode")
SPEC_METHODS: tuple[str, ...] = tuple(DRAFT_METHODS)
"""Draft methods (``stages/device/draft/``): the checkpoint's MTP layer, prompt lookup, or a
draft model (what each needs: :mod:`spectrio.core.draft_methods`)."""


def _base_capture_sizes() -> tuple[int, ...]:
    sizes = [1, 2, 4]
    sizes += range(8, 129, 8)
    sizes += range(144, 257, 16)
    sizes += range(288, 1025, 32)
    return tuple(sizes)


BASE_CAPTURE_SIZES: tuple[int, ...] = _base_capture_sizes()
"""{1, 2, 4} ∪ {8..128 step 8} ∪ {144..256 step 16} ∪ {288..1024 step 32}, ascending."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_positive_int(name: str, value: object) -> None:
    if not _is_int(value):
        raise ConfigError(f"{name}: must be an int, got {value!r}")
    assert isinstance(value, int)
    if value < 1:
        raise ConfigError(f"{name}: must be a positive int (>= 1), got {value}")


def _require_optional_positive_int(name: str, value: object) -> None:
    if value is not None:
        _require_positive_int(name, value)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def kv_bytes_per_block(
    *,
    num_layers: int,
    num_mtp_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
) -> int:
    """Bytes one KV block takes across the target layers and the MTP layers.

    ``2 * (num_layers + num_mtp_layers) * block_size * num_kv_heads * head_dim * dtype_bytes``
    (the 2 is K and V). Raises :class:`ConfigError` on a non-positive size.
    """
    for name, value in (
        ("num_layers", num_layers),
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("dtype_bytes", dtype_bytes),
    ):
        _require_positive_int(name, value)
    if not _is_int(num_mtp_layers) or num_mtp_layers < 0:
        raise ConfigError(f"num_mtp_layers: must be a non-negative int, got {num_mtp_layers!r}")
    return 2 * (num_layers + num_mtp_layers) * block_size * num_kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings.

    ``method=None`` turns speculation off; ``num_speculative_tokens`` and
    ``num_model_steps`` are then ignored (and not range-checked), and every
    sequence verifies one token per step.

    ``adaptive=True`` (the default) lets each step draft anywhere from 0 to
    ``num_speculative_tokens`` tokens per sequence, whichever the measured acceptance
    and step times say is fastest (:mod:`spectrio.stages.planning.spec_policy`); ``False`` always
    drafts the full k. Capacity planning always assumes the full k.

    The default k = 4 is the bundled model's best fixed k at batch 1; from batch 4 up
    the policy drafts fewer where that pays (docs/performance.md).

    ``method="ngram"`` drafts by prompt lookup (:mod:`spectrio.stages.device.draft.ngram`): the
    longest suffix of a request's tokens, ``prompt_lookup_max`` down to
    ``prompt_lookup_min`` tokens long, that appeared earlier in its prompt or output
    proposes the tokens that followed it. It needs no draft weights, so it runs on a
    checkpoint with no MTP layer; ``num_model_steps`` is MTP's only and is ignored.

    ``method="draft_model"`` drafts with a model of its own
    (:mod:`spectrio.stages.device.draft.draft_model`): ``draft_model`` names any checkpoint
    spectrio loads whose vocabulary is the target's (None: the target itself), and
    ``draft_layers`` runs only its first N decoder layers (None: all of them; the target's
    first N is self-speculation). Its drafts are sampled, and verification uses their
    probabilities, so the output keeps the target's distribution whatever the draft is.

    ``timing_cache`` is where the adaptive policy keeps what it measured about this
    machine's step times between runs (:mod:`spectrio.runtime.timing_cache`): ``"auto"``
    (``$SPECTRIO_CACHE_DIR``, else ``$XDG_CACHE_HOME/spectrio``, else
    ``~/.cache/spectrio``), ``"off"``, or a folder.
    """

    method: str | None = "mtp"
    num_speculative_tokens: int = 4
    num_model_steps: int | None = None
    adaptive: bool = True
    timing_cache: str = "auto"
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    draft_model: str | None = None
    draft_layers: int | None = None

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPEC_METHODS:
            raise ConfigError(
                f"method: must be None or one of {list(SPEC_METHODS)}, got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if not _is_int(k):
            raise ConfigError(f"num_speculative_tokens: must be an int, got {k!r}")
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"adaptive: must be a bool, got {self.adaptive!r}")
        if not isinstance(self.timing_cache, str) or not self.timing_cache:
            raise ConfigError(
                f"timing_cache: must be 'auto', 'off' or a folder, got {self.timing_cache!r}"
            )
        steps = self.num_model_steps
        if steps is not None and not _is_int(steps):
            raise ConfigError(f"num_model_steps: must be an int or None, got {steps!r}")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            _require_positive_int(name, getattr(self, name))
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"prompt_lookup_min: must be <= prompt_lookup_max ({self.prompt_lookup_max}), "
                f"got {self.prompt_lookup_min}"
            )
        if self.draft_model is not None and (
            not isinstance(self.draft_model, str) or not self.draft_model
        ):
            raise ConfigError(
                f"draft_model: must be a model name or path, got {self.draft_model!r}"
            )
        if self.draft_layers is not None:
            _require_positive_int("draft_layers", self.draft_layers)
        if not self.needs.draft_model:
            for name in ("draft_model", "draft_layers"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        f"{name}: only method 'draft_model' runs a draft model, not {self.method!r}"
                    )
        if self.method is None:
            return
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"num_speculative_tokens: k must be in 1..{MAX_SPECULATIVE_TOKENS}, got {k}"
            )
        if steps is not None and not 1 <= steps <= k:
            raise ConfigError(
                f"num_model_steps: must be in 1..num_speculative_tokens ({k}), got {steps}"
            )

    @property
    def enabled(self) -> bool:
        """True when a draft method is set."""
        return self.method is not None

    @property
    def needs(self) -> DraftNeeds:
        """What the method asks of the runtime (:mod:`spectrio.core.draft_methods`)."""
        return needs_of(self.method)

    @property
    def num_draft_tokens(self) -> int:
        """Drafted tokens per sequence per step: k, or 0 with no speculation."""
        return self.num_speculative_tokens if self.enabled else 0

    @property
    def tokens_per_seq(self) -> int:
        """Tokens each decoding sequence verifies per step: k + 1, or 1 with no speculation."""
        return self.num_draft_tokens + 1

    @property
    def effective_num_model_steps(self) -> int:
        """Most drafts a step proposes per sequence (the adaptive policy's ``k_max``): MTP's
        ``num_model_steps`` or k when unset, k for n-gram; 0 with no speculation."""
        if not self.enabled:
            return 0
        if self.num_model_steps is None or not self.needs.model_steps:
            return self.num_speculative_tokens
        return self.num_model_steps


class CaptureSizes:
    """What ``RuntimeConfig(...).graph_capture_sizes`` reads as.

    The name is both a constructor field (the optional user-given sizes) and a
    planning method. Calling the object returns the planned ascending list;
    otherwise it behaves as the user-given value: it compares equal to it,
    hashes and prints as it, and is falsy when no sizes were given. ``given``
    holds the value itself (a tuple, or None).
    """

    __slots__ = ("_config", "given")

    def __init__(self, config: RuntimeConfig, given: tuple[int, ...] | None) -> None:
        self._config = config
        self.given = given

    def __call__(self) -> list[int]:
        return self._config._planned_capture_sizes()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CaptureSizes):
            return self.given == other.given
        return self.given == other

    def __hash__(self) -> int:
        return hash(self.given)

    def __repr__(self) -> str:
        return repr(self.given)

    def __bool__(self) -> bool:
        return bool(self.given)

    def __deepcopy__(self, memo: dict[int, Any]) -> tuple[int, ...] | None:
        # dataclasses.asdict deep-copies field values: give it the plain value.
        return self.given


class _CaptureSizesField:
    """Data descriptor: stores the user-given sizes, reads back as :class:`CaptureSizes`."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._slot = f"_{name}_given"

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> None: ...

    @overload
    def __get__(self, obj: RuntimeConfig, objtype: type | None = None) -> CaptureSizes: ...

    def __get__(
        self, obj: RuntimeConfig | None, objtype: type | None = None
    ) -> CaptureSizes | None:
        if obj is None:
            return None  # the dataclass default
        return CaptureSizes(obj, obj.__dict__.get(self._slot))

    def __set__(self, obj: RuntimeConfig, value: Sequence[int] | CaptureSizes | None) -> None:
        if isinstance(value, CaptureSizes):  # dataclasses.replace passes the read-back object
            value = value.given
        object.__setattr__(obj, self._slot, value)


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything the runtime needs to plan capacity and assemble the pipeline.

    ``graph_capture_sizes`` is both an optional constructor argument (explicit
    capture sizes, each a multiple of k + 1) and the planning method
    ``graph_capture_sizes()``; see :class:`CaptureSizes`.
    """

    model: str = "bundled"
    dtype: str = "float32"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_model_len: int = 1024
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    role: str = "mixed"
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    graph_capture_sizes: _CaptureSizesField = _CaptureSizesField()
    tensor_parallel_size: int = 1
    enable_overlap: bool = False
    # Reuse the KV (target and MTP) of full prompt blocks that requests share
    # (stages/planning/block_manager.py); per-request ``cache_salt`` keeps tenants apart.
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int | None = None  # CPU math threads; None: every core this process may use
    # Health (runtime/health.py): with open requests, no step completed for this long, or
    # the publisher held by one record sink this long, makes the runtime unhealthy; a
    # sink that holds it half as long is logged (the runtime's watchdog).
    stall_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(
                f"model: must be a non-empty string ('bundled' or a path), got {self.model!r}"
            )
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype: must be one of {list(DTYPE_BYTES)}, got {self.dtype!r}")
        _require_positive_int("max_num_seqs", self.max_num_seqs)
        _require_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _require_positive_int("max_model_len", self.max_model_len)
        _require_positive_int("block_size", self.block_size)
        _require_optional_positive_int("num_kv_blocks", self.num_kv_blocks)
        _require_optional_positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        _require_optional_positive_int("num_threads", self.num_threads)
        if self.role not in ROLES:
            raise ConfigError(f"role: must be one of {list(ROLES)}, got {self.role!r}")
        if not isinstance(self.speculative, SpeculativeConfig):
            raise ConfigError(
                f"speculative: must be a SpeculativeConfig, got {type(self.speculative).__name__}"
            )
        if not _is_int(self.tensor_parallel_size):
            raise ConfigError(
                f"tensor_parallel_size: must be an int, got {self.tensor_parallel_size!r}"
            )
        if self.tensor_parallel_size < 1:
            raise ConfigError(
                f"tensor_parallel_size: must be >= 1, got {self.tensor_parallel_size}"
            )
        if not isinstance(self.enable_overlap, bool):
            raise ConfigError(f"enable_overlap: must be a bool, got {self.enable_overlap!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(
                f"enable_prefix_caching: must be a bool, got {self.enable_prefix_caching!r}"
            )
        if not _is_int(self.seed) or self.seed < 0:
            raise ConfigError(f"seed: must be a non-negative int, got {self.seed!r}")
        stall = self.stall_timeout_s
        if (
            not isinstance(stall, (int, float))
            or isinstance(stall, bool)
            or not math.isfinite(stall)
            or stall <= 0
        ):
            raise ConfigError(
                f"stall_timeout_s: must be a finite number of seconds > 0, got {stall!r}"
            )

        t = self.tokens_per_seq
        need = self.max_num_seqs * t
        if self.max_num_batched_tokens < need:
            raise ConfigError(
                f"max_num_batched_tokens: must be >= max_num_seqs * (k + 1) = "
                f"{self.max_num_seqs} * {t} = {need}, got {self.max_num_batched_tokens}"
            )
        self._validate_given_capture_sizes()
        if self.num_kv_blocks is not None and self.num_kv_blocks < self.max_blocks_per_seq():
            raise ConfigError(
                f"num_kv_blocks: must hold at least one max_model_len sequence "
                f"({self.max_blocks_per_seq()} blocks of {self.block_size} tokens), "
                f"got {self.num_kv_blocks}"
            )

    def _validate_given_capture_sizes(self) -> None:
        given: object = self.graph_capture_sizes.given
        if given is None:
            return
        if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
            raise ConfigError(
                f"graph_capture_sizes: must be None or a sequence of ints, got {given!r}"
            )
        t = self.tokens_per_seq
        cap = self.capture_cap()
        for size in given:
            if not _is_int(size):
                raise ConfigError(f"graph_capture_sizes: entries must be ints, got {size!r}")
            if size < 1:
                raise ConfigError(f"graph_capture_sizes: entries must be positive, got {size}")
            if size % t != 0:
                raise ConfigError(
                    f"graph_capture_sizes: every size must be a multiple of k + 1 = {t}, got {size}"
                )
            if size > cap:
                raise ConfigError(
                    f"graph_capture_sizes: sizes must be <= max_num_seqs * (k + 1) = {cap}, "
                    f"got {size}"
                )
        object.__setattr__(self, "graph_capture_sizes", tuple(given))

    # ----------------------------------------------------------------- derived

    @property
    def tokens_per_seq(self) -> int:
        """k + 1 with speculation, 1 without: tokens one decoding sequence verifies per step."""
        return self.speculative.tokens_per_seq

    @property
    def sink_warn_s(self) -> float:
        """Seconds a record sink may hold the publisher before the runtime's watchdog logs
        it: half of ``stall_timeout_s``, so the log line comes before ``/health`` fails."""
        return self.stall_timeout_s / 2

    @property
    def model_dtype(self) -> DType:
        """``dtype`` as the models' literal type (validated in ``__post_init__``)."""
        return cast(DType, self.dtype)

    @property
    def dtype_bytes(self) -> int:
        """Element size of ``dtype`` in bytes."""
        return DTYPE_BYTES[self.dtype]

    @property
    def num_mtp_layers(self) -> int:
        """KV layers the checkpoint's MTP layer adds: 1 when the method runs it, else 0
        (a draft model's are counted from its own config: ``runtime/kv_sizing.py``)."""
        return 1 if self.speculative.needs.checkpoint_mtp else 0

    # ---------------------------------------------------------------- planning

    def resolve_num_threads(self) -> int:
        """``num_threads``, or the cores in this process's CPU affinity when None."""
        if self.num_threads is not None:
            return self.num_threads
        try:
            return len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            return os.cpu_count() or 1

    def max_chunk_tokens(self) -> int:
        """Largest token count one step runs: ``max_num_seqs * (k + 1)`` for role "decode",
        otherwise ``max_num_batched_tokens``."""
        if self.role == "decode":
            return self.max_num_seqs * self.tokens_per_seq
        return self.max_num_batched_tokens

    def warmup_num_tokens(self) -> int:
        """Tokens the warm-up pass runs: one decode step's rows at full batch, ``max_num_seqs
        * (k + 1)`` (never more than ``max_chunk_tokens()``, which validation ensures).

        The pass is there to pay the first step's one-time costs before any request waits
        on them (the fused serving weights are built, Paddle and MKL initialise their
        kernels); those do not depend on how many rows it runs. Eager Paddle compiles
        nothing per shape, so a longer pass would only cost start-up time: on SmolLM2 a
        2,048-token pass was most of a ``spectrio generate``'s wall time."""
        return self.max_num_seqs * self.tokens_per_seq

    def capture_cap(self) -> int:
        """Largest capture size: ``max_num_seqs * (k + 1)``."""
        return self.max_num_seqs * self.tokens_per_seq

    def _planned_capture_sizes(self) -> list[int]:
        given = self.graph_capture_sizes.given
        if given is not None:
            return sorted(set(given))
        t = self.tokens_per_seq
        cap = self.capture_cap()
        sizes = {base * t for base in BASE_CAPTURE_SIZES if base * t <= cap}
        sizes.add(cap)
        return sorted(sizes)

    def capture_batch_size(self, size: int) -> int:
        """Batch size the target is captured at for a capture ``size``: ``size // (k + 1)``.

        Raises :class:`ConfigError` when ``size`` is not a positive multiple of k + 1.
        """
        t = self.tokens_per_seq
        if not _is_int(size) or size < 1:
            raise ConfigError(f"capture size: must be a positive int, got {size!r}")
        if size % t != 0:
            raise ConfigError(f"capture size: must be a multiple of k + 1 = {t}, got {size}")
        return size // t

    def captured_size_for(self, real_bsz: int) -> int | None:
        """Smallest capture size holding ``real_bsz * (k + 1)`` tokens, None above the top."""
        if not _is_int(real_bsz) or real_bsz < 1:
            raise ValueError(f"real_bsz: must be a positive int, got {real_bsz!r}")
        sizes = self.graph_capture_sizes()
        need = real_bsz * self.tokens_per_seq
        i = bisect.bisect_left(sizes, need)
        return sizes[i] if i < len(sizes) else None

    # -------------------------------------------------------------- KV planning

    def max_slots_per_seq(self) -> int:
        """KV positions one sequence can need: ``max_model_len + k``.

        A sequence one token short of ``max_model_len`` verifies k + 1 positions,
        the last at index ``max_model_len - 1 + k``. With no speculation, k is 0.
        """
        return self.max_model_len + self.speculative.num_draft_tokens

    def max_blocks_per_seq(self) -> int:
        """Blocks one sequence can need: ``ceil(max_slots_per_seq() / block_size)``."""
        return _ceil_div(self.max_slots_per_seq(), self.block_size)

    def kv_bytes_per_block(
        self, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int | None = None
    ) -> int:
        """Bytes per KV block over the target layers plus the MTP layer (when speculating):
        ``2 * (num_layers + mtp) * block_size * num_kv_heads * head_dim * dtype_bytes``.

        ``dtype_bytes`` defaults to the size of ``dtype``.
        """
        return kv_bytes_per_block(
            num_layers=num_layers,
            num_mtp_layers=self.num_mtp_layers,
            block_size=self.block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype_bytes=self.dtype_bytes if dtype_bytes is None else dtype_bytes,
        )

    def default_num_kv_blocks(self) -> int:
        """Blocks for ``max_num_seqs`` sequences at full length: ``max_blocks_per_seq()`` each."""
        return self.max_num_seqs * self.max_blocks_per_seq()

    def resolve_num_kv_blocks(
        self, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int | None = None
    ) -> int:
        """Number of KV blocks per cache (the target cache and the MTP cache each get this many).

        ``num_kv_blocks`` if given; else ``kv_cache_memory_bytes // kv_bytes_per_block(...)``
        if a budget is given; else ``default_num_kv_blocks()``. Raises
        :class:`ConfigError` when the result cannot hold one ``max_model_len`` sequence.
        """
        per_block = self.kv_bytes_per_block(num_layers, num_kv_heads, head_dim, dtype_bytes)
        minimum = self.max_blocks_per_seq()
        if self.num_kv_blocks is not None:
            blocks = self.num_kv_blocks
            source = "num_kv_blocks"
        elif self.kv_cache_memory_bytes is not None:
            blocks = self.kv_cache_memory_bytes // per_block
            source = "kv_cache_memory_bytes"
        else:
            return self.default_num_kv_blocks()
        if blocks < minimum:
            raise ConfigError(
                f"{source}: gives {blocks} KV blocks ({per_block} bytes each), fewer than the "
                f"{minimum} one max_model_len={self.max_model_len} sequence needs"
            )
        return blocks
