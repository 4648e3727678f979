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
        {"max_tokens": "9"},
        {"temperature": float("inf")},
        {"repetition_penalty": float("inf")},
        {"stop": [1]},
        {"stop_token_ids": [1.0]},
        {"seed": 2**63},
        {"ignore_eos": 0},
    ],
    ids=lambda f: "-".join(f"{k}={v!r}" for k, v in f.items()),
)
def test_invalid_values_name_their_field(fields: dict[str, object]) -> None:
    (name,) = fields
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**fields).validate(VOCAB)  # type: ignore[arg-type]
    assert str(err.value).startswith(f"{name}: ")


def test_top_p_message() -> None:
    rule = r"^top_p: must be a finite number in \(0, 1\], got 1.5$"
    with pytest.raises(InvalidRequest, match=rule):
        SamplingParams(top_p=1.5).validate(VOCAB)


def test_refusals_carry_field_rule_and_class() -> None:
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(stop_token_ids=[3, VOCAB]).validate(VOCAB)
    assert (err.value.field, err.value.code) == ("stop_token_ids", "invalid_params")
    assert str(err.value) == (
        f"stop_token_ids: must be token ids below the vocabulary size {VOCAB}, "
        f"got {VOCAB} at index 1"
    )
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(max_tokens=2.0).validate(VOCAB)  # type: ignore[arg-type]
    assert (err.value.field, err.value.rule, err.value.code) == (
        "max_tokens",
        "must be an int >= 1",
        "wrong_type",
    )
    # A plain message still works, for code that raises it by hand.
    assert InvalidRequest("prompt: must not be empty").field == "prompt"


def test_round_trips_through_msgpack_and_refuses_unknown_fields() -> None:
    p = SamplingParams(temperature=0.5, seed=9, stop=["x"], logprobs=3)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.json.decode(b'{"temprature": 0.5}', type=SamplingParams)
