"""Train the bundled checkpoint: a Llama target and the DeepSeek-V3-style MTP layer that
drafts for it. Two phases, each with its own time budget:

1. **Target.** Next-token cross-entropy plus ``mtp_weight`` times the MTP layer's
   cross-entropy for the token after next (DeepSeek-V3's joint objective), on windows of
   the training split. The joint term makes the target's hidden states carry what the
   draft needs and warms the MTP layer up.
2. **Draft.** The target is frozen (its weights, the shared embedding and head included,
   never change again, so nothing the runtime verifies moves). The MTP layer is trained
   over ``draft_steps`` UNROLLED substeps, exactly as the runtime drafts: substep 1 reads
   the target's hidden state at p and the token at p+1; substep j+1 reads substep j's own
   output hidden state and the token after it, attends to the real substep-1 entries up
   to p plus its own chain, and sits at MTP position p+j. It is DISTILLED from the
   target's own greedy continuation: the inputs of later substeps are the target's greedy
   tokens (the runtime keeps a draft only when it equals that token, so only that path
   matters), and each substep's label is the target's distribution for that position
   after that greedy prefix. Gradients flow through the whole chain.

Why two phases and not one joint run: the distillation labels are the target's own
predictions, which mean nothing until the target is trained, and they cost two extra
frozen target passes per step, which phase 1 does not pay.

Each phase stops at its step count or its ``--pN-minutes`` budget, whichever comes first,
and its cosine learning-rate schedule follows whichever of the two is further along, so a
slow (shared) machine still ends each phase at the low learning rate. The steps actually
run are in the log; pass them back as ``--p1-steps``/``--p2-steps`` with generous minutes
to replay a run step for step (seeded).

Run: ``python -m spectrio.tools.training.train --out DIR`` (or ``spectrio train``); it uses every
core the process may run on unless ``--threads`` says otherwise.
Beside the checkpoint: ``training_log.json`` (arguments, per-step curves, held-out
evaluations) and ``training_curves.png`` (needs the ``plots`` extra).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from spectrio.tools.cli.logging_setup import configure_logging
from spectrio.tools.training.chain import chain_accepted, heldout_eval, mtp_chain, target_chain
from spectrio.tools.training.optim import lr_at, optimizer

if TYPE_CHECKING:
    from spectrio.models.architecture.model import SpectrioForCausalLM

log = structlog.get_logger("spectrio.train")

DEFAULT_MODEL: dict[str, Any] = {
    # 16 narrow layers: per-op overhead dominates a forward at this size, so depth, not
    # width, sets the target's cost; one MTP substep measures ~15% of a target forward.
    "hidden_size": 192,
    "num_hidden_layers": 16,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "num_nextn_predict_layers": 1,
}


# ---- data ------------------------------------------------------------------------------


def encode_split(tokenizer: Any, split: str) -> np.ndarray:
    """All files of ``split`` tokenised and joined with EOS, as one uint16 stream."""
    from spectrio.tools.training.corpus import corpus_files, read_texts
    from spectrio.tools.training.tokenizer_train import EOS_TOKEN

    eos = tokenizer.token_to_id(EOS_TOKEN)
    texts = list(read_texts(corpus_files(split)))
    parts: list[np.ndarray] = []
    for enc in tokenizer.encode_batch(texts):
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
        parts.append(np.asarray([eos], dtype=np.uint16))
    return np.concatenate(parts)


def sample_windows(
    data: np.ndarray, rng: np.random.Generator, batch: int, length: int
) -> np.ndarray:
    starts = rng.integers(0, data.size - length, size=batch)
    return np.stack([data[s : s + length] for s in starts]).astype(np.int64)


# ---- the two phases -----------------------------------------------------------------


class Phase:
    """Step/time budget, learning rate and logging shared by both phases."""

    def __init__(self, name: str, steps: int, minutes: float, peak_lr: float, warmup: int) -> None:
        self.name, self.steps, self.budget = name, steps, minutes * 60.0
        self.peak_lr, self.warmup = peak_lr, warmup
        self.t0 = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def progress(self, step: int) -> float:
        by_time = self.elapsed / self.budget if self.budget > 0 else 1.0
        return max(step / max(1, self.steps), by_time)

    def lr(self, step: int) -> float:
        return lr_at(step, self.progress(step), self.peak_lr, self.warmup)


class Trainer:
    def __init__(
        self,
        args: argparse.Namespace,
        model: SpectrioForCausalLM,
        data: np.ndarray,
        heldout: np.ndarray,
    ) -> None:
        self.args, self.model, self.data, self.heldout = args, model, data, heldout
        self.rng = np.random.default_rng(args.seed)
        self.curve: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.t_start = time.perf_counter()
        self.last_save = time.perf_counter()

    def evaluate(self, phase: str, step: int) -> None:
        row = {
            "phase": phase,
            "step": step,
            "seconds": round(time.perf_counter() - self.t_start, 1),
        }
        row.update(heldout_eval(self.model, self.heldout, self.args.draft_steps))
        self.evals.append(row)
        log.info("held-out eval", **row)

    def _record(self, row: dict[str, Any], bar: Any) -> None:
        row["seconds"] = round(time.perf_counter() - self.t_start, 2)
        self.curve.append(row)
        bar.set_postfix(
            {k: f"{v:.3f}" for k, v in row.items() if k.endswith("loss")}, refresh=False
        )
        if row["step"] % 25 == 0:
            log.info(
                "train step",
                **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()},
            )
        if time.perf_counter() - self.last_save > self.args.save_every_minutes * 60:
            self.save()

    def phase1(self) -> None:
        from tqdm import tqdm

        from spectrio.models.ops.paddle_setup import paddle

        F = paddle.nn.functional

        a, model = self.args, self.model
        model.train()
        opt = optimizer(model.parameters(), a.p1_lr)
        ph = Phase("target", a.p1_steps, a.p1_minutes, a.p1_lr, a.warmup)
        bar = tqdm(
            total=a.p1_steps, desc="phase 1 (target)", unit="step", mininterval=a.bar_interval
        )
        step = 0
        while step < a.p1_steps and ph.progress(step) < 1.0:
            w = paddle.to_tensor(sample_windows(self.data, self.rng, a.batch_size, a.seq_len + 1))
            x, y = w[:, :-1], w[:, 1:]
            logits, hidden, _ = model.forward_dense(x)
            main_loss = F.cross_entropy(logits, y.unsqueeze(-1)).mean()
            # MTP position p pairs h_p with token p+1 and predicts token p+2.
            mtp_logits, _, _ = model.mtp_forward_dense(y[:, :-1], hidden[:, :-1])
            mtp_loss = F.cross_entropy(mtp_logits, y[:, 1:].unsqueeze(-1)).mean()
            loss = main_loss + a.mtp_weight * mtp_loss
            lr = ph.lr(step)
            opt.set_lr(lr)
            loss.backward()
            opt.step()
            opt.clear_grad()
            self._record(
                {
                    "phase": "target",
                    "step": step,
                    "lr": lr,
                    "loss": float(loss),
                    "main_loss": float(main_loss),
                    "mtp_loss": float(mtp_loss),
                },
                bar,
            )
            step += 1
            bar.update(1)
            if step % a.eval_every == 0:
                self.evaluate("target", step)
        bar.close()
        log.info("phase 1 done", steps=step, minutes=round(ph.elapsed / 60, 1))
        self.evaluate("target", step)
        self.save()

    def phase2(self) -> None:
        from tqdm import tqdm

        from spectrio.models.ops.paddle_setup import paddle

        F = paddle.nn.functional

        a, model = self.args, self.model
        assert model.mtp is not None
        mtp_params = model.mtp.parameters()
        mtp_ids = {id(p) for p in mtp_params}
        frozen = [p for p in model.parameters() if id(p) not in mtp_ids]
        for p in frozen:  # the target, its embedding and head never change in phase 2
            p.stop_gradient = True
        model.eval()  # no dropout anywhere; eval() only documents that the target is frozen
        opt = optimizer(mtp_params, a.p2_lr)
        weights = [float(x) for x in a.substep_weights.split(",")]
        if len(weights) != a.draft_steps:
            raise SystemExit(
                f"--substep-weights needs {a.draft_steps} values, got {a.substep_weights!r}"
            )
        ph = Phase("draft", a.p2_steps, a.p2_minutes, a.p2_lr, a.p2_warmup)
        bar = tqdm(
            total=a.p2_steps, desc="phase 2 (draft)", unit="step", mininterval=a.bar_interval
        )
        step = 0
        while step < a.p2_steps and ph.progress(step) < 1.0:
            w = paddle.to_tensor(sample_windows(self.data, self.rng, a.p2_batch_size, a.seq_len))
            with paddle.no_grad():
                # One level deeper than the drafts: substep j's label is level j.
                t_logits, hidden, tokens = target_chain(model, w, a.draft_steps + 1)
                labels = [F.softmax(lg / a.distill_temperature, axis=-1) for lg in t_logits[1:]]
            m_logits = mtp_chain(model, w, hidden, tokens, a.draft_steps)
            # Soft cross-entropy through F.cross_entropy: Paddle's CPU log_softmax is ~80x
            # slower (fwd+bwd) on [B, T, 4096] and would dominate the step.
            per_step = [
                F.cross_entropy(lg / a.distill_temperature, lab, soft_label=True).mean()
                for lab, lg in zip(labels, m_logits, strict=False)
            ]
            loss = paddle.add_n([wt * sl for wt, sl in zip(weights, per_step, strict=False)]) / sum(
                weights
            )
            lr = ph.lr(step)
            opt.set_lr(lr)
            loss.backward()
            opt.step()
            opt.clear_grad()
            acc = chain_accepted([lg.detach() for lg in m_logits], tokens)
            row: dict[str, Any] = {"phase": "draft", "step": step, "lr": lr, "loss": float(loss)}
            for j, (sl, ac) in enumerate(zip(per_step, acc, strict=False), start=1):
                row[f"substep{j}_loss"] = float(sl)
                row[f"substep{j}_accepted"] = float(ac)
            self._record(row, bar)
            step += 1
            bar.update(1)
            if step % a.p2_eval_every == 0:
                self.evaluate("draft", step)
        bar.close()
        for p in frozen:
            p.stop_gradient = False
        log.info("phase 2 done", steps=step, minutes=round(ph.elapsed / 60, 1))
        self.evaluate("draft", step)
        self.save()

    def save(self) -> None:
        from spectrio.models.loading.loader import save_checkpoint

        out: Path = self.args.out
        training = self.model.training
        self.model.eval()
        save_checkpoint(self.model, out, dtype=self.args.save_dtype)
        if training:
            self.model.train()
        meta = {
            "args": {k: str(v) for k, v in vars(self.args).items()},
            "config": self.model.config.to_dict(self.args.save_dtype),
            "params": sum(int(np.prod(p.shape)) for p in self.model.parameters()),
            "minutes": round((time.perf_counter() - self.t_start) / 60, 2),
            "curve": self.curve,
            "evals": self.evals,
        }
        (out / "training_log.json").write_text(json.dumps(meta))
        plot_curves(meta, out / "training_curves.png")
        self.last_save = time.perf_counter()


def plot_curves(meta: dict[str, Any], path: Path) -> bool:
    """Draw the loss and acceptance curves; returns False (and logs) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib missing (install the 'plots' extra); no PNG written")
        return False
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    p1 = [r for r in meta["curve"] if r["phase"] == "target"]
    p2 = [r for r in meta["curve"] if r["phase"] == "draft"]
    ax = axes[0]
    for key in ("main_loss", "mtp_loss"):
        if p1:
            ax.plot([r["step"] for r in p1], [r[key] for r in p1], label=key, lw=0.8)
    ax.set(title="phase 1: target (train loss)", xlabel="step", ylabel="cross-entropy")
    ax.legend()
    ax = axes[1]
    for j in range(1, 9):
        key = f"substep{j}_loss"
        if p2 and key in p2[0]:
            ax.plot([r["step"] for r in p2], [r[key] for r in p2], label=f"substep {j}", lw=0.8)
    ax.set(title="phase 2: draft (distillation loss)", xlabel="step", ylabel="soft cross-entropy")
    if p2:
        ax.legend()
    ax = axes[2]
    evals = meta["evals"]
    if evals:
        xs = list(range(len(evals)))
        depth = len(evals[0]["accepted"])
        for j in range(depth):
            ax.plot(
                xs,
                [e["accepted"][j] for e in evals],
                marker="o",
                label=f"accepted through substep {j + 1}",
            )
        ax.plot(
            xs,
            [e["heldout_loss"] / 10 for e in evals],
            ls="--",
            color="gray",
            label="held-out loss / 10",
        )
        ax.set_xticks(xs, [f"{e['phase'][0]}{e['step']}" for e in evals], rotation=60, fontsize=7)
        ax.legend(fontsize=8)
    ax.set(title="held-out (t = phase 1, d = phase 2)", ylim=(0, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- command line -------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from spectrio.models.loading.loader import BUNDLED_DIR, STORAGE_DTYPES

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=Path("models/bundled"))
    p.add_argument(
        "--tokenizer",
        default=str(BUNDLED_DIR / "tokenizer.json"),
        help="tokenizer.json to reuse, or 'train' to train a new BPE on the training split",
    )
    p.add_argument("--vocab-size", type=int, default=4096, help="only with --tokenizer train")
    p.add_argument("--model-json", type=str, default=None, help="override model fields (JSON)")
    p.add_argument(
        "--init-from", type=Path, default=None, help="start from this checkpoint's weights"
    )
    p.add_argument("--phases", default="12", choices=("12", "1", "2"), help="which phases to run")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU math threads (default: every core this process may use)",
    )
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--save-dtype", default="float16", choices=STORAGE_DTYPES)
    # phase 1
    p.add_argument("--p1-steps", type=int, default=2000)
    p.add_argument("--p1-minutes", type=float, default=48.0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--p1-lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--eval-every", type=int, default=100)
    # phase 2
    p.add_argument("--p2-steps", type=int, default=2000)
    p.add_argument("--p2-minutes", type=float, default=36.0)
    p.add_argument("--p2-batch-size", type=int, default=8)
    p.add_argument("--p2-lr", type=float, default=1e-3)
    p.add_argument("--p2-warmup", type=int, default=20)
    p.add_argument("--draft-steps", type=int, default=3, help="unrolled MTP substeps")
    p.add_argument("--substep-weights", default="1,1,1")
    p.add_argument("--distill-temperature", type=float, default=1.0)
    p.add_argument("--p2-eval-every", type=int, default=60)
    # bookkeeping
    p.add_argument("--heldout-windows", type=int, default=32)
    p.add_argument("--save-every-minutes", type=float, default=10.0)
    p.add_argument(
        "--bar-interval", type=float, default=10.0, help="seconds between progress-bar redraws"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging("info")

    from tokenizers import Tokenizer

    from spectrio.models.architecture.config import ModelConfig
    from spectrio.models.architecture.model import build_model
    from spectrio.models.ops.paddle_setup import paddle
    from spectrio.models.text.tokenizer import TextTokenizer
    from spectrio.tools.training.corpus import held_out_contexts
    from spectrio.tools.training.tokenizer_train import EOS_TOKEN, train_tokenizer

    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    np.random.seed(args.seed)
    paddle.seed(args.seed)
    from spectrio.core.config import RuntimeConfig
    from spectrio.models.ops.paddle_setup import configure_paddle

    # Paddle pins itself to one thread when imported; set the count it really uses.
    threads = configure_paddle(RuntimeConfig(num_threads=args.threads).resolve_num_threads())
    log.info("threads", threads=threads)

    if args.init_from is not None:
        tokenizer = Tokenizer.from_file(str(args.init_from / "tokenizer.json"))
    elif args.tokenizer == "train":
        tokenizer = train_tokenizer(args.vocab_size)
    else:
        tokenizer = Tokenizer.from_file(args.tokenizer)
    tokenizer.save(str(args.out / "tokenizer.json"))
    eos = tokenizer.token_to_id(EOS_TOKEN)
    data = encode_split(tokenizer, "train")
    heldout = held_out_contexts(
        TextTokenizer(tokenizer, eos), args.heldout_windows, args.seq_len + 1, seed=args.seed
    )
    log.info(
        "corpus encoded", train_tokens=int(data.size), seconds=round(time.perf_counter() - t0, 1)
    )

    if args.init_from is not None:
        from spectrio.models import load

        loaded = load(args.init_from)
        model, cfg = loaded.model, loaded.config
    else:
        fields = dict(DEFAULT_MODEL)
        if args.model_json:
            fields.update(json.loads(args.model_json))
        cfg = ModelConfig(vocab_size=tokenizer.get_vocab_size(), eos_token_id=eos, **fields)
        model = build_model(cfg, "float32", seed=args.seed)
    if not cfg.has_mtp:
        raise SystemExit("the model needs an MTP layer (num_nextn_predict_layers: 1)")
    n_params = sum(int(np.prod(p.shape)) for p in model.parameters())
    log.info(
        "model ready",
        params=n_params,
        init_from=str(args.init_from),
        **cfg.to_dict(args.save_dtype),
    )

    trainer = Trainer(args, model, data, heldout)
    if "1" in args.phases:
        trainer.phase1()
    if "2" in args.phases:
        trainer.phase2()
    last = trainer.evals[-1] if trainer.evals else {}
    log.info("training done", minutes=round((time.perf_counter() - t0) / 60, 1), **last)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
