"""A GGUF file's vocabulary rebuilt as a ``tokenizers`` tokenizer, of either kind
``tokenizer.ggml.model`` names: ``gpt2`` (byte-level BPE) or ``llama`` (SentencePiece BPE);
:mod:`spectrio.models.loading.gguf_file` says how each is rebuilt."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from spectrio.errors import CheckpointError

__all__ = [
    "PRE_TOKENIZERS",
    "SPACE",
    "TOKENIZER_MODELS",
    "spm_merges",
    "tokenizer_config",
    "tokenizer_json",
]


class Fields(Protocol):
    """A GGUF file's metadata lookup (``GGUFFile._field``): the value under ``key``, else
    ``default``, else ``CheckpointError`` naming the key."""

    def __call__(self, key: str, default: Any = ...) -> Any: ...


# Pre-tokenizer regexes of the byte-level BPE vocabularies, by ``tokenizer.ggml.pre``.
# None: the GPT-2 split that ``tokenizers``' ByteLevel applies itself.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = ("default", "gpt-2", "gpt2", "smollm", "llama-bpe", "llama3", "qwen2")

TOKENIZER_MODELS = ("gpt2", "llama")
"""The ``tokenizer.ggml.model`` kinds that load: byte-level BPE and SentencePiece BPE."""

# gguf's token types (llama.cpp's ``llama_token_type``, SentencePiece's piece types).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"
"""SentencePiece's visible space: it writes " " as this, and its pieces hold it."""


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece BPE vocabulary implies, best first.

    SentencePiece stores no merges: it joins the adjacent pair whose join is the piece of
    highest score. So a merge ``(a, b)`` exists wherever ``a``, ``b`` and ``a + b`` are all
    normal pieces, ranked by the score of ``a + b`` (higher first); ties go to the longer
    ``a``, then the longer ``b``, then the lower ids of ``a + b``, ``a`` and ``b``, as Hugging
    Face's ``generate_merges`` orders them. Control, unknown, user-defined, unused and
    byte tokens take no part: SentencePiece never merges into or out of them."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] == _NORMAL}
    ranked: list[tuple[float, int, int, int, int, int]] = []
    for i, piece in enumerate(tokens):
        if types[i] != _NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = ids.get(piece[:cut]), ids.get(piece[cut:])
            if left is not None and right is not None:
                ranked.append((-scores[i], -cut, cut - len(piece), i, left, right))
    ranked.sort()
    return [(tokens[left], tokens[right]) for *_, left, right in ranked]


def tokenizer_json(field: Fields, path: Path) -> str | None:
    """The vocabulary as a ``tokenizers`` JSON document, or None when the file has
    none. Refuses a vocabulary it cannot rebuild exactly."""
    from tokenizers import AddedToken

    kind = field("tokenizer.ggml.model", None)
    if kind is None:
        return None
    if kind not in TOKENIZER_MODELS:
        raise CheckpointError(
            f"{path}: tokenizer.ggml.model {kind!r} is not supported (supported: "
            "'gpt2', a byte-level BPE; 'llama', a SentencePiece BPE)"
        )
    tokens = [str(t) for t in field("tokenizer.ggml.tokens")]
    types = [int(t) for t in field("tokenizer.ggml.token_type", [_NORMAL] * len(tokens))]
    if len(types) != len(tokens):
        raise CheckpointError(
            f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError(f"{path}: tokenizer.ggml.tokens repeats a token")
    if kind == "gpt2":
        tok = _byte_level(field, path, vocab)
        added = [
            AddedToken(t, special=(kind_ == _CONTROL), normalized=False)
            for t, kind_ in zip(tokens, types, strict=True)
            if kind_ in (_CONTROL, _USER_DEFINED)
        ]
    else:
        tok = _sentencepiece(field, path, tokens, types)
        # llama.cpp cuts these out of a prompt whole (the unknown token too); control
        # and unknown tokens are special (dropped when decoding), user-defined ones
        # are text.
        added = [
            AddedToken(t, special=(kind_ != _USER_DEFINED), normalized=False)
            for t, kind_ in zip(tokens, types, strict=True)
            if kind_ in (_UNKNOWN, _CONTROL, _USER_DEFINED)
        ]
    tok.add_tokens(added)
    return str(tok.to_str())


def _byte_level(field: Fields, path: Path, vocab: dict[str, int]) -> Any:
    """``tokenizer.ggml.model == "gpt2"``: a byte-level BPE with the file's merges and
    the pre-tokenizer ``tokenizer.ggml.pre`` names."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = str(field("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(
            f"{path}: tokenizer.ggml.pre {pre!r} is not supported "
            f"(supported: {', '.join(PRE_TOKENIZERS)})"
        )
    merges = [tuple(str(m).split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]
    if any(len(m) != 2 for m in merges):
        raise CheckpointError(f"{path}: tokenizer.ggml.merges has a malformed entry")
    ignore_merges = pre in ("llama-bpe", "llama3")
    try:
        bpe = models.BPE(
            vocab, [(a, b) for a, b in merges], fuse_unk=False, ignore_merges=ignore_merges
        )
    except Exception as exc:  # tokenizers raises a bare Exception
        raise CheckpointError(
            f"{path}: tokenizer.ggml.tokens and merges do not agree ({exc})"
        ) from exc
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
    if pre in split:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split[pre]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(field: Fields, path: Path, tokens: list[str], types: list[int]) -> Any:
    """``tokenizer.ggml.model == "llama"``: SentencePiece BPE, as Hugging Face's Llama
    tokenizer rebuilds it: a BPE with byte fallback (``<0xNN>`` tokens) whose merges
    come from the scores (:func:`spm_merges`); spaces written as U+2581 with one
    prepended to each run of text (``tokenizer.ggml.add_space_prefix``, default true);
    a decoder that undoes both; BOS/EOS added per ``add_bos_token``/``add_eos_token``
    (default true/false) when special tokens are asked for."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors

    raw_scores = field("tokenizer.ggml.scores", None)
    if raw_scores is None:
        raise CheckpointError(
            f"{path}: tokenizer.ggml.model 'llama' (SentencePiece) needs "
            "tokenizer.ggml.scores, which the file does not have"
        )
    scores = [float(s) for s in raw_scores]
    if len(scores) != len(tokens):
        raise CheckpointError(
            f"{path}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens"
        )
    unk_id = _token_id(field, tokens, "unknown_token_id")
    merges = spm_merges(tokens, scores, types)
    try:
        bpe = models.BPE(
            {t: i for i, t in enumerate(tokens)},
            merges,
            unk_token=None if unk_id is None else tokens[unk_id],
            fuse_unk=True,
            byte_fallback=True,
        )
    except Exception as exc:  # tokenizers raises a bare Exception
        raise CheckpointError(
            f"{path}: tokenizer.ggml.tokens is not a SentencePiece vocabulary ({exc})"
        ) from exc
    tok = Tokenizer(bpe)
    prefix = bool(field("tokenizer.ggml.add_space_prefix", True))
    # A normalizer, not a Metaspace pre-tokenizer: Metaspace adds no "▁" to text that
    # already starts with a space, where SentencePiece and llama.cpp do (" a" is
    # "▁▁a"). It runs on each run of text between added tokens, so text after a
    # special token gets its own "▁", as llama.cpp gives it.
    space = normalizers.Replace(" ", SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), space]) if prefix else space
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    ends = []  # (token, id) added before and after the text
    for key, flag, default in (
        ("bos_token_id", "add_bos_token", True),
        ("eos_token_id", "add_eos_token", False),
    ):
        index = _token_id(field, tokens, key)
        added = bool(field(f"tokenizer.ggml.{flag}", default))
        ends.append((tokens[index], index) if index is not None and added else None)
    bos, eos = ends
    if bos is not None or eos is not None:

        def seq(part: str, n: int) -> list[str]:
            around = [f"{bos[0]}:{n}"] if bos else [], [f"{eos[0]}:{n}"] if eos else []
            return [*around[0], f"${part}:{n}", *around[1]]

        tok.post_processor = processors.TemplateProcessing(
            single=seq("A", 0),
            pair=seq("A", 0) + seq("B", 1),
            special_tokens=[end for end in (bos, eos) if end is not None],
        )
    return tok


def _token_id(field: Fields, tokens: list[str], name: str) -> int | None:
    """The id ``tokenizer.ggml.{name}`` names; None when the file names none (or one
    past the vocabulary)."""
    index = field(f"tokenizer.ggml.{name}", None)
    if index is None or not 0 <= int(index) < len(tokens):
        return None
    return int(index)


def tokenizer_config(
    field: Fields, max_positions: int, chat_template: str | None
) -> dict[str, Any]:
    """``tokenizer_config.json`` content: the chat template and the special tokens."""
    tokens = field("tokenizer.ggml.tokens", None)
    out: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key, id_field in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        index = field(f"tokenizer.ggml.{id_field}", None)
        if tokens is not None and index is not None and 0 <= int(index) < len(tokens):
            out[key] = str(tokens[int(index)])
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say
    sentencepiece = field("tokenizer.ggml.model", None) == "llama"
    for flag, default in (("add_bos_token", sentencepiece), ("add_eos_token", False)):
        value = field(f"tokenizer.ggml.{flag}", None)
        if value is not None or default:
            out[flag] = bool(default if value is None else value)
    out["model_max_length"] = max_positions
    if chat_template is not None:
        out["chat_template"] = chat_template
    return out
