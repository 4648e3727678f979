"""``spectrio train-mtp``'s stage 3: the MTP layer trained by self-distillation over its
chained substeps, with soft labels over the draft vocabulary's columns, held-out chained
acceptance, and the run's state saved so a stopped run resumes."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from spectrio.tools.training.mtp_features import (
    Batch,
    Features,
    make_batch,
    sample_picks,
    window_starts,
)
from spectrio.tools.training.mtp_generations import Sequences
from spectrio.tools.training.optim import lr_at

if TYPE_CHECKING:
    from spectrio.models.architecture.model import SpectrioForCausalLM
    from spectrio.models.ops.paddle_setup import paddle

log = structlog.get_logger("spectrio.train_mtp")


def soft_labels(
    top_ids: np.ndarray, top_probs: np.ndarray, columns: Columns
) -> tuple[paddle.Tensor, np.ndarray]:
    """Dense ``[B, T, C]`` labels over the logits' columns: the top-k probabilities of
    the tokens that have a column, renormalised to sum to 1; and a ``[B, T]`` mask of the
    rows that kept any probability (a row whose top-k all lie outside the draft
    vocabulary teaches nothing)."""
    from spectrio.models.ops.paddle_setup import paddle

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
        from spectrio.models.ops.paddle_setup import paddle

        weight = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        if model.lm_head is not None:
            weight = weight.t()  # Paddle's Linear is [in, out]; rows must be tokens
        if self.ids is not None:
            weight = paddle.gather(weight, paddle.to_tensor(self.ids), axis=0)
        weight = weight.detach()
        return lambda hidden: paddle.matmul(hidden, weight, transpose_y=True)


def chain_logits(model: SpectrioForCausalLM, batch: Batch, t: int, depth: int) -> list[Any]:
    """Each substep's logits ``[B, T, V]`` over the batch's windows (the runtime's chain,
    as ``tools/training/chain.py`` unrolls it)."""
    from spectrio.models.ops.paddle_setup import paddle
    from spectrio.tools.training.chain import mtp_chain

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
    from spectrio.models.ops.paddle_setup import paddle

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

    from spectrio.models.architecture.model import MTPLayer
    from spectrio.models.ops.paddle_setup import paddle

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
    from spectrio.models.loading.loader import load

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
        from spectrio.models.ops.paddle_setup import paddle

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
        from spectrio.models.ops.paddle_setup import paddle

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

    from spectrio.models.ops.paddle_setup import paddle
    from spectrio.tools.training.optim import optimizer

    F = paddle.nn.functional
    t, depth = args.window, args.draft_steps
    span = t + depth + 1
    assert model.mtp is not None
    for p in model.parameters():
        p.stop_gradient = True
    params = model.mtp.parameters()
    for p in params:
        p.stop_gradient = False
    opt = optimizer(params, args.lr)
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
