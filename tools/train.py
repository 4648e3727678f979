"""Train the bundled target model and its MTP layer on CPU with Paddle.

Objective (DeepSeek-V3): next-token cross-entropy plus ``mtp_weight`` times the MTP
layer's cross-entropy for the token after next. Run as
``python -m spectrio.tools.train --out models/bundled`` or ``spectrio train``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import structlog
from spectrio.tools.logging_setup import configure_logging

log = structlog.get_logger("spectrio.train")

DEFAULT_MODEL = {
    "hidden_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 512,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "num_nextn_predict_layers": 1,
}


def encode_split(tokenizer: object, split: str) -> np.ndarray:
    """All files of ``split`` tokenised and joined with EOS, as one uint16 stream."""
    from spectrio.tools.corpus import corpus_files, read_texts
    from spectrio.tools.tokenizer_train import EOS_TOKEN

    eos = tokenizer.token_to_id(EOS_TOKEN)  # type: ignore[attr-defined]
    texts = list(read_texts(corpus_files(split)))
    encodings = tokenizer.encode_batch(texts)  # type: ignore[attr-defined]
    parts: list[np.ndarray] = []
    for enc in encodings:
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
        parts.append(np.asarray([eos], dtype=np.uint16))
    return np.concatenate(parts)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=Path("models/bundled"))
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--steps", type=int, default=540)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--max-minutes", type=float, default=56.0, help="stop early past this budget")
    p.add_argument("--model-json", type=str, default=None, help="override model fields (JSON)")
    p.add_argument("--init-from", type=Path, default=None,
                   help="continue from this checkpoint (its tokenizer and weights)")
    args = p.parse_args(argv)
    configure_logging("info")

    import paddle
    import paddle.nn.functional as F
    from tqdm import tqdm

    from spectrio.models.config import ModelConfig
    from spectrio.models.model import build_model
    from spectrio.tools.tokenizer_train import EOS_TOKEN, train_tokenizer

    t_start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    np.random.seed(args.seed)
    paddle.seed(args.seed)

    if args.init_from is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(args.init_from / "tokenizer.json"))
    else:
        tokenizer = train_tokenizer(args.vocab_size)
    tokenizer.save(str(args.out / "tokenizer.json"))
    eos = tokenizer.token_to_id(EOS_TOKEN)
    data = encode_split(tokenizer, "train")
    log.info("corpus encoded", train_tokens=int(data.size), seconds=round(time.perf_counter() - t_start, 1))

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
    model.train()
    n_params = sum(int(np.prod(p.shape)) for p in model.parameters())
    log.info("model ready", params=n_params, init_from=str(args.init_from), **cfg.to_dict())

    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    opt = paddle.optimizer.AdamW(
        learning_rate=args.lr,
        parameters=model.parameters(),
        weight_decay=0.1,
        apply_decay_param_fun=lambda name: any(name == p.name for p in decay),
        grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0),
        beta2=0.95,
    )
    rng = np.random.default_rng(args.seed)
    curve: list[dict[str, float]] = []
    budget = args.max_minutes * 60.0
    bar = tqdm(range(args.steps), desc="train", unit="step")
    for step in bar:
        starts = rng.integers(0, data.size - args.seq_len - 1, size=args.batch_size)
        window = np.stack([data[s : s + args.seq_len + 1] for s in starts]).astype(np.int64)
        x = paddle.to_tensor(window[:, :-1])
        y = paddle.to_tensor(window[:, 1:])
        logits, hidden, _ = model.forward_dense(x)
        main_loss = F.cross_entropy(logits, y.unsqueeze(-1)).mean()
        # MTP position p pairs h_p with token p+1 and predicts token p+2.
        mtp_logits, _, _ = model.mtp_forward_dense(y[:, :-1], hidden[:, :-1])
        mtp_loss = F.cross_entropy(mtp_logits, y[:, 1:].unsqueeze(-1)).mean()
        loss = main_loss + args.mtp_weight * mtp_loss
        opt.set_lr(lr_at(step, args.steps, args.lr, args.warmup))
        loss.backward()
        opt.step()
        opt.clear_grad()
        row = {
            "step": step,
            "loss": float(loss),
            "main_loss": float(main_loss),
            "mtp_loss": float(mtp_loss),
            "seconds": time.perf_counter() - t_start,
        }
        curve.append(row)
        bar.set_postfix(main=f"{row['main_loss']:.3f}", mtp=f"{row['mtp_loss']:.3f}")
        if step % 50 == 0:
            log.info("train step", **{k: round(v, 4) for k, v in row.items()})
        if step % 250 == 0 or row["seconds"] > budget:
            _save(model, cfg, args.out, curve, args)
        if row["seconds"] > budget:
            log.warning("time budget reached; stopping early", step=step)
            break
    _save(model, cfg, args.out, curve, args)
    log.info(
        "training done",
        steps=len(curve),
        minutes=round((time.perf_counter() - t_start) / 60, 1),
        final_main_loss=round(float(np.mean([r["main_loss"] for r in curve[-50:]])), 4),
        final_mtp_loss=round(float(np.mean([r["mtp_loss"] for r in curve[-50:]])), 4),
    )
    return 0


def _save(model: object, cfg: object, out: Path, curve: list[dict[str, float]], args: argparse.Namespace) -> None:
    from spectrio.models.loader import save_checkpoint

    model.eval()  # type: ignore[attr-defined]
    save_checkpoint(model, out)  # type: ignore[arg-type]
    model.train()  # type: ignore[attr-defined]
    meta = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "curve": curve,
    }
    (out / "training_log.json").write_text(json.dumps(meta))


if __name__ == "__main__":
    raise SystemExit(main())
