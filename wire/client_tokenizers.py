"""The tokenizers a wire client detokenises with: the bundled model's, and a server's
named by its ``Info`` reply (schema 1.2), each built once per process and per content
(keyed by the SHA-256 of its JSON), so a client fetches a server's tokenizer JSON only
when this process does not have it yet."""

from __future__ import annotations

import functools
import hashlib
import threading
from pathlib import Path

from tokenizers import Tokenizer

from spectrio.models import BUNDLED_DIR, TextTokenizer
from spectrio.wire.schema import ModelInfo

__all__ = ["bundled_tokenizer", "tokenizer_for"]

_tokenizers: dict[str, TextTokenizer] = {}  # SHA-256 of a tokenizer's JSON -> tokenizer
_tokenizers_lock = threading.Lock()


@functools.cache
def _bundled_json() -> str:
    return (Path(BUNDLED_DIR) / "tokenizer.json").read_text(encoding="utf-8")


def _from_json(text: str, eos_token_id: int | None = None) -> TextTokenizer:
    """The tokenizer for a tokenizer JSON, built once per process and per content."""
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    with _tokenizers_lock:
        tok = _tokenizers.get(digest)
        if tok is None:
            tok = _tokenizers[digest] = TextTokenizer(Tokenizer.from_str(text), eos_token_id)
        return tok


def bundled_tokenizer() -> TextTokenizer:
    """The tokenizer of the bundled model."""
    return _from_json(_bundled_json())


def tokenizer_for(info: ModelInfo) -> TextTokenizer | None:
    """The tokenizer an ``Info`` reply names: from its ``tokenizer_json`` when it has
    one (checked against its hash), else one this process already has with that hash
    (the bundled model's, or one fetched before); None when it must be fetched. Raises
    ``ValueError`` when the JSON does not match the hash."""
    if info.tokenizer_json is not None:
        digest = hashlib.sha256(info.tokenizer_json.encode("utf-8")).hexdigest()
        if digest != info.tokenizer_sha256:
            raise ValueError("the server's tokenizer JSON does not match its SHA-256")
        return _from_json(info.tokenizer_json, info.eos_token_id)
    bundled_json = _bundled_json()
    if hashlib.sha256(bundled_json.encode("utf-8")).hexdigest() == info.tokenizer_sha256:
        return bundled_tokenizer()
    with _tokenizers_lock:
        return _tokenizers.get(info.tokenizer_sha256)
