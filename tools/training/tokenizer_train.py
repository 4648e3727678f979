"""Train the bundled byte-level BPE tokenizer on the training split of the corpus."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from spectrio.tools.training.corpus import corpus_files, read_texts

EOS_TOKEN = "<|endoftext|>"


def train_tokenizer(vocab_size: int = 4096) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(read_texts(corpus_files("train")), trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, path: Path) -> None:
    tok.save(str(path))
