"""Admission (pure parts): the per-client token bucket, the message cap, the length check
before tokenizing."""

from __future__ import annotations

import pytest

from spectrio.core.params import SamplingParams
from spectrio.wire.admission import MIN_MESSAGE_BYTES, RateLimiter, check_length, message_cap
from spectrio.wire.codec import WireError
from spectrio.wire.schema import SCHEMA_VERSION, ErrorCode, Submit


def test_each_client_has_its_own_bucket() -> None:
    limits = RateLimiter(rate=1.0, burst=2)
    assert limits.admit(b"a", 0.0) and limits.admit(b"a", 0.0)
    assert not limits.admit(b"a", 0.0)  # a's burst is spent
    assert limits.admit(b"b", 0.0)  # b is not held by a
    assert limits.admit(b"a", 1.0)  # one token back after a second
    assert not limits.admit(b"a", 1.0)


def test_no_rate_admits_everything() -> None:
    limits = RateLimiter(rate=None)
    assert all(limits.admit(b"a", 0.0) for _ in range(1000))


def test_message_cap_exceeds_the_request_cap() -> None:
    assert message_cap(1024) == MIN_MESSAGE_BYTES
    assert message_cap(2 << 20) == 32 << 20
    assert message_cap(10, 11) == 11
    with pytest.raises(ValueError):
        message_cap(10, 10)
    with pytest.raises(ValueError):
        message_cap(0)


def _submit(prompt: str | list[int]) -> Submit:
    return Submit(v=SCHEMA_VERSION, request_id="r", prompt=prompt, params=SamplingParams())


def test_length_is_checked_before_tokenizing() -> None:
    check_length(_submit([1, 2, 3]), max_model_len=4, max_token_bytes=None)
    with pytest.raises(WireError) as err:
        check_length(_submit([1, 2, 3, 4]), max_model_len=4, max_token_bytes=None)
    assert err.value.code is ErrorCode.PROMPT_TOO_LONG
    # 4 bytes a token at most: 40 bytes are at least 10 tokens
    with pytest.raises(WireError) as err:
        check_length(_submit("x" * 40), max_model_len=10, max_token_bytes=4)
    assert err.value.code is ErrorCode.PROMPT_TOO_LONG
    check_length(_submit("x" * 40), max_model_len=11, max_token_bytes=4)
