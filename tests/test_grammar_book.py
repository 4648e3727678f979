"""Structured output's pure parts with SmolLM2's real tokenizer: the compiler's refusals,
the grammar book's state, forced drafts, cut drafts and masks, and the sampler under a
mask (greedy and sampled, with and without draft distributions)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from spectrio.core.constraints import Constraint, check_constraint
from spectrio.core.messages import SeqWork, StepPlan
from spectrio.core.params import SamplingParams, check_params
from spectrio.errors import InvalidRequest
from spectrio.models.loading.loader import load_text_side
from spectrio.models.text.tokenizer import TextTokenizer
from spectrio.stages.device.draft.base import TokenHistory
from spectrio.stages.device.grammar import GrammarCompiler
from spectrio.stages.device.grammar_book import GrammarBook
from spectrio.stages.device.sampler import Sampler

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def side() -> tuple[TextTokenizer, int, list[int]]:
    cfg, tok, _ = load_text_side("smollm2")
    assert tok is not None
    return tok, cfg.vocab_size, list(cfg.eos_token_ids)


@pytest.fixture(scope="module")
def compiler(side: tuple[TextTokenizer, int, list[int]]) -> GrammarCompiler:
    tok, vocab, eos = side
    return GrammarCompiler(tok, vocab, eos)


def _work(
    constraint: Constraint,
    *,
    prompt: list[int],
    output: list[int],
    drafts: int = 4,
    eos: list[int] | None = None,
    temperature: float = 0.0,
) -> SeqWork:
    """A decode work after ``output`` (its last token is the step's input)."""
    length = len(prompt) + len(output)
    return SeqWork(
        slot=0,
        seq_id=7,
        request_id="r",
        block_table=[0],
        start_pos=length - 1,
        token_ids=[(prompt + output)[-1]],
        sample=True,
        num_drafts=drafts,
        eos_token_ids=eos or [2],
        max_new_tokens=64,
        params=SamplingParams(temperature=temperature, seed=3, constraint=constraint),
        num_output=len(output),
        context_len=length,
        cached_ids=(prompt + output)[:-1],
    )


def _fold(book: GrammarBook, work: SeqWork) -> TokenHistory:
    history = TokenHistory()
    plan = StepPlan(step=1, seqs=[work])
    history.fold(plan)
    book.fold(plan, history)
    return history


# ---- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("constraint", "match"),
    [
        (Constraint.regex("a(b"), "unclosed group"),
        (Constraint.json_schema({"type": "strin"}), "Invalid type: strin"),
        (Constraint.json_schema({"type": "object", "dependentRequired": {}}), "dependentRequired"),
        (Constraint.grammar("start: foo"), "unknown name"),
        (Constraint(kind="json_schema", spec="{not json"), "JSON schema as JSON text"),
        (Constraint(kind="json_schema", spec="[1]"), "a JSON object"),
        (Constraint.choice([]), "non-empty list"),
        (Constraint(kind="regex"), "non-empty spec"),
    ],
)
def test_a_constraint_the_library_cannot_enforce_is_refused_naming_why(
    compiler: GrammarCompiler, constraint: Constraint, match: str
) -> None:
    with pytest.raises(InvalidRequest, match=match) as info:
        compiler.check(constraint)
    assert info.value.field == "constraint" and info.value.code == "invalid_constraint"


def test_options_that_fight_the_grammar_are_refused() -> None:
    c = Constraint.json_object()
    for bad in (
        SamplingParams(min_tokens=3, constraint=c),
        SamplingParams(ignore_eos=True, constraint=c),
    ):
        with pytest.raises(InvalidRequest, match="with a constraint"):
            check_params(bad, 100)
    assert check_constraint(Constraint.choice(["a", "b"])).choices == ["a", "b"]


def test_a_constraint_travels_in_msgpack_unchanged() -> None:
    params = SamplingParams(constraint=Constraint.json_schema(PERSON))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert back.constraint == params.constraint
    assert back.constraint is not None and back.constraint.schema() == PERSON


# ---- the book -------------------------------------------------------------------------------


def test_forced_tokens_are_drafted_and_a_refused_draft_is_cut(
    side: tuple[TextTokenizer, int, list[int]], compiler: GrammarCompiler
) -> None:
    tok = side[0]
    book = GrammarBook(compiler, threads=1)
    c = Constraint.json_schema(PERSON)
    prompt = tok.encode("Person:")
    work = _work(c, prompt=prompt, output=[], drafts=4)
    # a first work has no output: its input is the prompt's last token
    _fold(book, work)
    drafts, forced, replaced = book.constrain_drafts(StepPlan(step=1, seqs=[work]), {0: [5, 6]})
    assert tok.decode(drafts[0]).startswith('{"') and forced[0] == len(drafts[0])
    assert replaced == {0}
    # after '{"name": "Al', the proposer's drafts are cut at the first the grammar refuses
    out = tok.encode('{"name": "Al')
    book.release([7])
    work = _work(c, prompt=prompt, output=out, drafts=4)
    _fold(book, work)
    good = tok.encode("ice") + tok.encode('"')  # the string closes...
    bad = tok.encode("x")  # ...and only ", " may follow
    drafts, forced, replaced = book.constrain_drafts(
        StepPlan(step=2, seqs=[work]), {0: good + bad + good}
    )
    assert drafts[0] == good and not forced and not replaced


def test_masks_follow_the_drafts_and_stop_tokens_wait_for_the_grammars_end(
    side: tuple[TextTokenizer, int, list[int]], compiler: GrammarCompiler
) -> None:
    tok, vocab, _ = side
    book = GrammarBook(compiler, threads=1)
    yes, no = tok.encode("yes"), tok.encode("no")
    work = _work(Constraint.choice(["yes", "no"]), prompt=tok.encode("Q?"), output=[],
                 eos=[2, 17])  # fmt: skip
    _fold(book, work)
    work = msgspec.structs.replace(work, drafts=yes)
    rows = book.masks(StepPlan(step=1, seqs=[work]))[0]
    assert rows.shape == (len(yes) + 1, vocab)
    assert rows[0, yes[0]] and rows[0, no[0]] and not rows[0, 2] and not rows[0, 17]
    assert rows[-1, 2] and rows[-1, 17] and rows[-1].sum() == 2  # done: only the stops


def test_the_book_rolls_back_when_the_history_is_cut_and_forgets_on_release(
    side: tuple[TextTokenizer, int, list[int]], compiler: GrammarCompiler
) -> None:
    tok = side[0]
    book = GrammarBook(compiler, threads=1)
    c = Constraint.json_schema(PERSON)
    prompt = tok.encode("P:")
    out = tok.encode('{"name": "Bo", "age": 4')
    _fold(book, _work(c, prompt=prompt, output=out))
    assert book.holds(7)
    shorter = _work(c, prompt=prompt, output=out[:3])
    _fold(book, shorter)  # a fresh history: the book's matcher is ahead and rolls back
    drafts, _, _ = book.constrain_drafts(StepPlan(step=3, seqs=[shorter]), {0: out[3:6]})
    assert drafts[0] == out[3:6]
    book.release([7])
    assert not book.holds(7) and book.num_states == 0
    with pytest.raises(RuntimeError, match="break its grammar"):
        _fold(book, _work(c, prompt=prompt, output=tok.encode("nope")))


# ---- the sampler under a mask ----------------------------------------------------------------


def _allowed(vocab: int, tokens: list[int], rows: int) -> np.ndarray:
    mask = np.zeros((rows, vocab), dtype=bool)
    mask[:, tokens] = True
    return mask


def test_greedy_takes_the_best_allowed_token_and_random_draws_only_allowed_ones() -> None:
    vocab = 50
    rng = np.random.default_rng(0)
    allowed_ids = [3, 9, 41]
    c = Constraint.choice(["x"])  # the sampler reads only the masks
    for temperature in (0.0, 1.0):
        seen: set[int] = set()
        for seed in range(200 if temperature else 5):
            sampler = Sampler(vocab)
            logits = rng.normal(size=(1, vocab))
            logits[0, 0] = 50.0  # the unconstrained favourite, refused
            w = SeqWork(
                slot=0, seq_id=1, request_id="r", block_table=[0], start_pos=0, token_ids=[1],
                sample=True, num_drafts=0, eos_token_ids=[2], max_new_tokens=4,
                params=SamplingParams(temperature=temperature, seed=seed, constraint=c),
                context_len=1,
            )  # fmt: skip
            res = sampler.step(StepPlan(step=1, seqs=[w]), {0: logits},
                               allowed={0: _allowed(vocab, allowed_ids, 1)})  # fmt: skip
            tok = res.results[0].token_ids[0]
            assert tok in allowed_ids
            if not temperature:
                assert tok == max(allowed_ids, key=lambda t: logits[0, t])
            seen.add(tok)
        if temperature:
            assert seen == set(allowed_ids)


def test_draft_distributions_are_restricted_to_the_allowed_tokens() -> None:
    """A sampled draft was kept only where allowed: acceptance weighs it by the draft
    distribution restricted to the allowed tokens, renormalised. Two tokens allowed, the
    target puts 0.8 on the drafted one: over many keys the emitted token follows the
    masked target (0.8 / 0.2), which the unrestricted q (mostly on a refused token) would
    break."""
    vocab = 8
    c = Constraint.choice(["x"])
    p_logits = np.log(np.array([[1e-9, 0.8, 0.2, 1e-9, 1e-9, 1e-9, 1e-9, 1e-9]] * 2))
    q = np.array([[0.1, 0.1, 0.0, 0.8, 0.0, 0.0, 0.0, 0.0]])
    allowed = _allowed(vocab, [1, 2], 2)
    counts = np.zeros(vocab)
    for seed in range(3000):
        sampler = Sampler(vocab)
        w = SeqWork(
            slot=0, seq_id=1, request_id="r", block_table=[0], start_pos=0, token_ids=[1],
            sample=True, num_drafts=1, eos_token_ids=[7], max_new_tokens=1,
            params=SamplingParams(temperature=1.0, seed=seed, constraint=c), drafts=[1],
            context_len=1,
        )  # fmt: skip
        res = sampler.step(StepPlan(step=1, seqs=[w]), {0: p_logits}, draft_probs={0: q},
                           allowed={0: allowed})  # fmt: skip
        counts[res.results[0].token_ids[0]] += 1
    share = counts / counts.sum()
    assert share[[0, 3, 4, 5, 6, 7]].sum() == 0
    assert abs(share[1] - 0.8) < 0.03, share


def test_a_constrained_slot_without_masks_is_refused() -> None:
    sampler = Sampler(10)
    w = SeqWork(
        slot=0, seq_id=1, request_id="r", block_table=[0], start_pos=0, token_ids=[1],
        sample=True, num_drafts=0, eos_token_ids=[2], max_new_tokens=4,
        params=SamplingParams(constraint=Constraint.json_object()), context_len=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match="needs its grammar's masks"):
        sampler.step(StepPlan(step=1, seqs=[w]), {0: np.zeros((1, 10))})


def test_an_unsatisfiable_grammar_is_refused_before_it_runs(compiler: GrammarCompiler) -> None:
    """A grammar no text matches fails only at its first mask: the check tries one."""
    for bad in (Constraint.regex(r"a[^\s\S]b"), Constraint.grammar('start: x\nx: x "a"')):
        with pytest.raises(InvalidRequest, match="cannot be enforced") as info:
            compiler.check(bad)
        assert info.value.code == "invalid_constraint"


def test_malformed_constraints_from_the_embedding_api_are_refused() -> None:
    for bad in (
        Constraint.choice(["\ud800"]),
        Constraint(kind="regex", spec=5),  # type: ignore[arg-type]
        Constraint(kind="regexp", spec="a"),  # type: ignore[arg-type]
    ):
        with pytest.raises(InvalidRequest) as info:
            check_constraint(bad)
        assert info.value.field == "constraint" and info.value.code == "invalid_constraint"


def test_a_model_without_eos_refuses_constraints(
    side: tuple[TextTokenizer, int, list[int]],
) -> None:
    tok, vocab, _ = side
    with pytest.raises(InvalidRequest, match="no EOS token"):
        GrammarCompiler(tok, vocab, []).check(Constraint.json_object())


def test_a_text_stop_token_is_allowed_where_the_grammar_allows_it(
    side: tuple[TextTokenizer, int, list[int]], compiler: GrammarCompiler
) -> None:
    """``stop_token_ids`` may name a token the grammar needs as text: it stays allowed
    there (ending the output, as a stop string would), and drafts stop before it; a
    special stop token waits for the grammar's end."""
    tok = side[0]
    book = GrammarBook(compiler, threads=1)
    yes = tok.encode("yes")
    im_end = tok.encode("<|im_end|>")
    assert len(im_end) == 1 and compiler.tokenizer.is_special_token(im_end[0])
    work = _work(Constraint.choice(["yes"]), prompt=tok.encode("Q?"), output=[],
                 eos=[2, yes[0], im_end[0]])  # fmt: skip
    _fold(book, work)
    rows = book.masks(StepPlan(step=1, seqs=[work]))[0]
    assert rows[0, yes[0]] and not rows[0, 2] and not rows[0, im_end[0]]
    drafts, _, _ = book.constrain_drafts(StepPlan(step=1, seqs=[work]), {0: yes})
    assert 0 not in drafts  # the one draft is a stop token: none kept


def test_a_tokenizer_the_library_cannot_read_turns_constraints_off() -> None:
    """The tests' word-level chat tokenizer has no byte decoder llguidance can read:
    warming logs it (a server still serves) and a constrained request is refused."""
    from chat_helpers import chat_tokenizer

    tok = TextTokenizer(chat_tokenizer(), eos_token_id=0)
    compiler = GrammarCompiler(tok, tok.vocab_size, [0])
    compiler.warm()  # does not raise
    with pytest.raises(InvalidRequest, match="cannot be used for structured output") as info:
        compiler.check(Constraint.json_object())
    assert info.value.code == "invalid_constraint"


def test_a_matcher_in_error_ends_its_request_at_eos(
    side: tuple[TextTokenizer, int, list[int]], compiler: GrammarCompiler
) -> None:
    """A grammar the library fails inside (a limit hit mid-output) leaves its row allowing
    EOS alone: the request ends there, neither the engine nor the constraint gives way."""
    tok, vocab, _ = side
    book = GrammarBook(compiler, threads=1)
    work = _work(Constraint.json_schema(PERSON), prompt=tok.encode("P:"), output=[], drafts=0)
    _fold(book, work)
    matcher = book._states[work.seq_id].matcher
    assert not matcher.consume_token(tok.encode("nope")[0])  # the matcher is in error now
    rows = book.masks(StepPlan(step=1, seqs=[work]))[0]
    assert rows.shape == (1, vocab)
    assert rows[0, 2] and rows[0].sum() == 1
