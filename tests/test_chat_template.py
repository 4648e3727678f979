"""Chat templates rendered in Jinja2's sandbox: as transformers renders them, with the
turn's closing tokens as stop tokens, and refusing what a template must not do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from spectrio.errors import CheckpointError, InvalidRequest
from spectrio.models.loading.gguf_file import GGUFFile
from spectrio.models.text.chat import ChatTemplate
from spectrio.models.text.tokenizer import TextTokenizer

GOLDEN = json.loads((Path(__file__).resolve().parent / "data" / "smollm2_golden.json").read_text())

LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def tiny_tokenizer() -> TextTokenizer:
    words = ["<unk>", "hi", "there", "user", "assistant", "system"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|end_of_text|>"]  # fmt: skip
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    return TextTokenizer(tok, eos_token_id=tok.token_to_id("<|end_of_text|>"))


def test_smollm2_template_renders_as_transformers_did(smollm2_gguf: Path) -> None:
    from tokenizers import Tokenizer as RawTokenizer

    gguf = GGUFFile(smollm2_gguf)
    raw = gguf.tokenizer_json()
    assert raw is not None and gguf.chat_template is not None
    tok = TextTokenizer(RawTokenizer.from_str(raw), eos_token_id=2)
    chat = ChatTemplate(gguf.chat_template, tok, {"bos_token": "<|im_start|>"})
    for text, rendered, ids in zip(
        GOLDEN["chats"], GOLDEN["prompt_texts"], GOLDEN["prompt_ids"], strict=True
    ):
        messages = [{"role": "user", "content": text}]
        assert chat.render(messages) == rendered
        assert chat.encode(messages) == ids
    assert chat.stop_token_ids() == [2]  # <|im_end|>, which is also EOS
    # where a user's message begins: the default system turn, then the user turn opened
    prefix = chat.user_turn_prefix()
    assert tok.raw.decode(prefix, skip_special_tokens=False).endswith(
        "<|im_end|>\n<|im_start|>user\n"
    )
    assert GOLDEN["prompt_ids"][0][: len(prefix)] == prefix


def test_a_template_that_never_writes_the_message_has_no_user_turn() -> None:
    chat = ChatTemplate("{{ bos_token }}hello", tiny_tokenizer(), {"bos_token": ""})
    with pytest.raises(CheckpointError, match="does not write the user's message"):
        chat.user_turn_prefix()


def test_a_turn_closing_token_becomes_a_stop_token() -> None:
    tok = tiny_tokenizer()
    chat = ChatTemplate(LLAMA3_LIKE, tok, {"bos_token": "<|begin_of_text|>"})
    text = chat.render([{"role": "user", "content": "hi there"}])
    assert text.startswith("<|begin_of_text|><|start_header_id|>user")
    assert text.endswith("assistant<|end_header_id|>\n\n")
    eot, eos = tok.raw.token_to_id("<|eot_id|>"), tok.eos_token_id
    assert chat.stop_token_ids() == [eot, eos]


@pytest.mark.parametrize(
    "source,message",
    [
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "chat template failed"),
        ("{{ messages.append({'role': 'x'}) }}", "chat template failed"),
        ("{{ raise_exception('only user and assistant roles') }}", "only user and assistant"),
    ],
)
def test_the_sandbox_refuses_unsafe_templates(source: str, message: str) -> None:
    chat = ChatTemplate(source, tiny_tokenizer(), {})
    with pytest.raises(InvalidRequest, match=message):
        chat.render([{"role": "user", "content": "hi"}])


def test_a_template_that_does_not_compile_is_a_checkpoint_error() -> None:
    with pytest.raises(CheckpointError, match="chat template does not compile"):
        ChatTemplate("{% for %}", tiny_tokenizer(), {})


@pytest.mark.parametrize(
    "messages,message",
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        ([{"content": "hi"}], "string 'role'"),
        ([{"role": "user", "content": 3}], "string 'content'.* at index 0"),
    ],
)
def test_malformed_messages_are_refused(messages: object, message: str) -> None:
    chat = ChatTemplate(LLAMA3_LIKE, tiny_tokenizer(), {})
    with pytest.raises(InvalidRequest, match=message):
        chat.render(messages)  # type: ignore[arg-type]
