"""Per-request sampling parameters (a msgspec Struct, so it travels on the wire unchanged).

Semantics follow vLLM where they overlap:

* ``temperature == 0`` is greedy: the token is the argmax of the logits after
  penalties and the ``min_tokens`` mask; ``top_k``/``top_p``/``min_p`` and
  ``seed`` then change nothing.
* ``repetition_penalty`` (HF/vLLM): a logit of a token seen in the prompt or the
  output so far is divided by it when positive, multiplied when not.
  ``frequency_penalty`` subtracts ``penalty * count`` and ``presence_penalty``
  subtracts ``penalty`` once, both over the output tokens only.
* ``min_tokens``: EOS (unless ``ignore_eos``) and ``stop_token_ids`` get zero
  probability until that many tokens were emitted; stop strings only count from then.
* ``stop`` strings are matched in the detokenised output; the text ends right
  before the match and the tokens end with the one that completed it.
* ``logprobs``: ``None`` for none, else ``0..20`` top alternatives on top of the
  sampled token's own logprob. ``logprobs_mode="raw"`` reports the log-softmax of
  the unmodified target logits, ``"processed"`` the log of the distribution the
  token was drawn from.
"""

from __future__ import annotations

import math

import msgspec

MAX_LOGPROBS = 20
"""Largest ``logprobs`` (top alternatives) a request may ask for."""


class InvalidRequest(ValueError):
    """A request the runtime refuses; the message names the field and the rule."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_tokens: int = 64  # tokens to emit at most
    min_tokens: int = 0  # EOS / stop tokens / stop strings cannot end the request before this many
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0  # nucleus mass, in (0, 1]
    min_p: float = 0.0  # keep tokens with p >= min_p * max p, in [0, 1]
    seed: int | None = None  # per-request generator; None draws from the runtime's shared one
    stop: list[str] = []  # stop strings (not included in the output text)
    stop_token_ids: list[int] = []  # stop tokens (included in the output tokens)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0  # > 0; 1 is off
    frequency_penalty: float = 0.0  # in [-2, 2]
    presence_penalty: float = 0.0  # in [-2, 2]
    logprobs: int | None = None  # top alternatives per emitted token, 0..20
    logprobs_mode: str = "raw"  # "raw" | "processed"
    speculative: bool | None = None  # None: follow the runtime's configuration

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def validate(self, vocab_size: int) -> None:
        """Raise :class:`InvalidRequest` (message ``"<field>: <rule>, got <value>"``)."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens: must be an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(
                f"min_tokens: must be an int in [0, max_tokens], got {self.min_tokens!r}"
            )
        if not _is_number(self.temperature) or self.temperature < 0:
            raise InvalidRequest(
                f"temperature: must be a finite number >= 0, got {self.temperature!r}"
            )
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequest(f"top_k: must be -1, 0 (off) or an int >= 1, got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"min_p: must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise InvalidRequest(f"seed: must be None or an int in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest(f"stop: must be a list of non-empty strings, got {self.stop!r}")
        for tok in self.stop_token_ids:
            if not _is_int(tok) or not 0 <= tok < vocab_size:
                raise InvalidRequest(
                    f"stop_token_ids: {tok!r} is outside the vocabulary [0, {vocab_size})"
                )
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest(f"ignore_eos: must be a bool, got {self.ignore_eos!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequest(
                f"repetition_penalty: must be > 0, got {self.repetition_penalty!r}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise InvalidRequest(f"{name}: must be in [-2, 2], got {value!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise InvalidRequest(
                f"logprobs: must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        if self.logprobs_mode not in ("raw", "processed"):
            raise InvalidRequest(
                f"logprobs_mode: must be 'raw' or 'processed', got {self.logprobs_mode!r}"
            )
        if self.speculative is not None and not isinstance(self.speculative, bool):
            raise InvalidRequest(f"speculative: must be None or a bool, got {self.speculative!r}")
