"""Chat through the runtime (issue 42 item 4): ``rt.chat`` and ``rt.generate(messages)``
render the model's chat template and stop on its end-of-turn tokens; malformed chats and
models without a template are refused by name; ``spectrio generate --chat`` does the same
from the command line. Also: a config that lists several EOS ids stops on each of them.

The positive tests run a tiny checkpoint whose greedy output is a known chain
(``chat_helpers``): the template's end-of-turn token ``<|im_end|>`` is not an EOS and the
model emits it third, so it is the template that ends the answer there."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from chat_helpers import EOS_IDS, IM_END, STRICT_TEMPLATE, ids, write_chat_checkpoint

from spectrio import (
    Delta,
    InvalidRequest,
    RuntimeConfig,
    SamplingParams,
    SpeculativeConfig,
    open_runtime,
)
from spectrio.core.params import with_chat_stops
from spectrio.runtime.aio import open_runtime_asyncio

CHAT = [{"role": "user", "content": "hi there"}]
# <|im_start|> user hi there <|im_end|> <|im_start|> assistant
RENDERED = ids("<|im_start|>", "user", "hi", "there", "<|im_end|>", "<|im_start|>", "assistant")
ANSWER = ids("hi", "there", "<|im_end|>")


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_checkpoint(tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture(scope="module")
def strict_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_checkpoint(tmp_path_factory.mktemp("strict") / "model", STRICT_TEMPLATE)


def config(model: Path | str, method: str | None = None, k: int = 0) -> RuntimeConfig:
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, adaptive=False)
    return RuntimeConfig(
        model=str(model),
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        speculative=spec if method else SpeculativeConfig(method=None),
    )


async def run(stream: object) -> tuple[list[int], str, list[Delta]]:
    deltas = [d async for d in stream]  # type: ignore[attr-defined]
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), deltas


@pytest.mark.parametrize("method", [None, "ngram"])
async def test_chat_equals_generate_on_the_rendered_ids_and_stops_at_end_of_turn(
    chat_dir: Path, method: str | None
) -> None:
    """With n-gram drafting the end-of-turn token is a draft accepted inside a run: the
    stop still cuts the run right after it."""
    params = SamplingParams(max_tokens=10)
    with trio.fail_after(60):
        async with open_runtime(config(chat_dir, method, k=3 if method else 0)) as rt:
            prompt, chat_params = rt.chat_prompt(CHAT, params)
            assert prompt == RENDERED
            assert chat_params.stop_token_ids == [IM_END, EOS_IDS[0]]  # the template's, EOS
            chat_ids, chat_text, deltas = await run(rt.chat(CHAT, params))
            assert chat_ids == ANSWER  # the end-of-turn token is the last output token
            assert deltas[-1].finish_reason == "stop"
            assert chat_text == "hi there"  # as EOS, its text is not in the output text
            # generate(messages) is the same request; generate(ids) with the template's
            # stop tokens is too.
            assert (await run(rt.generate(CHAT, params)))[:2] == (chat_ids, chat_text)
            same = await run(rt.generate(prompt, chat_params))
            assert same[:2] == (chat_ids, chat_text)
            # Without them the model runs on past the end of the turn, to an EOS.
            plain_ids, _, plain = await run(rt.generate(prompt, params))
            assert plain_ids == ids("hi", "there", "<|im_end|>", "friend", "bye", "<|eos2|>")
            assert plain[-1].finish_reason == "stop"
            if method == "ngram":
                assert sum(d.num_accepted for d in deltas) >= 1


async def test_the_end_of_turn_token_is_treated_as_eos(chat_dir: Path) -> None:
    """min_tokens holds it back as it holds EOS back, and ignore_eos ignores it too."""
    with trio.fail_after(60):
        async with open_runtime(config(chat_dir)) as rt:
            held, _, _ = await run(rt.chat(CHAT, SamplingParams(max_tokens=10, min_tokens=3)))
            # <|im_end|> masked at position 3: the model's next best is the lowest id (0).
            assert held[:2] == ids("hi", "there") and held[2] != IM_END
            ignored, _, deltas = await run(
                rt.chat(CHAT, SamplingParams(max_tokens=8, ignore_eos=True))
            )
            assert ignored == ids(
                "hi", "there", "<|im_end|>", "friend", "bye", "<|eos2|>", "</s>", "hi"
            )
            assert deltas[-1].finish_reason == "length"
            # Stop tokens of the request's own stay first, and none is added twice.
            mine = SamplingParams(stop_token_ids=[ids("bye")[0], IM_END])
            assert with_chat_stops(mine, [IM_END, EOS_IDS[0]]).stop_token_ids == [
                ids("bye")[0],
                IM_END,
                EOS_IDS[0],
            ]


async def test_a_config_with_several_eos_ids_stops_on_each(chat_dir: Path) -> None:
    """config.json's ``eos_token_id: [</s>, <|eos2|>]``: the model emits <|eos2|> first,
    and that ends the request (before the fix only the first id, </s>, did)."""
    with trio.fail_after(60):
        async with open_runtime(config(chat_dir)) as rt:
            assert rt.loaded.config.eos_token_ids == EOS_IDS
            out, _, deltas = await run(rt.generate(ids("friend"), SamplingParams(max_tokens=10)))
            assert out == ids("bye", "<|eos2|>") and deltas[-1].finish_reason == "stop"
            out, _, _ = await run(rt.generate(ids("<|eos2|>"), SamplingParams(max_tokens=10)))
            assert out == ids("</s>")


MALFORMED = [
    ("hi", "wrong_type", "must be a non-empty list of messages"),
    ([], "empty_prompt", "must be a non-empty list of messages"),
    (["hi"], "wrong_type", r"each must be a message .* at index 0"),
    ([{"content": "hi"}], "wrong_type", "each must have a string 'role'"),
    (
        [CHAT[0], {"role": "user", "content": 3}],
        "wrong_type",
        "each must have a string 'content'.* at index 1",
    ),
]


async def test_malformed_chats_and_templates_that_refuse_are_refused(
    chat_dir: Path, strict_dir: Path
) -> None:
    with trio.fail_after(60):
        async with open_runtime(config(chat_dir)) as rt:
            for messages, code, rule in MALFORMED:
                with pytest.raises(InvalidRequest, match=f"^messages: {rule}") as info:
                    rt.chat(messages, SamplingParams())  # type: ignore[arg-type]
                assert info.value.field == "messages" and info.value.code == code
            # generate() takes a list of dicts as a chat; an empty list stays a prompt.
            with pytest.raises(InvalidRequest, match="string 'content'"):
                rt.generate([CHAT[0], {"role": "user"}])
            with pytest.raises(InvalidRequest, match="^prompt: must not be empty"):
                rt.generate([])
            long = [{"role": "user", "content": "hi " * 80}]
            with pytest.raises(InvalidRequest, match="^messages: rendered by the chat template"):
                rt.chat(long)
            assert rt.stats().waiting == 0 and not rt._requests  # nothing was submitted
        async with open_runtime(config(strict_dir)) as rt:
            system = [{"role": "system", "content": "hi"}, *CHAT]
            with pytest.raises(InvalidRequest, match="only user and assistant roles"):
                rt.chat(system)
            assert (await run(rt.chat(CHAT)))[0] == ANSWER


async def test_a_model_without_a_chat_template_refuses_chats_and_serves_prompts() -> None:
    """The bundled model has no template: a chat is refused naming that, never run with a
    guessed template; prompts are unaffected."""
    with trio.fail_after(120):
        cfg = RuntimeConfig(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=256)
        async with open_runtime(cfg) as rt:
            assert rt.chat_template is None
            for call in (lambda: rt.chat(CHAT), lambda: rt.generate(CHAT)):
                with pytest.raises(InvalidRequest) as info:
                    call()
                assert info.value.code == "no_chat_template"
                assert str(info.value).startswith(
                    "messages: model 'bundled' has no chat template"
                ), str(info.value)
            assert (await run(rt.generate("def f(", SamplingParams(max_tokens=2))))[0]


def test_the_asyncio_runtime_chats_too(chat_dir: Path) -> None:
    async def main() -> tuple[list[int], list[int], str]:
        async with open_runtime_asyncio(config(chat_dir)) as rt:
            params = SamplingParams(max_tokens=10)
            chat = [t async for d in rt.chat(CHAT, params) for t in d.token_ids]
            same = [t async for d in rt.generate(CHAT, params) for t in d.token_ids]
            try:
                rt.chat([{"role": "user"}])
                error = ""
            except InvalidRequest as exc:
                error = str(exc)
            return chat, same, error

    chat, same, error = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert chat == same == ANSWER
    assert error.startswith("messages: each must have a string 'content'")


# ---- the command line -----------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spectrio.tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_generate_chat_streams_the_answer(chat_dir: Path) -> None:
    flags = ("--model", str(chat_dir), "--no-spec", "--max-model-len", "64")
    proc = run_cli("generate", "--chat", "hi there", "--json", *flags)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["token_ids"] == ANSWER and out["finish_reason"] == "stop"
    assert out["text"] == "hi there"
    proc = run_cli("generate", "--chat", "hi there", "--system", "friend", *flags)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "hi there\n"  # the answer alone: no prompt is echoed
    assert "finish_reason=stop" in proc.stderr


def test_generate_chat_errors_are_one_line_and_status_2(chat_dir: Path) -> None:
    proc = run_cli("generate", "--chat", "hi", "--max-model-len", "128", "--no-spec")
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.splitlines()[-1]  # after Paddle's import-time warnings
    assert last.startswith("error: messages: model 'bundled' has no chat template"), last
    assert "Traceback" not in proc.stderr
    for args, message in [
        (("generate",), "give a PROMPT or --chat MESSAGE"),
        (("generate", "x", "--chat", "hi"), "give a PROMPT or --chat MESSAGE"),
        (("generate", "x", "--system", "be brief"), "--system needs --chat"),
    ]:
        proc = run_cli(*args)
        assert proc.returncode == 2 and proc.stderr.startswith(f"error: {message}"), proc.stderr
