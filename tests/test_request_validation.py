"""Issue 9 items 13 and 12 (second bullet): one home for every request rule.

The embedding API (``rt.generate``) and the wire path (``decode_request`` then
``check_submit``, what ``spectrio serve`` runs) refuse the same bad field with the same
error: the same field, the same rule text, the same class. Token ids that are floats or
bools are refused, never coerced.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np
import trio

from spectrio import InvalidRequest, RuntimeConfig, SamplingParams, open_runtime
from spectrio.core.params import field_rule
from spectrio.models import BUNDLED_DIR, TextTokenizer
from spectrio.wire.codec import WireError, check_submit, decode_request
from spectrio.wire.schema import ErrorCode, Submit

MAX_MODEL_LEN = 64
VOCAB = 4096  # the bundled model's vocabulary (checked below)
TOKENIZER = TextTokenizer.from_file(BUNDLED_DIR / "tokenizer.json")

_ = object()  # "leave this out"

# (prompt, params, request_id)
BAD: list[tuple[object, dict[str, Any], object]] = [
    # prompts
    ([], {}, _),
    ("", {}, _),
    ([1, 2.0], {}, _),  # a float token id, even an integral one
    ([1.5], {}, _),
    ([True, 5], {}, _),  # a bool token id
    ([4, False], {}, _),
    ([4, -1], {}, _),
    ([2**31], {}, _),
    ([4, VOCAB], {}, _),
    ([5] * MAX_MODEL_LEN, {}, _),
    ("x " * 200, {}, _),
    (3.5, {}, _),
    ({"a": 1}, {}, _),
    ([[1, 2]], {}, _),
    # request ids
    ([1], {}, ""),
    ([1], {}, "r" * 129),
    ([1], {}, 7),
    # every parameter: a wrong type and a value out of range
    ([1], {"max_tokens": 0}, _),
    ([1], {"max_tokens": "9"}, _),
    ([1], {"max_tokens": True}, _),
    ([1], {"max_tokens": 2.0}, _),
    ([1], {"min_tokens": -1}, _),
    ([1], {"min_tokens": 65}, _),  # above max_tokens
    ([1], {"min_tokens": 5, "max_tokens": 4}, _),
    ([1], {"min_tokens": None}, _),
    ([1], {"temperature": -0.1}, _),
    ([1], {"temperature": math.nan}, _),
    ([1], {"temperature": math.inf}, _),
    ([1], {"temperature": "hot"}, _),
    ([1], {"top_k": -2}, _),
    ([1], {"top_k": 1.5}, _),
    ([1], {"top_p": 0.0}, _),
    ([1], {"top_p": 1.5}, _),
    ([1], {"top_p": None}, _),
    ([1], {"min_p": 1.01}, _),
    ([1], {"min_p": -math.inf}, _),
    ([1], {"seed": -1}, _),
    ([1], {"seed": 2**63}, _),
    ([1], {"seed": 1.0}, _),
    ([1], {"stop": [""]}, _),
    ([1], {"stop": ["ok", ""]}, _),
    ([1], {"stop": "abc"}, _),
    ([1], {"stop": [1]}, _),
    ([1], {"stop_token_ids": [VOCAB]}, _),
    ([1], {"stop_token_ids": [3, -1]}, _),
    ([1], {"stop_token_ids": [3.0]}, _),
    ([1], {"stop_token_ids": 3}, _),
    ([1], {"ignore_eos": 1}, _),
    ([1], {"repetition_penalty": 0.0}, _),
    ([1], {"repetition_penalty": math.inf}, _),
    ([1], {"frequency_penalty": 2.5}, _),
    ([1], {"presence_penalty": -3}, _),
    ([1], {"presence_penalty": "0"}, _),
    ([1], {"logprobs": 21}, _),
    ([1], {"logprobs": -1}, _),
    ([1], {"logprobs": 2.0}, _),
    ([1], {"logprobs_mode": "logits"}, _),
    ([1], {"logprobs_mode": 1}, _),
    ([1], {"speculative": 1}, _),
    ([1], {"speculative": "yes"}, _),
]


def wire_error(prompt: object, params: dict[str, Any], request_id: object) -> WireError:
    body: dict[str, Any] = {"type": "submit", "v": 1, "request_id": "r1", "prompt": prompt}
    if request_id is not _:
        body["request_id"] = request_id
    if params:
        body["params"] = params
    frame = msgpack.packb(body, use_bin_type=True)
    try:
        submit = decode_request(frame)
        assert isinstance(submit, Submit)
        check_submit(
            submit, vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN, tokenize=TOKENIZER.encode
        )
    except WireError as exc:
        return exc
    raise AssertionError(f"the wire path accepted {body}")


async def api_error(
    rt: Any, prompt: object, params: dict[str, Any], request_id: object
) -> InvalidRequest:
    kwargs = {} if request_id is _ else {"request_id": request_id}
    try:
        async with rt.generate(prompt, SamplingParams(**params), **kwargs):
            pass
    except InvalidRequest as exc:
        return exc
    raise AssertionError(f"the API accepted {prompt!r} {params} {kwargs}")


async def test_api_and_wire_refuse_each_bad_field_with_the_same_error(bundled: object) -> None:
    mismatches: list[str] = []
    with trio.fail_after(120):
        async with open_runtime(RuntimeConfig(max_model_len=MAX_MODEL_LEN), warmup=False) as rt:
            assert rt.loaded.config.vocab_size == VOCAB
            for prompt, params, rid in BAD:
                api = await api_error(rt, prompt, params, rid)
                wire = wire_error(prompt, params, rid)
                case = f"{prompt!r:.30} {params} {rid!r:.20}"
                if str(api) != wire.reason or api.code != wire.code.value:
                    mismatches.append(
                        f"{case}:\n  api  {api.code}: {api}"
                        f"\n  wire {wire.code.value}: {wire.reason}"
                    )
                # The error names the bad field first.
                bad = "request_id" if rid is not _ else "prompt" if not params else None
                if not str(api).startswith(f"{api.field}: ") or (
                    api.field != bad if bad else api.field not in params
                ):
                    mismatches.append(f"{case}: names {api.field!r}")
                ErrorCode(api.code)  # every refusal class is a wire error code
            # Nothing refused reached the pipeline.
            assert rt.blocks.num_used_blocks == 0 and not rt._requests
    assert not mismatches, "\n".join(mismatches)


async def test_token_ids_must_be_ints(bundled: object) -> None:
    with trio.fail_after(120):
        async with open_runtime(RuntimeConfig(max_model_len=MAX_MODEL_LEN), warmup=False) as rt:
            for prompt in ([1, 2.0], [True], np.array([1.0, 2.0]), np.array([True]), (1, 2.5)):
                exc = await api_error(rt, prompt, {}, _)
                assert (exc.field, exc.code) == ("prompt", "wrong_type"), exc
                assert str(exc).startswith(f"prompt: {field_rule('prompt')}, got ")
            # Integer sequences of any kind are token ids.
            for prompt in ([5, 6], (5, 6), np.array([5, 6], dtype=np.int32), [np.int64(5), 6]):
                stream = rt.generate(prompt, SamplingParams(max_tokens=2))  # type: ignore[arg-type]
                async with stream:
                    assert sum([len(d.token_ids) async for d in stream]) == 2
            await rt.wait_idle()
            assert rt.blocks.num_used_blocks == 0


def test_rule_text_follows_the_constraints() -> None:
    assert field_rule("top_p") == "must be a finite number in (0, 1]"
    assert field_rule("max_tokens") == "must be an int >= 1"
    assert field_rule("logprobs") == "must be None or an int in [0, 20]"
    assert field_rule("stop") == "must be a list of non-empty strings"
    assert field_rule("prompt") == "must be a string or a list of ints in [0, 2147483647]"
    assert field_rule("request_id") == "must be a string of 1 to 128 characters"
    exc = wire_error([1], {"top_p": 1.5}, _)
    assert exc.code is ErrorCode.INVALID_PARAMS
    assert exc.reason == "top_p: must be a finite number in (0, 1], got 1.5"
