"""SamplingParams: defaults, validation messages naming the field, wire round trip."""

from __future__ import annotations

import msgspec
import pytest

from spectrio import InvalidRequest, SamplingParams

VOCAB = 100


def test_defaults_are_valid_and_greedy() -> None:
    p = SamplingParams()
    p.validate(VOCAB)
    assert p.is_greedy and not p.has_penalties and p.logprobs is None


def test_a_fully_specified_request_is_valid() -> None:
    SamplingParams(
        max_tokens=10,
        min_tokens=2,
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        min_p=0.05,
        seed=3,
        stop=["\n\n"],
        stop_token_ids=[7],
        ignore_eos=True,
        repetition_penalty=1.2,
        frequency_penalty=-0.5,
        presence_penalty=2,
        logprobs=20,
        logprobs_mode="processed",
        speculative=False,
    ).validate(VOCAB)
    SamplingParams(top_k=-1, temperature=1).validate(VOCAB)


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": 0},
        {"max_tokens": True},
        {"min_tokens": -1},
        {"min_tokens": 65},  # above max_tokens
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_k": -2},
        {"top_k": 1.5},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"min_p": 1.01},
        {"seed": -1},
        {"stop": [""]},
        {"stop": "abc"},
        {"stop_token_ids": [VOCAB]},
        {"repetition_penalty": 0.0},
        {"frequency_penalty": 2.5},
        {"presence_penalty": -3},
        {"logprobs": 21},
        {"logprobs": -1},
        {"logprobs_mode": "logits"},
        {"speculative": 1},
    ],
    ids=lambda f: "-".join(f"{k}={v!r}" for k, v in f.items()),
)
def test_invalid_values_name_their_field(fields: dict[str, object]) -> None:
    (name,) = fields
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**fields).validate(VOCAB)  # type: ignore[arg-type]
    assert str(err.value).startswith(f"{name}: ")


def test_top_p_message() -> None:
    with pytest.raises(InvalidRequest, match=r"^top_p: must be in \(0, 1\], got 1.5$"):
        SamplingParams(top_p=1.5).validate(VOCAB)


def test_round_trips_through_msgpack_and_refuses_unknown_fields() -> None:
    p = SamplingParams(temperature=0.5, seed=9, stop=["x"], logprobs=3)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.json.decode(b'{"temprature": 0.5}', type=SamplingParams)
