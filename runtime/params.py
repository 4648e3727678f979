"""Per-request sampling parameters (a msgspec Struct, so it travels on the wire unchanged)."""

from __future__ import annotations

import msgspec


class InvalidRequest(ValueError):
    """A request the runtime refuses; the message names the field and the rule."""


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_tokens: int = 64
    temperature: float = 0.0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    speculative: bool | None = None  # None: follow the runtime's configuration

    def validate(self, vocab_size: int) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens: must be an int >= 1, got {self.max_tokens!r}")
        if self.temperature != 0.0:
            raise InvalidRequest(
                f"temperature: only greedy decoding (0.0) is supported, got {self.temperature!r}"
            )
        for tok in self.stop_token_ids:
            if not 0 <= tok < vocab_size:
                raise InvalidRequest(f"stop_token_ids: {tok} is outside the vocabulary [0, {vocab_size})")
