"""Issue 4 end to end: sampling knobs, exact stops, logprobs and the step record, through
the real five-stage pipeline (float64, encoded channels, each under ``trio.fail_after``).

Where a check needs the target's own view, it recomputes it with a dense float64 forward
pass of the same checkpoint (no paging, no speculation)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import msgspec
import numpy as np
import paddle
import pytest
import trio
from pipeline_helpers import oracle, prompts

from spectrio import Delta, RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.core.messages import PublishedStep
from spectrio.core.record import PREEMPTED, unpack
from spectrio.models import BUNDLED_DIR, load

MAX_TOKENS = 24


def config(k: int | None = 2, **kw: object) -> RuntimeConfig:
    spec = (
        SpeculativeConfig(method=None)
        if k is None
        else SpeculativeConfig(num_speculative_tokens=k, adaptive=False)
    )
    fields: dict[str, object] = {
        "dtype": "float64",
        "max_model_len": 256,
        "max_num_seqs": 32,
        "max_num_batched_tokens": 512,
        "speculative": spec,
    }
    fields.update(kw)
    return RuntimeConfig(**fields)  # type: ignore[arg-type]


async def run_requests(
    cfg: RuntimeConfig,
    requests: Sequence[tuple[Sequence[int], SamplingParams]],
    records: list[PublishedStep] | None = None,
    after_first: dict[int, int] | None = None,
) -> list[list[Delta]]:
    """Run requests concurrently (request ``i`` in ``after_first`` waits for the first delta
    of request ``after_first[i]``); return each one's deltas. Checks every block is freed."""
    out: list[list[Delta]] = [[] for _ in requests]
    first = [trio.Event() for _ in requests]
    with trio.fail_after(240):
        async with open_runtime(cfg, encoded_channels=True) as rt:
            if records is not None:
                rt.add_record_observer(records.append)

            async def one(i: int) -> None:
                if after_first and i in after_first:
                    await first[after_first[i]].wait()
                prompt, params = requests[i]
                async for delta in rt.generate(list(prompt), params, request_id=f"q{i}"):
                    out[i].append(delta)
                    first[i].set()

            async with trio.open_nursery() as nursery:
                for i in range(len(requests)):
                    nursery.start_soon(one, i)
            await rt.wait_idle()
            assert rt.blocks.num_used_blocks == 0
            assert rt.sampler.num_states == 0
    return out


def tokens_of(deltas: list[Delta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def text_of(deltas: list[Delta]) -> str:
    return "".join(d.text for d in deltas)


@lru_cache(maxsize=1)
def model64() -> object:
    return load("bundled", dtype="float64").model


def dense_logits(prompt: Sequence[int], output: Sequence[int]) -> np.ndarray:
    """float64 [len(output), V]: row j is the target's logits for output token j."""
    ids = paddle.to_tensor(np.asarray([list(prompt) + list(output)], dtype=np.int64))
    with paddle.no_grad():
        logits, _, _ = model64().forward_dense(ids)  # type: ignore[attr-defined]
    return logits.numpy()[0, len(prompt) - 1 : len(prompt) - 1 + len(output)].astype(np.float64)


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module")
def batch(bundled64: object) -> list[list[int]]:
    return prompts(bundled64.tokenizer)  # type: ignore[attr-defined]


# ---- seeds ----------------------------------------------------------------------------


async def test_seeded_sampling_reproduces_run_to_run_and_seeds_differ(
    batch: list[list[int]],
) -> None:
    def reqs(base: int) -> list[tuple[list[int], SamplingParams]]:
        return [
            (
                p,
                SamplingParams(
                    max_tokens=MAX_TOKENS,
                    temperature=0.9,
                    top_p=0.95,
                    seed=base + i,
                    ignore_eos=True,
                ),
            )
            for i, p in enumerate(batch[:6])
        ]

    # An unseeded neighbour shares nothing with the seeded requests.
    noise = (batch[7], SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0))
    first = await run_requests(config(2), reqs(100) + [noise])
    again = await run_requests(config(2), reqs(100))
    other = await run_requests(config(2), reqs(200))
    assert [tokens_of(d) for d in first[:6]] == [tokens_of(d) for d in again]
    assert [tokens_of(d) for d in first[:6]] != [tokens_of(d) for d in other]
    assert all(len(tokens_of(d)) == MAX_TOKENS for d in again)


# ---- allowed sets ---------------------------------------------------------------------


def top_k_set(logits: np.ndarray, k: int) -> set[int]:
    return set(np.argsort(-logits, kind="stable")[:k].tolist())


def top_p_set(logits: np.ndarray, top_p: float, temperature: float) -> set[int]:
    p = np.exp(log_softmax(logits / temperature))
    order = np.argsort(-p, kind="stable")
    mass_before = np.cumsum(p[order]) - p[order]
    return set(order[mass_before < top_p].tolist())


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.2, top_k=4), SamplingParams(temperature=1.2, top_p=0.5)],
    ids=["top_k", "top_p"],
)
async def test_every_emitted_token_lies_in_the_allowed_set(
    params: SamplingParams, batch: list[list[int]]
) -> None:
    reqs = [
        (p, msgspec.structs.replace(params, max_tokens=MAX_TOKENS, seed=i, ignore_eos=True))
        for i, p in enumerate(batch[:8])
    ]
    results = await run_requests(config(3), reqs)
    for (prompt, _), deltas in zip(reqs, results, strict=True):
        out = tokens_of(deltas)
        logits = dense_logits(prompt, out)
        for j, tok in enumerate(out):
            allowed = (
                top_k_set(logits[j], params.top_k)
                if params.top_k
                else top_p_set(logits[j], params.top_p, params.temperature)
            )
            assert tok in allowed, (j, tok, sorted(allowed))


# ---- penalties ------------------------------------------------------------------------


def penalised_greedy(
    prompt: Sequence[int], max_tokens: int, rep: float, freq: float, pres: float, eos: int | None
) -> list[int]:
    """One token at a time, dense, with the penalties written out longhand."""
    model = model64()
    out: list[int] = []
    with paddle.no_grad():
        logits, _, past = model.forward_dense(paddle.to_tensor(np.asarray([list(prompt)])))  # type: ignore[attr-defined]
        while True:
            row = logits.numpy()[0, -1].astype(np.float64)
            for t in set(prompt) | set(out):
                row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
            for t in set(out):
                row[t] -= freq * out.count(t) + pres
            tok = int(np.argmax(row))
            out.append(tok)
            if tok == eos or len(out) == max_tokens:
                return out
            logits, _, past = model.forward_dense(paddle.to_tensor(np.asarray([[tok]])), past)  # type: ignore[attr-defined]


async def test_penalties_are_exact_at_draft_positions(
    batch: list[list[int]], bundled64: object
) -> None:
    params = SamplingParams(
        max_tokens=MAX_TOKENS, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2
    )
    chosen = batch[:4] + batch[10:14]
    spec = await run_requests(config(3), [(p, params) for p in chosen])
    plain = await run_requests(config(None), [(p, params) for p in chosen])
    assert [tokens_of(d) for d in spec] == [tokens_of(d) for d in plain]
    eos = bundled64.config.eos_token_id  # type: ignore[attr-defined]
    for prompt, deltas in zip(chosen, spec, strict=True):
        assert tokens_of(deltas) == penalised_greedy(prompt, MAX_TOKENS, 1.3, 0.4, 0.2, eos)
    # The penalties changed something, and speculation did run.
    assert any(
        tokens_of(d) != oracle("float64", p, MAX_TOKENS) for p, d in zip(chosen, spec, strict=True)
    )
    assert sum(d.num_accepted for ds in spec for d in ds) > 0


# ---- stops ----------------------------------------------------------------------------


async def greedy_steps(
    prompts_: list[list[int]], k: int = 2, max_tokens: int = 48
) -> list[list[Delta]]:
    return await run_requests(
        config(k), [(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts_]
    )


def inside_run_positions(deltas: list[Delta]) -> list[int]:
    """Output indices of tokens that had further tokens after them in the same step."""
    out: list[int] = []
    at = 0
    for d in deltas:
        out += range(at, at + len(d.token_ids) - 1)
        at += len(d.token_ids)
    return out


async def test_stop_token_inside_an_accepted_run_beats_length(batch: list[list[int]]) -> None:
    free = await greedy_steps(batch)
    cases = []
    for prompt, deltas in zip(batch, free, strict=True):
        ref = tokens_of(deltas)
        for j in inside_run_positions(deltas):
            if ref[j] not in ref[:j]:
                cases.append((prompt, ref, j))
                break
    assert cases, (
        "no first-occurrence token inside an accepted run: is the checkpoint's MTP trained?"
    )
    reqs = []
    for prompt, ref, j in cases:
        # max_tokens puts the length limit inside the same run: the stop must win.
        reqs.append(
            (prompt, SamplingParams(max_tokens=j + 2, stop_token_ids=[ref[j]], ignore_eos=True))
        )
        reqs.append(
            (
                prompt,
                SamplingParams(
                    max_tokens=j + 1, stop_token_ids=[ref[j]], ignore_eos=True, logprobs=3
                ),
            )
        )
    results = await run_requests(config(2), reqs)
    for i, (_, ref, j) in enumerate(cases):
        for deltas in results[2 * i : 2 * i + 2]:
            assert tokens_of(deltas) == ref[: j + 1]
            assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
        last = results[2 * i][-1]
        assert last.num_accepted + 1 > len(last.token_ids)  # the run went on past the stop
        # Logprobs are trimmed together with the tokens.
        for d in results[2 * i + 1]:
            assert d.logprobs is not None and [lp.token_id for lp in d.logprobs] == d.token_ids


async def test_eos_mid_run_unless_ignored(batch: list[list[int]], tmp_path: Path) -> None:
    """A copy of the bundled checkpoint whose EOS id is a token the model emits mid-output."""
    free = await greedy_steps(batch)
    found = [
        (p, tokens_of(d), j)
        for p, d in zip(batch, free, strict=True)
        for j in inside_run_positions(d)
        if tokens_of(d)[j] not in tokens_of(d)[:j]
    ]
    assert found, (
        "no first-occurrence token inside an accepted run: is the checkpoint's MTP trained?"
    )
    prompt, ref, j = found[0]
    cfg_json = json.loads((BUNDLED_DIR / "config.json").read_text())
    cfg_json["eos_token_id"] = ref[j]
    (tmp_path / "config.json").write_text(json.dumps(cfg_json))
    for name in ("model.safetensors", "tokenizer.json"):
        (tmp_path / name).symlink_to(BUNDLED_DIR / name)
    stopped, ignored = await run_requests(
        config(2, model=str(tmp_path)),
        [
            (prompt, SamplingParams(max_tokens=48)),
            (prompt, SamplingParams(max_tokens=48, ignore_eos=True)),
        ],
    )
    assert tokens_of(stopped) == ref[: j + 1] and stopped[-1].finish_reason == "stop"
    assert tokens_of(ignored) == ref and ignored[-1].finish_reason == "length"
    # min_tokens past the EOS position masks it: the output can no longer stop there.
    (late,) = await run_requests(
        config(2, model=str(tmp_path)),
        [(prompt, SamplingParams(max_tokens=j + 3, min_tokens=j + 3))],
    )
    assert ref[j] not in tokens_of(late)[: j + 1] and late[-1].finish_reason == "length"


async def test_stop_string_across_tokens_cuts_text_and_tokens(
    batch: list[list[int]], bundled64: object
) -> None:
    tok = bundled64.tokenizer  # type: ignore[attr-defined]
    free = await greedy_steps(batch)
    cases = []
    for prompt, deltas in zip(batch, free, strict=True):
        ref = tokens_of(deltas)
        text = tok.decode(ref)
        for j in inside_run_positions(deltas):
            left, right = tok.decode(ref[:j]), tok.decode(ref[: j + 1])
            if j == 0 or "\ufffd" in right or len(right) <= len(left) or not right.startswith(left):
                continue
            # The shortest suffix of the text so far that crosses into token j and first
            # occurs right here (repetitive text needs a longer one).
            for n in range(len(right) - len(left) + 1, len(right) + 1):
                stop = right[-n:]
                if text.find(stop) == len(right) - n and len(right) - n > 0:
                    cases.append((prompt, ref, text, j, stop))
                    break
            else:
                continue
            break
    assert cases, "no stop string ends inside an accepted run: is the checkpoint's MTP trained?"
    results = await run_requests(
        config(2),
        [
            (p, SamplingParams(max_tokens=48, stop=["§§", stop], logprobs=1, ignore_eos=True))
            for p, _, _, _, stop in cases
        ],
    )
    for (_, ref, text, j, stop), deltas in zip(cases, results, strict=True):
        assert tokens_of(deltas) == ref[: j + 1]
        assert deltas[-1].finish_reason == "stop"
        assert text_of(deltas) == text[: text.find(stop)]
        assert stop not in text_of(deltas)
        assert sum(len(d.logprobs or []) for d in deltas) == j + 1


# ---- logprobs -------------------------------------------------------------------------


async def test_raw_logprobs_match_the_dense_target(batch: list[list[int]]) -> None:
    chosen = batch[:3] + batch[12:15]
    results = await run_requests(
        config(3), [(p, SamplingParams(max_tokens=MAX_TOKENS, logprobs=5)) for p in chosen]
    )
    for prompt, deltas in zip(chosen, results, strict=True):
        out = tokens_of(deltas)
        assert out == oracle("float64", prompt, MAX_TOKENS)
        for d in deltas:
            assert d.logprobs is not None and len(d.logprobs) == len(d.token_ids)
        lp = log_softmax(dense_logits(prompt, out))
        entries = [e for d in deltas for e in d.logprobs or []]
        for j, e in enumerate(entries):
            assert e.token_id == out[j] and e.rank == 1  # greedy picks the top token
            assert e.logprob == pytest.approx(lp[j, out[j]], abs=1e-9)
            assert [t for t, _ in e.top] == np.argsort(-lp[j], kind="stable")[:5].tolist()
            np.testing.assert_allclose([v for _, v in e.top], np.sort(lp[j])[::-1][:5], atol=1e-9)


# ---- the step record ------------------------------------------------------------------


def reassemble(records: list[PublishedStep]) -> dict[str, list[int]]:
    streams: dict[str, list[int]] = {}
    for pub in records:
        rec = unpack(pub.record)
        off = rec.offsets
        for slot, rid in enumerate(pub.request_ids):
            streams.setdefault(rid, []).extend(rec.token_ids[off[slot] : off[slot + 1]].tolist())
    return streams


async def test_record_marks_prefill_slots_and_carries_requested_widths(
    batch: list[list[int]],
) -> None:
    long_prompt = [t for p in batch[10:13] for t in p][:60]
    records: list[PublishedStep] = []
    reqs = [
        (batch[0], SamplingParams(max_tokens=MAX_TOKENS, logprobs=20)),
        (long_prompt, SamplingParams(max_tokens=8)),
        (batch[1], SamplingParams(max_tokens=MAX_TOKENS + 8, logprobs=0)),
    ]
    # The long prompt arrives once the others decode, so its chunks share steps with them.
    results = await run_requests(
        config(2, max_num_seqs=4, max_num_batched_tokens=12), reqs, records, after_first={1: 0}
    )
    assert reassemble(records) == {f"q{i}": tokens_of(d) for i, d in enumerate(results)}
    prefill_seen = False
    widths = set()
    for pub in records:
        rec = unpack(pub.record)
        slot_of = rec.slot_of_token
        if "q1" in pub.request_ids:
            s = pub.request_ids.index("q1")
            if rec.accept_num[s] == 0 and rec.num_tokens > 0:
                prefill_seen = True  # the long prompt is still prefilling while others emit
        widths.add(rec.width)
        if rec.width:
            assert rec.lp_ids is not None and rec.lp_vals is not None and rec.ranks is not None
            rids = [pub.request_ids[s] for s in slot_of]
            for row, rid in enumerate(rids):
                if rid == "q1":  # asked for no logprobs
                    assert (rec.lp_ids[row] == -1).all() and rec.ranks[row] == -1
                else:
                    assert rec.lp_ids[row, 0] == rec.token_ids[row]
                    assert (rec.lp_ids[row, (21 if rid == "q0" else 1) :] == -1).all()
    assert prefill_seen
    assert widths >= {21, 1}  # 21 while q0 runs, 1 once only q2 (logprobs=0) asks
    # The record's logprobs are the deltas' (as float32).
    lp_rows = [(pub, unpack(pub.record)) for pub in records]
    q0_vals = [float(np.float32(e.logprob)) for d in results[0] for e in d.logprobs or []]
    rec_vals = [
        float(rec.lp_vals[row, 0])
        for pub, rec in lp_rows
        if rec.width  # type: ignore[index]
        for row, s in enumerate(rec.slot_of_token)
        if pub.request_ids[s] == "q0"
    ]
    assert rec_vals == q0_vals


async def test_record_marks_preempted_slots(batch: list[list[int]]) -> None:
    records: list[PublishedStep] = []
    reqs = [(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in batch[:12]]
    results = await run_requests(config(2, num_kv_blocks=14, max_model_len=96), reqs, records)
    preempted = [
        (pub.request_ids[s], pub.step)
        for pub in records
        for s in np.flatnonzero(unpack(pub.record).accept_num == PREEMPTED)
    ]
    assert preempted, "the tiny KV pool should have forced a preemption"
    assert all(unpack(pub.record).width == 0 for pub in records)  # nobody asked for logprobs
    assert reassemble(records) == {f"q{i}": tokens_of(d) for i, d in enumerate(results)}
    for (prompt, _), deltas in zip(reqs, results, strict=True):
        assert tokens_of(deltas) == oracle("float64", prompt, MAX_TOKENS)


async def test_record_marks_aborted_slots(batch: list[list[int]]) -> None:
    records: list[PublishedStep] = []
    with trio.fail_after(120):
        async with open_runtime(config(2), encoded_channels=True) as rt:
            rt.add_record_observer(records.append)
            long = SamplingParams(max_tokens=40, ignore_eos=True)

            async def doomed() -> None:
                async for delta in rt.generate(batch[0], long, request_id="doomed"):
                    if not delta.finished:
                        assert await rt.abort("doomed")

            async def survivor() -> None:
                async for _ in rt.generate(batch[1], long, request_id="survivor"):
                    pass

            async with trio.open_nursery() as nursery:
                nursery.start_soon(survivor)
                nursery.start_soon(doomed)
            await rt.wait_idle()
            assert rt.blocks.num_used_blocks == 0 and rt.sampler.num_states == 0
    marks = [
        (pub.step, pub.finish_reasons[s])
        for pub in records
        for s in np.flatnonzero(unpack(pub.record).accept_num == PREEMPTED)
        if pub.request_ids[s] == "doomed"
    ]
    assert len(marks) == 1 and marks[0][1] == "abort"
    later = [pub for pub in records if pub.step > marks[0][0]]
    assert later and all("doomed" not in pub.request_ids for pub in later)
