"""``spectrio train-mtp``'s stage 2 and its training windows: the target's hidden states
and top-k next-token probabilities from one teacher-forced pass (kept in the work folder),
the draft vocabulary, and the batches of windows cut from them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from spectrio.tools.training.mtp_generations import Sequences

if TYPE_CHECKING:
    from spectrio.models.architecture.model import SpectrioForCausalLM


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

    from spectrio.models.ops.paddle_setup import paddle

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


# ---- the training windows (stage 3 reads them) ------------------------------------------


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
