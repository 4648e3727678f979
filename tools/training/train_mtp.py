"""``spectrio train-mtp``: train an MTP head for a model that ships none.

The target is frozen; one DeepSeek-V3-style MTP layer learns to draft for it by
self-distillation, with the chained substeps ``tools/training/train.py``'s phase 2 uses (substep
j + 1 reads substep j's own output hidden state). Three stages, each kept in the work
folder, so an interrupted run resumes where it stopped:

1. **Generations.** The target's own greedy continuations of prompts: the user's text
   files cut into prompts (``--text``), or by default chat requests through the model's
   chat template (:mod:`spectrio.tools.training.chat_prompts`'s topic x task ones, or with
   ``--chat-prompts self`` ones the target writes itself) and windows of Python's
   standard library sources (the training split of ``tools/training/corpus.py``, never its
   held-out files). The runtime generates them, batched.
2. **Features.** One teacher-forced target pass over each sequence keeps the final
   normed hidden state and the top ``--top-k`` next-token probabilities at every
   position. Because the continuation is the target's own greedy output, the target's
   greedy chain after any generated prefix *is* the rest of the sequence, so the labels
   of every substep come from this one pass (``tools/training/train.py`` runs the target
   ``depth`` more times per step to get them).
3. **Training.** Windows of the features; substep j's loss is the soft cross-entropy
   to the target's (top-k, renormalised) distribution, counted only where its input
   chain is the target's greedy output. Held-out sequences measure the chained greedy
   acceptance per substep, which is what verification keeps.

The layer is written as a head file beside the model (:mod:`spectrio.models.loading.mtp_head`),
which ``load`` then attaches, so ``spectrio serve --model DIR`` speculates with it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import structlog

from spectrio.tools.training.mtp_features import compute_features, frequent_tokens
from spectrio.tools.training.mtp_generations import (
    PartialGenerations,
    Sequences,
    build_prompts,
    generate,
    user_messages,
)
from spectrio.tools.training.mtp_loop import Run, attach_fresh_layer, current_head_state, train

log = structlog.get_logger("spectrio.train_mtp")

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
    from spectrio.models.loading.loader import load, resolve_path
    from spectrio.models.loading.mtp_head import head_path_for, save_head, target_fingerprint
    from spectrio.models.ops.paddle_setup import configure_paddle

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
    from spectrio.models.loading.loader import open_checkpoint

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
        rows = trio.run(generate, loaded, prompts, args, partial)
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
