"""A tiny checkpoint folder with a chat template, whose greedy output is known in advance.

The model is a bigram table: each token's embedding is a one-hot row, every attention and
MLP output projection is zero (so the residual stream is the embedding itself), and the
untied LM head maps token ``t`` to one next token. Greedy decoding therefore follows
:data:`NEXT` exactly, in float32 as in float64, and a test can place the template's
end-of-turn token, the EOS tokens and ordinary words where it needs them:

    <|im_start|> user hi there <|im_end|> <|im_start|> assistant   (the rendered chat)
    -> hi -> there -> <|im_end|> -> friend -> bye -> <|eos2|> -> </s> -> hi ...

``<|im_end|>`` closes a turn in the template (so it is its stop token) but is not an EOS;
the config lists two EOS ids, ``</s>`` and ``<|eos2|>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Final

import numpy as np
import paddle
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from spectrio.models import ModelConfig, build_model, save_checkpoint

WORDS: Final = ["<unk>", "hi", "there", "user", "assistant", "system", "friend", "bye"]
SPECIALS: Final = ["<s>", "<|im_start|>", "<|im_end|>", "</s>", "<|eos2|>"]
VOCAB: Final = {w: i for i, w in enumerate([*WORDS, *SPECIALS])}

# A ChatML-like template: every turn, and the user's in particular, ends in <|im_end|>.
TEMPLATE: Final = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
# One that refuses a role, as real templates do with raise_exception.
STRICT_TEMPLATE: Final = (
    "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('only user and assistant roles') }}{% endif %}"
    "<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)

NEXT: Final = {
    "assistant": "hi",
    "hi": "there",
    "there": "<|im_end|>",
    "<|im_end|>": "friend",
    "friend": "bye",
    "bye": "<|eos2|>",
    "<|eos2|>": "</s>",
}
"""Each token's greedy successor; any token not listed is followed by ``hi``."""

ID: Final = VOCAB
IM_END: Final = VOCAB["<|im_end|>"]
EOS_IDS: Final = (VOCAB["</s>"], VOCAB["<|eos2|>"])


def chat_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel(dict(VOCAB), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    return tok


def write_chat_checkpoint(folder: Path, template: str | None = TEMPLATE) -> Path:
    """Write the bigram checkpoint (``config.json``, ``model.safetensors``,
    ``tokenizer.json`` and, with a ``template``, ``tokenizer_config.json``) to ``folder``."""
    size = len(VOCAB)
    cfg = ModelConfig(
        vocab_size=size,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        num_nextn_predict_layers=0,
        bos_token_id=VOCAB["<s>"],
        eos_token_id=EOS_IDS[0],
        eos_token_ids=EOS_IDS,
    )
    model = build_model(cfg, "float32", seed=0)
    head = np.zeros((cfg.hidden_size, size), dtype="float32")
    for token, i in VOCAB.items():
        head[i, VOCAB[NEXT.get(token, "hi")]] = 1.0
    with paddle.no_grad():
        for name, p in model.named_parameters():
            if name == "model.embed_tokens.weight":
                p.set_value(np.eye(size, cfg.hidden_size, dtype="float32"))
            elif name == "lm_head.weight":
                p.set_value(head)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.set_value(np.zeros(p.shape, dtype="float32"))
            elif name.endswith("norm.weight"):
                p.set_value(np.ones(p.shape, dtype="float32"))
    folder.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, folder)
    chat_tokenizer().save(str(folder / "tokenizer.json"))
    if template is not None:
        config = {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def ids(*tokens: str) -> list[int]:
    return [VOCAB[t] for t in tokens]
