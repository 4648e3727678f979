"""A constraint (:class:`~spectrio.core.constraints.Constraint`) compiled for one tokenizer
with llguidance: the check that refuses what the library cannot enforce, and a fresh
matcher per request.

llguidance was chosen by measurement (``benchmarks/grammar_libraries.py``,
docs/performance.md): it compiles a schema in about a millisecond, rolls back and forks a
matcher cheaply, computes the masks of draft positions in one call, and names the
forced continuation (``compute_ff_tokens``), which the grammar proposer drafts.

JSON is generated compact by default (``", "`` and ``": "`` between items and keys, no
other whitespace): a small model given free whitespace can spend its whole budget on it,
and fixed separators are forced tokens, which are drafted. A schema's own
``"x-guidance"`` options override this.

The library's index of the vocabulary takes a noticeable part of a second to build at a
49,152-token vocabulary, holding the GIL, so it is built once and every matcher shares
it: on the first constrained request of an embedding runtime (which pays for it once),
before ``spectrio serve`` starts serving (:meth:`GrammarCompiler.warm`).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import structlog

from spectrio.core.constraints import Constraint, check_constraint
from spectrio.errors import InvalidRequest

if TYPE_CHECKING:
    import llguidance

    from spectrio.models.text.tokenizer import TextTokenizer

__all__ = ["GrammarCompiler", "JSON_DEFAULTS", "grammar_text"]

log = structlog.get_logger("spectrio.grammar")

JSON_DEFAULTS: Final[dict[str, Any]] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
"""llguidance's JSON options unless the schema's ``"x-guidance"`` says otherwise."""

_CACHE_SIZE: Final = 256  # compiled constraints kept (each a template matcher)
_CACHE_CHARS: Final = 8 << 20  # and at most this many characters of their specs


def _lark_string(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for ``constraint`` (not yet checked against a tokenizer)."""
    import llguidance

    kind = constraint.kind
    if kind in ("json_object", "json_schema"):
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                constraint.schema(),
                defaults=JSON_DEFAULTS,  # type: ignore[arg-type]
            )
        except ValueError as exc:
            raise InvalidRequest(
                "constraint", f"the JSON schema is malformed: {exc}", code="invalid_constraint"
            ) from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.spec)
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(constraint.spec)
    if kind == "choice":
        options = " | ".join(_lark_string(c) for c in constraint.choices)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {options}\n")
    raise InvalidRequest("constraint", f"unknown kind {kind!r}", code="invalid_constraint")


class GrammarCompiler:
    """Constraints compiled for one model's tokenizer. Thread-safe: the runtime checks
    requests on its own thread while the device worker builds matchers."""

    def __init__(
        self, tokenizer: TextTokenizer, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> None:
        self._text_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._started = False
        self._lock = threading.Lock()
        # (kind, spec, choices) -> the matcher at the grammar's start, copied per request
        self._cached_chars = 0
        self._templates: OrderedDict[tuple[str, str, tuple[str, ...]], llguidance.LLMatcher] = (
            OrderedDict()
        )

    @property
    def eos_token_id(self) -> int:
        """The token a matcher allows where its grammar is complete."""
        if not self.eos_token_ids:
            raise RuntimeError("the model has no EOS token")
        return self.eos_token_ids[0]

    def start(self) -> None:
        """Build the library's tokenizer on a background thread (idempotent)."""
        with self._lock:
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._build, name="spectrio-grammar-tokenizer", daemon=True).start()

    def _build(self) -> None:
        try:
            import llguidance

            self._tokenizer = llguidance.LLTokenizer(
                self._text_tokenizer.raw.to_str(),
                n_vocab=self.vocab_size,
                eos_token=self.eos_token_ids,
            )
        except BaseException as exc:  # reported to every caller of .tokenizer
            self._build_error = exc
        finally:
            self._built.set()

    def warm(self) -> None:
        """Build the library's tokenizer now, if it is not built (blocking). A tokenizer
        the library cannot read is logged, not raised: the server serves, and refuses
        constrained requests (:meth:`check`)."""
        try:
            _ = self.tokenizer
        except RuntimeError as exc:
            log.warning("structured output is unavailable for this model", reason=str(exc))

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """The library's tokenizer (built on first use, or waited for after :meth:`start`)."""
        if not self._built.is_set():
            self.start()
            self._built.wait()
        if self._tokenizer is None:
            raise RuntimeError(f"the grammar tokenizer failed to build: {self._build_error}")
        return self._tokenizer

    def check(self, constraint: Constraint) -> None:
        """Refuse (:class:`InvalidRequest`, code ``invalid_constraint``) a constraint the
        library cannot enforce exactly: a malformed schema, pattern or grammar, or a schema
        keyword it does not implement (never silently ignored)."""
        self._template(constraint)

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher at the start of ``constraint``'s grammar."""
        return self._template(constraint).deep_copy()

    def _template(self, constraint: Constraint) -> llguidance.LLMatcher:
        import llguidance

        key = (constraint.kind, constraint.spec, tuple(constraint.choices))
        with self._lock:
            found = self._templates.get(key)
            if found is not None:
                self._templates.move_to_end(key)
                return found
        check_constraint(constraint)
        if not self.eos_token_ids:
            raise InvalidRequest(
                "constraint",
                "the served model has no EOS token, so a constrained output could not end",
                code="invalid_constraint",
            )
        grammar = grammar_text(constraint)
        try:
            tokenizer = self.tokenizer
        except RuntimeError as exc:
            raise InvalidRequest(
                "constraint",
                f"the served model's tokenizer cannot be used for structured output ({exc})",
                code="invalid_constraint",
            ) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise InvalidRequest(
                "constraint",
                f"cannot be enforced: {error.strip()}",
                code="invalid_constraint",
            )
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if not matcher.is_error():
            # Some grammars fail only at their first mask (no string can match them):
            # try it on a copy, so such a constraint is refused, never run.
            probe = matcher.deep_copy()
            probe.compute_bitmask()
            if probe.is_error():
                matcher = probe
        if matcher.is_error():
            raise InvalidRequest(
                "constraint",
                f"cannot be enforced: {matcher.get_error().strip()}",
                code="invalid_constraint",
            )
        with self._lock:
            self._templates[key] = matcher
            self._cached_chars += len(constraint.spec)
            while len(self._templates) > _CACHE_SIZE or self._cached_chars > _CACHE_CHARS:
                (_, old_spec, _), _ = self._templates.popitem(last=False)
                self._cached_chars -= len(old_spec)
        return matcher
