"""``/v1/chat/completions`` on SmolLM2-135M-Instruct (its chat template from the GGUF
file), HTTP alone (``--no-zmq``), through the official ``openai`` client: the messages
render exactly as transformers rendered them for ``tests/data/smollm2_golden.json``, the
answer is the golden greedy answer ending at the template's end of turn, streaming
sends the role first and logprobs in the chat format, and the refusals name their
field."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from http_helpers import HttpServer, http_server

from spectrio.models.text.tokenizer import TextTokenizer

GOLDEN = json.loads((Path(__file__).resolve().parent / "data" / "smollm2_golden.json").read_text())
MODEL = "smollm2"
QUESTION = [{"role": "user", "content": GOLDEN["chats"][0]}]


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    args = (
        "--no-zmq", "--model", str(smollm2_gguf), "--served-model-name", MODEL,
        "--spec-method", "ngram", "--max-model-len", "512", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "256",  # a short warm-up
    )  # fmt: skip
    # The golden answers are transformers' from the float weights: served widened to
    # float32, not from the Q4_1 blocks (whose int8 activations tip the first answer
    # token of this question, 0.09 of a logit ahead in float32).
    float32 = {"SPECTRIO_GGUF_BLOCKS": "0"}
    with http_server(tmp_path_factory.mktemp("http_chat"), *args, env=float32) as srv:
        yield srv


@pytest.fixture
def client(server: HttpServer) -> Iterator[openai.OpenAI]:
    with server.sdk() as c:
        yield c


def test_the_answer_is_the_golden_one(client: openai.OpenAI, smollm2_gguf: Path) -> None:
    from tokenizers import Tokenizer

    from spectrio.models.loading.gguf_file import GGUFFile

    vocab = GGUFFile(smollm2_gguf).tokenizer_json()
    assert vocab is not None
    tok = TextTokenizer(Tokenizer.from_str(vocab), 2)
    out = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_completion_tokens=40
    )
    answer = GOLDEN["token_ids"][0][: GOLDEN["token_ids"][0].index(2)]
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == tok.decode(answer)
    assert choice.finish_reason == "stop"  # the template's end of turn
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(GOLDEN["prompt_ids"][0])  # rendered as transformers did
    assert out.usage.completion_tokens == len(answer) + 1  # the end-of-turn token counts
    drafts = (out.usage.model_extra or {})["spectrio"]
    assert drafts["drafts_proposed"] >= drafts["drafts_accepted"] >= 0


def test_parts_and_developer_messages_render_like_plain_ones(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Answer briefly."}, *QUESTION],
        temperature=0,
        max_tokens=12,
    )
    parts = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "developer", "content": [{"type": "text", "text": "Answer briefly."}]},
            {"role": "user", "content": [{"type": "text", "text": GOLDEN["chats"][0]}]},
        ],
        temperature=0,
        max_tokens=12,
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage is not None and plain.usage is not None
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens


def test_streaming_n2_with_logprobs(server: HttpServer) -> None:
    async def run() -> tuple[list[list[str]], list[str], list[list[object]], list[object]]:
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0
        ) as c:
            roles: list[list[str]] = [[], []]
            texts = ["", ""]
            logprobs: list[list[object]] = [[], []]
            usages: list[object] = []
            stream = await c.chat.completions.create(
                model=MODEL, messages=QUESTION, n=2, temperature=0.7, seed=3,
                max_completion_tokens=12, logprobs=True, top_logprobs=2, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            async for chunk in stream:
                if not chunk.choices:
                    usages.append(chunk.usage)
                for ch in chunk.choices:
                    if ch.delta.role:
                        roles[ch.index].append(ch.delta.role)
                    texts[ch.index] += ch.delta.content or ""
                    if ch.logprobs is not None and ch.logprobs.content:
                        logprobs[ch.index] += ch.logprobs.content
            return roles, texts, logprobs, usages

    roles, texts, logprobs, usages = asyncio.run(run())
    assert roles == [["assistant"], ["assistant"]]
    assert all(texts)
    for entries in logprobs:
        assert entries and all(len(e.top_logprobs) == 2 for e in entries)  # type: ignore[attr-defined]
        assert all(isinstance(e.bytes, list) for e in entries)  # type: ignore[attr-defined]
    [usage] = usages
    assert isinstance(usage, openai.types.CompletionUsage)
    assert usage.completion_tokens == sum(len(e) for e in logprobs)


def test_chat_refusals_name_the_field(client: openai.OpenAI) -> None:
    # tools and response_format are honoured (tests/test_http_tool_calls.py,
    # tests/test_http_structured_output.py); what conflicts is refused by field
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=[tool],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "g"}},
        )  # fmt: skip
    assert bad.value.param == "tool_choice.function.name"
    with pytest.raises(openai.BadRequestError, match="response_format.json_schema.schema"):
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "strin"}}},
        )  # fmt: skip
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].role"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}])  # type: ignore[list-item, misc]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="bundled", messages=QUESTION)
