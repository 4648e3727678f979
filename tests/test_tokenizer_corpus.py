"""The corpus split and the bundled byte-level BPE tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from spectrio.models import BUNDLED_DIR, TextTokenizer
from spectrio.tools.training.corpus import corpus_files, is_held_out, read_texts, stdlib_root
from spectrio.tools.training.tokenizer_train import EOS_TOKEN


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer.from_file(BUNDLED_DIR / "tokenizer.json")


def test_split_is_deterministic_disjoint_and_about_ten_percent() -> None:
    train, held = corpus_files("train"), corpus_files("heldout")
    assert train == corpus_files("train")
    assert not set(train) & set(held)
    share = len(held) / (len(train) + len(held))
    assert 0.05 < share < 0.15, share
    root = stdlib_root()
    for path in train + held:
        parts = path.relative_to(root).parts
        assert "site-packages" not in parts and "test" not in parts
    assert all(is_held_out(p.relative_to(root).as_posix()) for p in held)
    with pytest.raises(ValueError):
        corpus_files("validation")


def test_round_trip_on_held_out_files(tok: TextTokenizer) -> None:
    files = corpus_files("heldout")
    texts = list(read_texts(files))
    assert len(texts) >= 20
    for text in texts:
        assert tok.decode(tok.encode(text)) == text


def test_vocabulary_and_eos(tok: TextTokenizer) -> None:
    assert 4000 <= tok.vocab_size <= 8192
    assert tok.encode(EOS_TOKEN) != []


def test_incremental_detokenizer_never_splits_a_character(tok: TextTokenizer) -> None:
    text = "s = 'héllo wörld — 世界 🚀 ok'\nprint(s)\n"
    ids = tok.encode(text)
    stream = tok.stream()
    deltas = [stream.push([i]) for i in ids]
    deltas.append(stream.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    # Some token must have ended inside a multi-byte character for this test to mean anything.
    assert any(d == "" for d in deltas[:-1])


def test_bundled_readme_documents_the_split() -> None:
    readme = Path(BUNDLED_DIR / "README.md")
    assert readme.exists()
    assert "held out" in readme.read_text().lower()


def test_incremental_detokenizer_equals_a_full_decode_on_held_out_files(tok: TextTokenizer) -> None:
    import random

    rng = random.Random(0)
    for text in list(read_texts(corpus_files("heldout")))[:8]:
        ids = tok.encode(text + " ünïcödé ✓ 😀")[:3000]
        stream = tok.stream()
        pos, out = 0, []
        while pos < len(ids):
            step = rng.randint(1, 4)
            out.append(stream.push(ids[pos : pos + step]))
            pos += step
        out.append(stream.flush())
        assert "".join(out) == tok.decode(ids) == stream.text


# ---- issue 9 item 14: one incremental detokenizer ----------------------------------------

# " —" is one token for the space and the first two bytes of the dash, then one for its
# last byte: a token whose text is a complete character followed by an incomplete one.
SPLIT_DASH = "x = 'a — b', y = \"世界 🚀\"\n"


def test_the_stop_matcher_and_the_streamed_text_agree_token_by_token(tok: TextTokenizer) -> None:
    from spectrio.stages.device.stops import StopStringMatcher

    ids = tok.encode(SPLIT_DASH * 3)
    assert any(tok.decode([t]).endswith("\ufffd") and tok.decode([t]).strip("\ufffd") for t in ids)
    matcher = StopStringMatcher(tok, ["never in this text"])
    stream = tok.stream()
    for t in ids:
        assert matcher.push(t) is None
        stream.push([t])
        assert matcher.num_chars == len(stream.text), (t, stream.text)
    assert stream.text == tok.decode(ids)


def test_streamed_text_equals_decode_for_any_tokens(tok: TextTokenizer) -> None:
    """Random ids (single bytes of broken UTF-8 included), pushed in random steps: the
    text streamed plus the flush equals one decode of all ids, and nothing but the flush
    ever ends in a held-back partial character."""
    import random

    rng = random.Random(9)
    byte_tokens = [i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd"]
    assert len(byte_tokens) > 50
    for _ in range(300):
        ids = [
            rng.choice(byte_tokens) if rng.random() < 0.4 else rng.randrange(tok.vocab_size)
            for _ in range(rng.randint(1, 40))
        ]
        stream = tok.stream()
        pos, out = 0, []
        while pos < len(ids):
            step = rng.randint(1, 4)
            out.append(stream.push(ids[pos : pos + step]))
            pos += step
        out.append(stream.flush())
        assert "".join(out) == tok.decode(ids) == stream.text, ids
        assert stream.flush() == ""


def test_the_detokenizer_is_tokenizers_decode_stream(tok: TextTokenizer) -> None:
    from tokenizers.decoders import DecodeStream

    from spectrio.stages.device.stops import StopStringMatcher

    stream = tok.stream()
    assert isinstance(stream._stream, DecodeStream)
    assert isinstance(StopStringMatcher(tok, ["x"])._detok, type(stream))
