"""``spectrio train-mtp``: train an MTP head for a model that ships none.

The target is frozen; one DeepSeek-V3-style MTP layer learns to draft for it by
self-distillation, with the chained substeps ``tools/train.py``'s phase 2 uses (substep
j + 1 reads substep j's own output hidden state). Three stages, each kept in the work
folder, so an interrupted run resumes where it stopped:

1. **Generations.** The target's own greedy continuations of prompts: the user's text
   files cut into prompts (``--text``), or by default chat requests through the model's
   chat template (:mod:`spectrio.tools.chat_prompts`'s topic x task ones, or with
   ``--chat-prompts self`` ones the target writes itself) and windows of Python's
   standard library sources (the training split of ``tools/corpus.py``, never its
   held-out files). The runtime generates them, batched.
2. **Features.** One teacher-forced target pass over each sequence keeps the final
   normed hidden state and the top ``--top-k`` next-token probabilities at every
   position. Because the continuation is the target's own greedy output, the target's
   greedy chain after any generated prefix *is* the rest of the sequence, so the labels
   of every substep come from this one pass (``tools/train.py`` runs the target
   ``depth`` more times per step to get them).
3. **Training.** Windows of the features; substep j's loss is the soft cross-entropy
   to the target's (top-k, renormalised) distribution, counted only where its input
   chain is the target's greedy output. Held-out sequences measure the chained greedy
   acceptance per substep, which is what verification keeps.

The layer is written as a head file beside the model (:mod:`spectrio.models.mtp_head`),
which ``load`` then attaches, so ``spectrio serve --model DIR`` speculates with it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from spectrio.tools.chat_prompts import chat_prompts, usable_messages
from spectrio.tools.train import lr_at

if TYPE_CHECKING:
    from spectrio import Runtime, RuntimeConfig, SamplingParams
    from spectrio.models.loader import LoadedModel
    from spectrio.models.model import SpectrioForCausalLM
    from spectrio.models.paddle_setup import paddle

log = structlog.get_logger("spectrio.train_mtp")

# ---- prompts -------------------------------------------------------------------------


def text_windows(
    streams: list[np.ndarray], count: int, length: tuple[int, int], rng: np.random.Generator
) -> list[list[int]]:
    """``count`` token windows of random length in ``length`` from ``streams`` (each
    stream long enough), at random offsets weighted by size."""
    lo, hi = length
    streams = [s for s in streams if s.size > hi]
    if not streams:
        raise SystemExit(f"error: no text is longer than {hi} tokens")
    weights = np.array([s.size - hi for s in streams], dtype=np.float64)
    out = []
    for i in rng.choice(len(streams), size=count, p=weights / weights.sum()):
        n = int(rng.integers(lo, hi + 1))
        o = int(rng.integers(0, streams[i].size - n))
        out.append([int(x) for x in streams[i][o : o + n]])
    return out


def build_prompts(
    loaded: LoadedModel,
    args: argparse.Namespace,
    rng: np.random.Generator,
    messages: list[str] | None = None,
) -> list[list[int]]:
    """Token ids of every prompt: windows of ``--text`` files, or the default mix (chat
    turns of ``messages``, or of topic x task messages when None, and code windows)."""
    tok = loaded.tokenizer
    if tok is None:
        raise SystemExit("error: the model has no tokenizer; train-mtp needs one")
    length = (args.prompt_tokens // 2, args.prompt_tokens)
    if args.text:
        texts = [Path(p).read_text(encoding="utf-8", errors="replace") for p in args.text]
        streams = [np.asarray(tok.encode(t), dtype=np.int64) for t in texts]
        return text_windows(streams, args.prompts, length, rng)
    from spectrio.models.chat import chat_template_for
    from spectrio.tools.corpus import corpus_files, read_texts

    template = chat_template_for(loaded)
    n_chat = args.prompts // 2 if template is not None else 0
    if messages is None:
        messages = chat_prompts(n_chat, rng) if template is not None else []
    prompts = [
        template.encode([{"role": "user", "content": m}])
        for m in messages[:n_chat]
        if template is not None
    ]
    files = corpus_files("train")
    picked = [files[i] for i in rng.choice(len(files), size=min(400, len(files)), replace=False)]
    streams = [np.asarray(tok.encode(t), dtype=np.int64) for t in read_texts(picked)]
    prompts += text_windows(streams, args.prompts - len(prompts), length, rng)
    order = rng.permutation(len(prompts))
    return [prompts[i] for i in order]


# ---- stage 1: the target's own generations --------------------------------------------


@dataclass
class Sequences:
    """Prompt + greedy continuation per sequence, concatenated."""

    tokens: np.ndarray  # int32 [N]
    offsets: np.ndarray  # int64 [S + 1]
    prompt_lens: np.ndarray  # int64 [S]

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def seq(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def save(self, path: Path) -> None:
        np.savez(path, tokens=self.tokens, offsets=self.offsets, prompt_lens=self.prompt_lens)

    @classmethod
    def load(cls, path: Path) -> Sequences:
        with np.load(path) as z:
            return cls(z["tokens"], z["offsets"], z["prompt_lens"])

    @classmethod
    def build(cls, rows: list[tuple[list[int], list[int]]]) -> Sequences:
        lens = [len(p) + len(g) for p, g in rows]
        tokens = np.concatenate([np.asarray(p + g, dtype=np.int32) for p, g in rows])
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        return cls(tokens, offsets, np.asarray([len(p) for p, _ in rows], dtype=np.int64))


class PartialGenerations:
    """The generations finished so far, kept in the work folder while stage 1 runs, so an
    interrupted run generates only what is missing. An entry is reused only for the same
    prompt at the same index (the prompts are a pure function of the arguments and the
    seed, so a changed argument regenerates instead of mixing sets)."""

    def __init__(self, path: Path, prompts: list[list[int]]) -> None:
        self.path = path
        self.done: dict[int, list[int]] = {}
        self.seconds = 0.0  # generating, over every resumed run together
        if path.exists():
            with np.load(path) as z:
                self.seconds = float(z["seconds"]) if "seconds" in z else 0.0
                seqs = Sequences(z["tokens"], z["offsets"], z["prompt_lens"])
                for k, i in enumerate(z["index"].tolist()):
                    row = seqs.seq(k).tolist()
                    n = int(seqs.prompt_lens[k])
                    if i < len(prompts) and row[:n] == prompts[i]:
                        self.done[i] = row[n:]
        self.prompts = prompts

    def add(self, i: int, generated: list[int]) -> None:
        self.done[i] = generated

    def save(self) -> None:
        if not self.done:
            return
        index = sorted(self.done)
        seqs = Sequences.build([(self.prompts[i], self.done[i]) for i in index])
        tmp = self.path.with_name(self.path.stem + ".tmp.npz")
        np.savez(
            tmp,
            tokens=seqs.tokens,
            offsets=seqs.offsets,
            prompt_lens=seqs.prompt_lens,
            index=np.asarray(index, dtype=np.int64),
            seconds=np.float64(self.seconds),
        )
        tmp.replace(self.path)


def _generation_config(
    loaded: LoadedModel, args: argparse.Namespace, max_model_len: int
) -> RuntimeConfig:
    """The runtime both generation stages open on the loaded target: ``--gen-batch`` at
    once, no speculation."""
    from spectrio import RuntimeConfig, SpeculativeConfig

    return RuntimeConfig(
        model=str(loaded.path),
        max_num_seqs=args.gen_batch,
        max_model_len=max_model_len,
        speculative=SpeculativeConfig(method=None),
        num_threads=args.threads,
    )


async def _completion(
    rt: Runtime, prompt: list[int], params: SamplingParams
) -> tuple[list[int], str | None]:
    """One request's generated token ids and its finish reason."""
    ids: list[int] = []
    finish = None
    async with rt.generate(prompt, params) as stream:
        async for delta in stream:
            ids += delta.token_ids
            finish = delta.finish_reason or finish
    return ids, finish


async def _generate(
    loaded: LoadedModel,
    prompts: list[list[int]],
    args: argparse.Namespace,
    partial: PartialGenerations | None = None,
) -> list[tuple[list[int], list[int]]]:
    import trio
    from tqdm import tqdm

    from spectrio import SamplingParams, open_runtime
    from spectrio.models.chat import chat_template_for

    template = chat_template_for(loaded)
    stops = template.stop_token_ids() if template is not None else []
    config = _generation_config(loaded, args, args.prompt_tokens + args.gen_tokens + 64)
    params = SamplingParams(max_tokens=args.gen_tokens, stop_token_ids=stops)
    out: list[tuple[list[int], list[int]] | None] = [None] * len(prompts)
    kept = partial.done if partial is not None else {}
    for i, ids in kept.items():
        out[i] = (prompts[i], ids)
    bar = tqdm(
        total=len(prompts),
        initial=len(kept),
        desc="generations",
        unit="seq",
        mininterval=args.bar_interval,
    )
    last_save = t0 = time.perf_counter()
    base = partial.seconds if partial is not None else 0.0
    budget = args.gen_minutes * 60 - base if args.gen_minutes > 0 else math.inf

    def clock() -> None:
        if partial is not None:
            partial.seconds = base + time.perf_counter() - t0

    try:
        async with open_runtime(config, loaded=loaded, warmup=False) as rt:
            limit = trio.Semaphore(args.gen_batch * 2)

            async def one(i: int) -> None:
                nonlocal last_save
                async with limit:
                    ids, _ = await _completion(rt, prompts[i], params)
                    out[i] = (prompts[i], ids)
                    bar.update(1)
                    if partial is not None:
                        partial.add(i, ids)
                        if time.perf_counter() - last_save > args.save_every * 60:
                            clock()
                            partial.save()
                            last_save = time.perf_counter()

            # Past the budget, the unfinished generations are cancelled (the runtime
            # aborts them) and stage 2 goes on with the finished ones.
            with trio.move_on_after(max(0.0, budget)) as scope:
                async with trio.open_nursery() as nursery:
                    for i in range(len(prompts)):
                        if out[i] is None:
                            nursery.start_soon(one, i)
            if scope.cancelled_caught:
                log.info("generation budget spent", finished=sum(r is not None for r in out))
    finally:
        clock()
        if partial is not None:  # an interrupted run keeps what it finished
            partial.save()
    bar.close()
    return [row for row in out if row is not None]


MESSAGE_TOKENS = 64
"""The longest user message the target may write for itself (``--chat-prompts self``)."""


async def _write_messages(loaded: LoadedModel, count: int, args: argparse.Namespace) -> list[str]:
    """``count`` user messages the target writes itself: its chat template's opened user
    turn, sampled (temperature 1, top-p 0.95, one seed per draw) until the turn ends, and
    kept by :func:`~spectrio.tools.chat_prompts.usable_messages`. Draws go on in rounds
    until ``count`` are kept (at most eight rounds)."""
    import trio
    from tqdm import tqdm

    from spectrio import SamplingParams, open_runtime
    from spectrio.models.chat import chat_template_for

    template = chat_template_for(loaded)
    tok = loaded.tokenizer
    if template is None or tok is None:
        return []
    prefix = template.user_turn_prefix()
    stops = template.stop_token_ids()
    config = _generation_config(loaded, args, len(prefix) + MESSAGE_TOKENS + 8)
    written: list[tuple[str, bool]] = []
    kept: list[str] = []
    bar = tqdm(total=count, desc="user messages", unit="msg", mininterval=args.bar_interval)
    async with open_runtime(config, loaded=loaded, warmup=False) as rt:
        limit = trio.Semaphore(args.gen_batch * 2)

        async def one(i: int, base: int, out: list[tuple[str, bool] | None]) -> None:
            params = SamplingParams(
                max_tokens=MESSAGE_TOKENS,
                temperature=1.0,
                top_p=0.95,
                seed=args.seed * 1_000_003 + base + i,  # draw number base + i
                stop_token_ids=stops,
            )
            async with limit:
                ids, finish = await _completion(rt, prefix, params)
                out[i] = (tok.decode(ids), finish == "stop")

        for _ in range(8):
            need = count - len(kept)
            draws: list[tuple[str, bool] | None] = [None] * (need + need // 4 + 8)
            async with trio.open_nursery() as nursery:
                for i in range(len(draws)):
                    nursery.start_soon(one, i, len(written), draws)
            written += [d for d in draws if d is not None]
            before = len(kept)
            kept = usable_messages(written, count)
            bar.update(len(kept) - before)
            if len(kept) == count:
                break
    bar.close()
    log.info("user messages written", kept=len(kept), drawn=len(written))
    return kept


def user_messages(loaded: LoadedModel, args: argparse.Namespace) -> list[str] | None:
    """The chat messages of the default prompt mix: None for topic x task ones, or with
    ``--chat-prompts self`` the target's own (:func:`_write_messages`), kept in the work
    folder so a resumed run builds the same prompts."""
    if args.chat_prompts != "self" or args.text:
        return None
    import trio

    path = args.work_dir / "user_messages.json"
    if path.exists():
        return list(json.loads(path.read_text()))
    messages = trio.run(_write_messages, loaded, args.prompts // 2, args)
    path.write_text(json.dumps(messages, indent=0, ensure_ascii=False))
    return messages


# ---- stage 2: features of one teacher-forced pass -------------------------------------


@dataclass
class Features:
    hidden: np.ndarray  # float16 [N, d]: the target's final normed hidden state
    top_ids: np.ndarray  # int32 [N, K]: most likely next tokens at each position
    top_probs: np.ndarray  # float16 [N, K]: their probabilities


def compute_features(
    model: SpectrioForCausalLM, seqs: Sequences, top_k: int, folder: Path, bar_interval: float
) -> Features:
    """Hidden states and top-k next-token probabilities of every position, written as
    ``.npy`` files in ``folder`` (reused when they exist: features of a frozen target
    never change)."""
    from tqdm import tqdm

    from spectrio.models.paddle_setup import paddle

    files = {n: folder / f"{n}.npy" for n in ("hidden", "top_ids", "top_probs")}
    done = folder / "features.done"
    if done.exists():
        return Features(*(np.load(files[n], mmap_mode="r") for n in files))
    n, d = int(seqs.tokens.size), model.config.hidden_size
    hidden = np.lib.format.open_memmap(files["hidden"], "w+", np.float16, (n, d))
    top_ids = np.lib.format.open_memmap(files["top_ids"], "w+", np.int32, (n, top_k))
    top_probs = np.lib.format.open_memmap(files["top_probs"], "w+", np.float16, (n, top_k))
    lens = np.diff(seqs.offsets)
    order = np.argsort(lens)  # similar lengths together: little padding
    bar = tqdm(total=n, desc="features", unit="tok", unit_scale=True, mininterval=bar_interval)
    model.eval()
    i = 0
    with paddle.no_grad():
        while i < len(order):
            t = int(lens[order[i]])
            rows = max(1, 2048 // max(t, 1))
            group = order[i : i + rows]
            t = int(lens[group].max())
            ids = np.zeros((len(group), t), dtype=np.int64)
            for r, s in enumerate(group):
                ids[r, : lens[s]] = seqs.seq(int(s))
            logits, h, _ = model.forward_dense(paddle.to_tensor(ids))
            probs = paddle.nn.functional.softmax(logits, axis=-1)
            vals, idx = paddle.topk(probs, top_k, axis=-1)
            h_np, v_np, i_np = h.numpy(), vals.numpy(), idx.numpy()
            for r, s in enumerate(group):
                a, b = int(seqs.offsets[s]), int(seqs.offsets[s + 1])
                hidden[a:b] = h_np[r, : b - a]
                top_ids[a:b] = i_np[r, : b - a]
                top_probs[a:b] = v_np[r, : b - a]
            bar.update(int(lens[group].sum()))
            i += len(group)
    bar.close()
    for arr in (hidden, top_ids, top_probs):
        arr.flush()
    done.write_text("ok\n")
    return Features(hidden, top_ids, top_probs)


def frequent_tokens(seqs: Sequences, size: int, vocab: int, always: list[int]) -> np.ndarray | None:
    """The draft vocabulary: the ``size`` tokens most frequent in the generations (ties
    by id), plus ``always`` (the stop tokens), sorted; None when it would hold the whole
    vocabulary anyway (``size`` 0 or at least ``vocab``)."""
    if size <= 0 or size >= vocab:
        return None
    counts = np.bincount(seqs.tokens.astype(np.int64), minlength=vocab)
    order = np.lexsort((np.arange(vocab), -counts))  # most frequent first, then by id
    seen = order[: min(size, int((counts > 0).sum()))]
    return np.unique(np.concatenate([seen, np.asarray(always, dtype=np.int64)]))


# ---- stage 3: training ----------------------------------------------------------------


@dataclass
class Batch:
    ids: np.ndarray  # int64 [B, T + depth + 1]: tokens of each window
    hidden: np.ndarray  # float32 [B, T, d]: target hidden at window positions 0..T-1
    labels: list[tuple[np.ndarray, np.ndarray]]  # per substep: top ids, probs [B, T, K]
    valid: np.ndarray  # bool [depth, B, T]: substep j counts at row s


def window_starts(seqs: Sequences, chosen: np.ndarray, span: int) -> np.ndarray:
    """For each chosen sequence, how many windows of ``span`` tokens fit in it."""
    return np.maximum(0, np.diff(seqs.offsets)[chosen] - span + 1)


def make_batch(
    seqs: Sequences,
    feats: Features,
    chosen: np.ndarray,
    picks: list[tuple[int, int]],
    t: int,
    depth: int,
) -> Batch:
    """Windows ``(sequence, start)`` of ``t`` rows. Row s of substep j (0-based) reads the
    chain tokens at window positions ``s+1 .. s+1+j`` and is labelled with the target's
    distribution at ``s+1+j``; for j >= 1 the chain tokens after the first must be the
    target's own greedy output, so the row counts only where ``s + 2`` is past the
    prompt."""
    span = t + depth + 1
    ids, hid, valid = [], [], []
    lab_ids = [[] for _ in range(depth)]  # type: list[list[np.ndarray]]
    lab_p = [[] for _ in range(depth)]  # type: list[list[np.ndarray]]
    for seq, start in picks:
        a = int(seqs.offsets[seq]) + start
        ids.append(seqs.tokens[a : a + span])
        hid.append(feats.hidden[a : a + t])
        for j in range(depth):
            lab_ids[j].append(feats.top_ids[a + 1 + j : a + 1 + j + t])
            lab_p[j].append(feats.top_probs[a + 1 + j : a + 1 + j + t])
        pos = start + np.arange(t)
        greedy = pos + 2 >= int(seqs.prompt_lens[seq])
        valid.append(np.stack([np.ones(t, bool)] + [greedy] * (depth - 1)))
    return Batch(
        ids=np.stack(ids).astype(np.int64),
        hidden=np.stack(hid).astype(np.float32),
        labels=[
            (np.stack(lab_ids[j]).astype(np.int64), np.stack(lab_p[j]).astype(np.float32))
            for j in range(depth)
        ],
        valid=np.stack(valid, axis=1),
    )


def sample_picks(
    seqs: Sequences, chosen: np.ndarray, span: int, batch: int, rng: np.random.Generator
) -> list[tuple[int, int]]:
    fits = window_starts(seqs, chosen, span)
    p = fits / fits.sum()
    out = []
    for k in rng.choice(len(chosen), size=batch, p=p):
        out.append((int(chosen[k]), int(rng.integers(0, fits[k]))))
    return out


def soft_labels(
    top_ids: np.ndarray, top_probs: np.ndarray, columns: Columns
) -> tuple[paddle.Tensor, np.ndarray]:
    """Dense ``[B, T, C]`` labels over the logits' columns: the top-k probabilities of
    the tokens that have a column, renormalised to sum to 1; and a ``[B, T]`` mask of the
    rows that kept any probability (a row whose top-k all lie outside the draft
    vocabulary teaches nothing)."""
    from spectrio.models.paddle_setup import paddle

    cols, probs = columns.index(top_ids), top_probs.copy()
    probs[cols < 0] = 0.0
    mass = probs.sum(axis=-1, keepdims=True)
    probs = probs / np.maximum(mass, 1e-6)
    dense = paddle.zeros([*top_ids.shape[:2], columns.size], dtype="float32")
    labels = paddle.put_along_axis(
        dense,
        paddle.to_tensor(np.maximum(cols, 0)),
        paddle.to_tensor(probs.astype(np.float32)),
        axis=-1,
        reduce="add",  # a dropped id lands on column 0 with probability 0
    )
    return labels, mass[..., 0] > 0


class Columns:
    """Which token each logits column is: every token, or the draft vocabulary only.

    Training on the draft vocabulary's columns matches serving, which drafts from them
    only, and costs a fraction of the whole head's matmul, its softmax and its backward."""

    def __init__(self, vocab_size: int, draft_vocab: np.ndarray | None) -> None:
        self.ids = draft_vocab
        self.size = vocab_size if draft_vocab is None else int(draft_vocab.size)
        self._index: np.ndarray | None = None
        if draft_vocab is not None:
            self._index = np.full(vocab_size, -1, dtype=np.int64)
            self._index[draft_vocab] = np.arange(draft_vocab.size)

    def index(self, token_ids: np.ndarray) -> np.ndarray:
        """Each token's column (-1: none)."""
        return token_ids if self._index is None else self._index[token_ids]

    def tokens(self, cols: np.ndarray) -> np.ndarray:
        """Each column's token."""
        return cols if self.ids is None else self.ids[cols]

    def head(self, model: SpectrioForCausalLM) -> Any:
        """``compute_logits`` over these columns, with gradients to the hidden state
        only (the head is the frozen target's)."""
        from spectrio.models.paddle_setup import paddle

        weight = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        if model.lm_head is not None:
            weight = weight.t()  # Paddle's Linear is [in, out]; rows must be tokens
        if self.ids is not None:
            weight = paddle.gather(weight, paddle.to_tensor(self.ids), axis=0)
        weight = weight.detach()
        return lambda hidden: paddle.matmul(hidden, weight, transpose_y=True)


def chain_logits(model: SpectrioForCausalLM, batch: Batch, t: int, depth: int) -> list[Any]:
    """Each substep's logits ``[B, T, V]`` over the batch's windows (the runtime's chain,
    as ``tools/train.py`` unrolls it)."""
    from spectrio.models.paddle_setup import paddle
    from spectrio.tools.train import mtp_chain

    ids = paddle.to_tensor(batch.ids)
    hidden = paddle.to_tensor(batch.hidden)
    chain_tokens = [ids[:, 1 + j : 1 + j + t] for j in range(depth)]
    return mtp_chain(model, ids[:, :t], hidden, chain_tokens, depth)


def accepted_per_substep(
    logits: list[Any], batch: Batch, t: int, columns: Columns | None = None
) -> tuple[np.ndarray, int]:
    """Chained greedy acceptance per substep over the rows where the whole chain is the
    target's greedy output: substep j is kept only if it and every earlier one drafted
    the sequence's next token (logits over ``columns``: the draft vocabulary serving
    drafts from). Returns (share per substep, rows counted)."""
    from spectrio.models.paddle_setup import paddle

    def drafts(lg: Any) -> np.ndarray:
        best = paddle.argmax(lg, axis=-1).numpy()
        return best if columns is None else columns.tokens(best)

    depth = len(logits)
    hits = np.stack(
        [drafts(lg) == batch.ids[:, 2 + j : 2 + j + t] for j, lg in enumerate(logits)]
    )  # [depth, B, T]
    rows = batch.valid.all(axis=0)
    chained = np.cumprod(hits, axis=0)[:, rows]
    if chained.shape[1] == 0:
        return np.zeros(depth), 0
    return chained.mean(axis=1), int(chained.shape[1])


def attach_fresh_layer(model: SpectrioForCausalLM, seed: int) -> None:
    """Give the target an MTP layer that starts as a known predictor, not noise:
    ``eh_proj`` passes the hidden state through (small noise from the embedding), the
    block is a copy of the target's last decoder layer with its residual branches'
    output projections zeroed (so it starts as the identity), and ``shared_head.norm``
    is the target's final norm: the untrained layer predicts the token after next with
    the target's next-token distribution."""
    import dataclasses

    from spectrio.models.model import MTPLayer
    from spectrio.models.paddle_setup import paddle

    cfg = dataclasses.replace(model.config, num_nextn_predict_layers=1)
    paddle.seed(seed)
    mtp = MTPLayer(cfg)
    last = dict(model.model.layers[-1].named_parameters())
    d = cfg.hidden_size
    rng = np.random.default_rng(seed)
    with paddle.no_grad():
        for name, p in mtp.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                # Zero residual branches: the block starts as the identity, so the layer
                # first predicts what the target's own hidden state predicts.
                p.set_value(np.zeros(p.shape, dtype=np.float32))
            elif name in last:
                p.set_value(last[name].numpy())
            elif name == "shared_head.norm.weight":
                p.set_value(model.model.norm.weight.numpy())
            elif name == "eh_proj.weight":  # Paddle [in, out]: [2d, d], embedding rows first
                w = rng.normal(0, 0.02, (2 * d, d)).astype(np.float32)
                w[d:] += np.eye(d, dtype=np.float32)
                p.set_value(w)
            elif name.endswith("norm.weight"):
                p.set_value(np.ones(p.shape, dtype=np.float32))
    model.mtp = mtp
    model.config = cfg


def current_head_state(model_name: str) -> dict[str, Any]:
    """The MTP layer's weights of the head ``load`` attaches to this model (beside it, or
    shipped), for ``--init-head``: more training on new generations instead of starting
    over."""
    from spectrio.errors import CheckpointError
    from spectrio.models.loader import load

    other = load(model_name)
    if other.head_path is None or other.model.mtp is None:
        raise CheckpointError(f"--init-head: {model_name} has no MTP head to start from")
    log.info("starting from head", path=str(other.head_path))
    return {k: v.numpy() for k, v in other.model.mtp.state_dict().items()}


class Run:
    """The training loop's state, saved in the work folder after every ``--save-every``
    minutes and at the end, so ``train-mtp`` resumes where it stopped."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.step = 0
        self.seconds = 0.0
        self.curve: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.rng_state: dict[str, Any] | None = None

    @property
    def state_file(self) -> Path:
        return self.folder / "state.json"

    def load(self, model: SpectrioForCausalLM, opt: Any) -> bool:
        from spectrio.models.paddle_setup import paddle

        if not self.state_file.exists():
            return False
        raw = json.loads(self.state_file.read_text())
        self.step, self.seconds = int(raw["step"]), float(raw["seconds"])
        self.curve, self.evals, self.rng_state = raw["curve"], raw["evals"], raw["rng"]
        assert model.mtp is not None
        model.mtp.set_state_dict(paddle.load(str(self.folder / "mtp.pdparams")))
        saved = paddle.load(str(self.folder / "mtp.pdopt"))
        opt.set_state_dict(_rename_state(saved, _structured_names(model.mtp), invert=True))
        return True

    def save(self, model: SpectrioForCausalLM, opt: Any, rng: np.random.Generator) -> None:
        from spectrio.models.paddle_setup import paddle

        assert model.mtp is not None
        paddle.save(model.mtp.state_dict(), str(self.folder / "mtp.pdparams"))
        state = _rename_state(opt.state_dict(), _structured_names(model.mtp))
        paddle.save(state, str(self.folder / "mtp.pdopt"))
        state = {
            "step": self.step,
            "seconds": round(self.seconds, 1),
            "curve": self.curve,
            "evals": self.evals,
            "rng": rng.bit_generator.state,
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.state_file)


def _structured_names(layer: Any) -> dict[str, str]:
    """Paddle's generated parameter name (``linear_3.w_0``, which depends on how many
    layers the process built before) -> the parameter's path in ``layer``, which does not."""
    return {p.name: name for name, p in layer.named_parameters()}


def _rename_state(
    state: dict[str, Any], names: dict[str, str], invert: bool = False
) -> dict[str, Any]:
    """The optimizer's state with each accumulator's key (``<param name>_moment1_0``...)
    moved from Paddle's generated names to the structured ones (or back, ``invert``), so
    a resumed process finds its moments whatever its layers are called."""
    mapping = {v: k for k, v in names.items()} if invert else names
    out: dict[str, Any] = {}
    for key, value in state.items():
        match = max((n for n in mapping if key.startswith(n + "_")), key=len, default=None)
        out[key if match is None else mapping[match] + key[len(match) :]] = value
    return out


def train(
    model: SpectrioForCausalLM,
    seqs: Sequences,
    feats: Features,
    args: argparse.Namespace,
    on_save: Any,
    draft_vocab: np.ndarray | None = None,
) -> Run:
    from tqdm import tqdm

    from spectrio.models.paddle_setup import paddle
    from spectrio.tools.train import _optimizer

    F = paddle.nn.functional
    t, depth = args.window, args.draft_steps
    span = t + depth + 1
    assert model.mtp is not None
    for p in model.parameters():
        p.stop_gradient = True
    params = model.mtp.parameters()
    for p in params:
        p.stop_gradient = False
    opt = _optimizer(params, args.lr)
    run = Run(args.work_dir)
    rng = np.random.default_rng(args.seed)
    if run.load(model, opt):
        assert run.rng_state is not None
        rng.bit_generator.state = run.rng_state
        log.info("resumed", step=run.step, seconds=run.seconds)
    fits = window_starts(seqs, np.arange(len(seqs)), span)
    usable = np.flatnonzero(fits > 0)
    split = np.random.default_rng(0).permutation(usable)
    n_held = max(1, len(usable) // 20)
    held, trained = np.sort(split[:n_held]), np.sort(split[n_held:])
    eval_rng = np.random.default_rng(1)
    eval_picks = sample_picks(seqs, held, span, args.eval_windows, eval_rng)
    eval_batch = make_batch(seqs, feats, held, eval_picks, t, depth)
    weights = [float(x) for x in args.substep_weights.split(",")]
    if len(weights) != depth:
        raise SystemExit(f"error: --substep-weights needs {depth} values")
    columns = Columns(model.config.vocab_size, draft_vocab)
    # The chain's logits over the draft vocabulary's columns only (serving drafts from
    # them; the target's own compute_logits is left as it is for the model's owner).
    model.compute_logits = columns.head(model)  # type: ignore[method-assign]

    def evaluate() -> None:
        model.eval()
        with paddle.no_grad():
            acc = np.zeros(depth)
            rows = 0
            for i in range(0, len(eval_picks), args.batch_size):
                part = make_batch(seqs, feats, held, eval_picks[i : i + args.batch_size], t, depth)
                logits = chain_logits(model, part, t, depth)
                a, n = accepted_per_substep(logits, part, t, columns)
                acc, rows = acc + a * n, rows + n
        row = {
            "step": run.step,
            "seconds": round(run.seconds, 1),
            "accepted": [round(float(x), 4) for x in acc / max(rows, 1)],
            "rows": rows,
        }
        run.evals.append(row)
        log.info("held-out acceptance", **row)

    del eval_batch
    if not run.evals:
        evaluate()
    bar = tqdm(
        total=args.steps,
        initial=run.step,
        desc="train-mtp",
        unit="step",
        mininterval=args.bar_interval,
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    base_seconds = run.seconds
    last_save = t0
    budget = args.minutes * 60

    def progress() -> float:
        # Whichever budget is further along sets the schedule, so a run cut short by the
        # clock still ends at the low learning rate.
        return max(run.step / args.steps, run.seconds / budget if budget > 0 else 1.0)

    stop_reason = "steps"
    while run.step < args.steps:
        if run.seconds >= budget:
            stop_reason = "time budget"
            break
        batch = make_batch(
            seqs, feats, trained, sample_picks(seqs, trained, span, args.batch_size, rng), t, depth
        )
        logits = chain_logits(model, batch, t, depth)
        losses = []
        for j, lg in enumerate(logits):
            label, kept = soft_labels(*batch.labels[j], columns)
            ce = F.cross_entropy(lg, label, soft_label=True, reduction="none").squeeze(-1)
            mask = paddle.to_tensor((batch.valid[j] & kept).astype(np.float32))
            losses.append((ce * mask).sum() / paddle.clip(mask.sum(), min=1.0))
        loss = paddle.add_n([w * sl for w, sl in zip(weights, losses, strict=True)]) / sum(weights)
        lr = lr_at(run.step, progress(), args.lr, args.warmup)
        opt.set_lr(lr)
        loss.backward()
        opt.step()
        opt.clear_grad()
        acc, _ = accepted_per_substep([lg.detach() for lg in logits], batch, t, columns)
        run.step += 1
        run.seconds = base_seconds + time.perf_counter() - t0
        row = {"step": run.step, "lr": lr, "loss": round(float(loss), 4)}
        row.update({f"substep{j + 1}_loss": round(float(x), 4) for j, x in enumerate(losses)})
        row.update({f"substep{j + 1}_accepted": round(float(x), 4) for j, x in enumerate(acc)})
        run.curve.append(row)
        held_acc = run.evals[-1]["accepted"] if run.evals else []
        bar.set_postfix_str(
            f"loss {float(loss):.3f} held-out accepted " + "/".join(f"{x:.2f}" for x in held_acc),
            refresh=False,
        )
        bar.update(1)
        if run.step % args.eval_every == 0:
            evaluate()
        if time.perf_counter() - last_save > args.save_every * 60:
            run.save(model, opt, rng)
            on_save(run)
            last_save = time.perf_counter()
    bar.close()
    if not run.evals or run.evals[-1]["step"] != run.step:
        evaluate()
    run.save(model, opt, rng)
    on_save(run)
    log.info(
        "train-mtp stopped",
        reason=stop_reason,
        step=run.step,
        minutes=round(run.seconds / 60, 1),
        accepted=run.evals[-1]["accepted"],
    )
    return run


# ---- command line ---------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spectrio train-mtp",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="a folder, a .gguf file or a model name")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the head file to write (default: beside the model, where load finds it)",
    )
    p.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="generations, features and the resumable state (default: <cache>/train-mtp/<model>)",
    )
    p.add_argument("--fresh", action="store_true", help="ignore a previous run's state")
    p.add_argument(
        "--init-head",
        action="store_true",
        help="start from the model's current MTP head (beside it, or shipped) instead of "
        "a fresh layer; a resumed run's own state still comes first",
    )
    p.add_argument("--text", nargs="*", default=None, help="text files to draw prompts from")
    p.add_argument("--prompts", type=int, default=480, help="prompts to generate from")
    p.add_argument(
        "--chat-prompts",
        choices=("topics", "self"),
        default="topics",
        help="the default mix's chat half: topic x task requests written here, or "
        "requests the target writes itself (sampled from its template's user turn; far "
        "more varied, none on a topic spectrio bench --prompts chat holds out)",
    )
    p.add_argument("--prompt-tokens", type=int, default=128, help="longest text prompt")
    p.add_argument("--gen-tokens", type=int, default=192, help="tokens generated per prompt")
    p.add_argument("--gen-batch", type=int, default=32, help="concurrent generations")
    p.add_argument(
        "--gen-minutes",
        type=float,
        default=0.0,
        help="generation time budget, over every resumed run together: past it, training "
        "goes on with the generations finished so far (0: no budget)",
    )
    p.add_argument("--top-k", type=int, default=8, help="target probabilities kept per token")
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=8192,
        help="draft from the N tokens most frequent in the generations (0: the whole "
        "vocabulary); the head's matmul is most of a draft substep's cost on a large "
        "vocabulary, and output stays lossless whatever is drafted",
    )
    p.add_argument("--draft-steps", type=int, default=3, help="unrolled MTP substeps")
    p.add_argument("--substep-weights", default="1,1,1")
    p.add_argument("--window", type=int, default=96, help="rows per training window")
    p.add_argument("--batch-size", type=int, default=8, help="windows per step")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument(
        "--minutes",
        type=float,
        default=60.0,
        help="training time budget, over every resumed run together (raise it to extend)",
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-windows", type=int, default=48)
    p.add_argument("--save-every", type=float, default=5.0, help="minutes between saves")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--bar-interval", type=float, default=5.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from spectrio.errors import CheckpointError, ModelConfigError

    try:
        return _main(args)
    except (CheckpointError, ModelConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "interrupted: what was finished is kept in the work folder; the same command resumes",
            file=sys.stderr,
        )
        return 130


def _main(args: argparse.Namespace) -> int:
    import shutil

    import trio

    from spectrio.cache_dir import cache_dir
    from spectrio.core.config import RuntimeConfig
    from spectrio.models.loader import load, resolve_path
    from spectrio.models.mtp_head import head_path_for, save_head, target_fingerprint
    from spectrio.models.paddle_setup import configure_paddle

    threads = configure_paddle(RuntimeConfig(num_threads=args.threads).resolve_num_threads())
    path = resolve_path(args.model)
    name = args.model if args.model == path.name or not Path(args.model).exists() else None
    out: Path = args.out or head_path_for(path, name)
    if args.work_dir is None:
        args.work_dir = cache_dir() / "train-mtp" / (name or path.stem)
    if args.fresh and args.work_dir.exists():
        shutil.rmtree(args.work_dir)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    (args.work_dir / "args.json").write_text(
        json.dumps({k: str(v) for k, v in vars(args).items()}, indent=1)
    )
    log.info("train-mtp", model=str(path), out=str(out), work_dir=str(args.work_dir),
             threads=threads)  # fmt: skip

    loaded = load(args.model, mtp_head=False)
    model = loaded.model
    if loaded.config.has_mtp:
        raise SystemExit(
            "error: the model already has an MTP layer; train-mtp makes one for a model "
            "that has none"
        )
    from spectrio.models.loader import open_checkpoint

    # the target alone: a head already beside it (even a damaged one) is what we replace
    fingerprint = target_fingerprint(loaded.config, open_checkpoint(path, mtp_head=False)[1])

    # A resumed run's own layer replaces any starting point, so the head is read (a
    # second load of the model) only when training starts.
    resuming = Run(args.work_dir).state_file.exists()
    init_state = current_head_state(args.model) if args.init_head and not resuming else None
    seq_file = args.work_dir / "sequences.npz"
    if seq_file.exists():
        seqs = Sequences.load(seq_file)
        log.info("generations reused", sequences=len(seqs), tokens=int(seqs.tokens.size))
    else:
        rng = np.random.default_rng(args.seed)
        prompts = build_prompts(loaded, args, rng, user_messages(loaded, args))
        partial = PartialGenerations(args.work_dir / "generations.partial.npz", prompts)
        if partial.done:
            log.info("generations resumed", done=len(partial.done), prompts=len(prompts))
        t0 = time.perf_counter()
        rows = trio.run(_generate, loaded, prompts, args, partial)
        if not rows:
            raise SystemExit("error: no generation finished within --gen-minutes")
        seqs = Sequences.build(rows)
        seqs.save(seq_file)
        partial.path.unlink(missing_ok=True)
        log.info(
            "generations done",
            sequences=len(seqs),
            tokens=int(seqs.tokens.size),
            generated=int(seqs.tokens.size - seqs.prompt_lens.sum()),
            minutes=round((time.perf_counter() - t0) / 60, 1),
        )
    t0 = time.perf_counter()
    feats = compute_features(model, seqs, args.top_k, args.work_dir, args.bar_interval)
    log.info("features ready", minutes=round((time.perf_counter() - t0) / 60, 1))

    attach_fresh_layer(model, args.seed)
    if init_state is not None:
        assert model.mtp is not None
        model.mtp.set_state_dict(init_state)
    stops = [t for t in (loaded.config.eos_token_ids or ()) if t is not None]
    vocab = frequent_tokens(seqs, args.draft_vocab, loaded.config.vocab_size, list(stops))
    if vocab is not None:
        covered = float(np.isin(seqs.tokens, vocab).mean())
        log.info("draft vocabulary", tokens=int(vocab.size), covers=round(covered, 4))

    def write(run: Run) -> None:
        checksum = save_head(
            model,
            out,
            fingerprint,
            draft_vocab=vocab,
            steps=str(run.step),
            accepted=json.dumps(run.evals[-1]["accepted"] if run.evals else []),
        )
        (args.work_dir / "training_log.json").write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "curve": run.curve,
                    "evals": run.evals,
                }
            )  # fmt: skip
        )
        log.info("head written", path=str(out), sha256=checksum, step=run.step)

    run = train(model, seqs, feats, args, write, vocab)
    last = run.evals[-1]
    print(
        f"MTP head: {out} ({run.step} steps, {run.seconds / 60:.1f} min); held-out chained "
        f"acceptance per substep: {', '.join(f'{x:.3f}' for x in last['accepted'])}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
