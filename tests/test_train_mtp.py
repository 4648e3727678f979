"""``spectrio train-mtp``: a head for a model that has none, written beside it, attached by
``load``, drafting losslessly; resumable; refused when it belongs to another model."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import trio
from safetensors.numpy import save_file

from spectrio import RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.errors import CheckpointError
from spectrio.models import LoadedModel, load
from spectrio.models.architecture.config import BUNDLED_DIR
from spectrio.models.loading.loader import state_dict_hf
from spectrio.models.loading.mtp_head import HEAD_FILE, head_path_for
from spectrio.tools.training import mtp_generations, train_mtp
from spectrio.tools.training.chat_prompts import chat_prompts
from spectrio.tools.training.mtp_features import Features, frequent_tokens, make_batch
from spectrio.tools.training.mtp_generations import Sequences
from spectrio.tools.training.mtp_loop import accepted_per_substep
from spectrio.tools.training.optim import lr_at

TRAIN_ARGS = [
    "--prompts", "12", "--prompt-tokens", "48", "--gen-tokens", "40", "--gen-batch", "6",
    "--window", "32", "--batch-size", "4", "--eval-every", "2", "--eval-windows", "6",
    "--bar-interval", "60", "--threads", "1", "--draft-vocab", "300",
]  # fmt: skip


def headless_copy(loaded: LoadedModel, folder: Path) -> Path:
    """The bundled target without its MTP layer: a model that ships no head."""
    cfg = dataclasses.replace(loaded.config, num_nextn_predict_layers=0)
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    tensors = {k: v for k, v in state_dict_hf(loaded.model).items() if not k.startswith(prefix)}
    folder.mkdir(parents=True)
    cfg.save(folder / "config.json")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(BUNDLED_DIR / "tokenizer.json", folder / "tokenizer.json")
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, bundled: LoadedModel) -> Path:
    folder = headless_copy(bundled, tmp_path_factory.mktemp("headless") / "model")
    work = folder.parent / "work"
    rc = train_mtp.main(
        ["--model", str(folder), "--work-dir", str(work), "--steps", "4", *TRAIN_ARGS]
    )
    assert rc == 0
    return folder


def test_head_is_written_beside_the_model_and_attached(trained: Path) -> None:
    head = trained / HEAD_FILE
    assert head_path_for(trained) == head
    assert head.is_file() and (trained / (HEAD_FILE + ".sha256")).is_file()
    model = load(trained).model
    assert model.config.has_mtp
    # the draft vocabulary rides in the head file: at most the 300 most frequent + EOS
    assert model.draft_vocab is not None and 0 < model.draft_vocab.size <= 301
    assert not load(trained, mtp_head=False).config.has_mtp
    log = json.loads((trained.parent / "work" / "training_log.json").read_text())
    assert [e["step"] for e in log["evals"]] == [0, 2, 4]
    assert len(log["curve"]) == 4 and all(len(e["accepted"]) == 3 for e in log["evals"])


async def _outputs(folder: Path, spec: SpeculativeConfig, prompts: list[str]) -> list[list[int]]:
    config = RuntimeConfig(model=str(folder), speculative=spec, max_model_len=256)
    out: list[list[int]] = [[] for _ in prompts]
    with trio.fail_after(120):
        async with open_runtime(config, warmup=False) as rt:

            async def one(i: int) -> None:
                async for delta in rt.generate(prompts[i], SamplingParams(max_tokens=40)):
                    out[i] += delta.token_ids

            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i)
            drafts = rt.num_drafts_proposed
    if spec.method is not None:
        assert drafts > 0, "the trained head never drafted"
    return out


def test_the_trained_head_speculates_losslessly(trained: Path) -> None:
    prompts = ["def parse(self, text):\n", "import os\n\nclass ", "    for i in range(", "x"]
    plain = trio.run(_outputs, trained, SpeculativeConfig(method=None), prompts)
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=3, adaptive=False)
    assert trio.run(_outputs, trained, spec, prompts) == plain


def test_a_second_run_resumes_and_reuses_the_generations(trained: Path) -> None:
    work = trained.parent / "work"
    seq_mtime = (work / "sequences.npz").stat().st_mtime_ns
    rc = train_mtp.main(
        ["--model", str(trained), "--work-dir", str(work), "--steps", "6", *TRAIN_ARGS]
    )
    # The model now has a head beside it: load() attaches it, so train-mtp must read the
    # target without it (it trains the head, not on top of it).
    assert rc == 0
    state = json.loads((work / "state.json").read_text())
    assert state["step"] == 6 and len(state["curve"]) == 6
    assert (work / "sequences.npz").stat().st_mtime_ns == seq_mtime


def test_a_head_for_another_model_is_refused(trained: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(trained, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5  # another target (its fingerprint moves)
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="trained for another model"):
        load(other)
    assert not load(other, mtp_head=False).config.has_mtp


def test_a_damaged_head_is_refused_by_the_cli(trained: Path, tmp_path: Path) -> None:
    other = tmp_path / "damaged"
    shutil.copytree(trained, other)
    head = other / HEAD_FILE
    raw = bytearray(head.read_bytes())
    raw[-1] ^= 0xFF
    head.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="does not match"):
        load(other)
    proc = subprocess.run(
        [sys.executable, "-m", "spectrio.tools.cli", "generate", "x", "--model", str(other)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "Traceback" not in proc.stderr


def test_train_mtp_refuses_a_model_that_has_a_layer(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="already has an MTP layer"):
        train_mtp.main(["--model", "bundled", "--work-dir", str(tmp_path), *TRAIN_ARGS])


# ---- pure rules -------------------------------------------------------------------------


def _toy(
    prompt_lens: list[int], lens: list[int], d: int = 2, k: int = 2
) -> tuple[Sequences, Features]:
    rows = [
        (list(range(100, 100 + p)), list(range(200, 200 + n - p)))
        for p, n in zip(prompt_lens, lens, strict=True)
    ]
    seqs = Sequences.build(rows)
    n = seqs.tokens.size
    hidden = np.arange(n * d, dtype=np.float16).reshape(n, d)
    top_ids = np.repeat(np.arange(n, dtype=np.int32)[:, None], k, axis=1)
    feats = Features(hidden, top_ids, np.full((n, k), 0.5, np.float16))
    return seqs, feats


def test_batch_rows_count_only_where_the_chain_is_greedy() -> None:
    seqs, feats = _toy([5], [20])
    batch = make_batch(seqs, feats, np.array([0]), [(0, 1)], t=4, depth=3)
    # window positions 1..4 are absolute rows 1..4; token rows 5.. are generated
    assert batch.ids.shape == (1, 8) and batch.hidden.shape == (1, 4, 2)
    assert batch.valid[0].all()  # substep 1 reads a real token: always counts
    # substep j >= 2 needs the token at s + 2 generated: absolute s + 2 >= 5 -> s >= 3
    assert batch.valid[1, 0].tolist() == [False, False, True, True]
    assert (batch.valid[2] == batch.valid[1]).all()
    # substep j's label is the target's distribution at s + 1 + j
    for j in range(3):
        assert batch.labels[j][0][0, :, 0].tolist() == [1 + 1 + j + s for s in range(4)]


def test_acceptance_is_chained() -> None:
    import paddle

    seqs, feats = _toy([0], [12])
    batch = make_batch(seqs, feats, np.array([0]), [(0, 0)], t=3, depth=2)
    vocab = 300
    want = batch.ids[0]

    def logits(picks: list[int]) -> paddle.Tensor:
        arr = np.zeros((1, 3, vocab), np.float32)
        for s, tok in enumerate(picks):
            arr[0, s, tok] = 1.0
        return paddle.to_tensor(arr)

    first = logits([want[2], want[3], 0])  # row 2 misses at substep 1
    second = logits([want[3], 0, want[5]])  # row 1 misses at substep 2; row 2 hits, too late
    acc, rows = accepted_per_substep([first, second], batch, 3)
    assert rows == 3
    assert acc.tolist() == pytest.approx([2 / 3, 1 / 3])


def test_prompts_are_distinct_and_the_schedule_anneals() -> None:
    prompts = chat_prompts(200, np.random.default_rng(0))
    assert len(set(prompts)) == 200
    assert lr_at(0, 0.0, 1.0, 10) == pytest.approx(0.1)
    assert lr_at(50, 0.0, 1.0, 10) == pytest.approx(1.0)
    assert lr_at(50, 1.0, 1.0, 10) == pytest.approx(0.1)
    assert lr_at(50, 7.0, 1.0, 10) == pytest.approx(0.1)


def test_tensor_parallel_shards_carry_the_head(trained: Path) -> None:
    """Each rank attaches the head and reads its own slices of it: put back together
    they are the head the whole model loads. The group's plan sizes the MTP layer's KV
    from the same config (``model_config``)."""
    from spectrio.models.architecture.parallel import TPShard, load_sharded
    from spectrio.models.loading.loader import model_config

    assert model_config(str(trained)).has_mtp
    full = load(trained).model
    shards = [load_sharded(str(trained), TPShard(r, 2)).model for r in range(2)]
    assert all(s.mtp is not None for s in shards)
    assert full.mtp is not None
    for name, param in full.mtp.named_parameters():
        parts = [dict(s.mtp.named_parameters())[name].numpy() for s in shards]  # type: ignore[union-attr]
        whole = param.numpy()
        if parts[0].shape == whole.shape:
            np.testing.assert_array_equal(parts[0], whole)
        else:
            axis = next(a for a in (0, 1) if parts[0].shape[a] * 2 == whole.shape[a])
            np.testing.assert_array_equal(np.concatenate(parts, axis=axis), whole)


def test_the_draft_vocabulary_is_the_most_frequent_tokens() -> None:
    seqs = Sequences.build([([5, 5, 5, 7], [7, 9, 3, 3, 3, 3])])
    assert frequent_tokens(seqs, 2, 20, [0]).tolist() == [0, 3, 5]
    assert frequent_tokens(seqs, 3, 20, []).tolist() == [3, 5, 7]  # 7 and 9 tie 2:1 -> 7
    assert frequent_tokens(seqs, 50, 20, []) is None  # the whole vocabulary: none
    assert frequent_tokens(seqs, 0, 20, []) is None
    assert frequent_tokens(seqs, 10, 20, []).tolist() == [3, 5, 7, 9]  # only what was seen


def test_drafting_from_a_vocabulary_subset_computes_those_columns(bundled: LoadedModel) -> None:
    import paddle

    from spectrio.models import PackedBatch, PagedKVCache

    model = bundled.model
    cfg = model.config
    vocab = np.arange(0, cfg.vocab_size, 7)
    cache = PagedKVCache(1, 8, 16, cfg.num_key_value_heads, cfg.head_dim, "float32")
    batch = PackedBatch.from_sequences(
        [[5, 17, 300, 40], [9, 8]], [0, 0], [np.array([0]), np.array([1])]
    )
    batch.logits_indices = batch.last_rows()
    hidden = paddle.to_tensor(
        np.random.default_rng(0).normal(size=(6, cfg.hidden_size)).astype("float32")
    )
    try:
        model.set_draft_vocab(vocab)
        with paddle.no_grad():
            full = model.mtp_forward(batch, hidden, cache)
            sub = model.mtp_forward(batch, hidden, cache, draft_vocab=True)
        assert full.vocab_ids is None and sub.vocab_ids is not None
        np.testing.assert_array_equal(sub.vocab_ids, vocab)
        np.testing.assert_allclose(
            sub.logits.numpy(), full.logits.numpy()[:, vocab], rtol=1e-5, atol=1e-5
        )
        with pytest.raises(ValueError, match="vocabulary"):
            model.set_draft_vocab(np.array([cfg.vocab_size]))
    finally:
        model.set_draft_vocab(None)


def test_an_interrupted_generation_keeps_what_it_finished(tmp_path: Path) -> None:
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    path = tmp_path / "generations.partial.npz"
    partial = mtp_generations.PartialGenerations(path, prompts)
    partial.add(2, [10, 11])
    partial.add(0, [])
    partial.save()
    assert mtp_generations.PartialGenerations(path, prompts).done == {0: [], 2: [10, 11]}
    # another prompt set (another --prompts or seed): an entry is kept only for the same
    # prompt at the same index, so sets never mix
    moved = [[1, 2, 3], [6, 7, 8, 9], [4, 5]]
    assert mtp_generations.PartialGenerations(path, moved).done == {0: []}


def test_generation_resumes_with_only_the_missing_prompts(trained: Path) -> None:
    loaded = load(trained, mtp_head=False)
    prompts = [loaded.tokenizer.encode(t) for t in ("def f(x):", "import os\n", "class A:")]
    args = train_mtp.build_parser().parse_args(["--model", str(trained), *TRAIN_ARGS])
    full = trio.run(mtp_generations.generate, loaded, prompts, args, None)
    partial = mtp_generations.PartialGenerations(trained.parent / "resume.npz", prompts)
    partial.add(1, [7, 7, 7])  # a marker no generation would give: proves it was kept
    rows = trio.run(mtp_generations.generate, loaded, prompts, args, partial)
    assert rows[1] == (prompts[1], [7, 7, 7])
    assert rows[0] == full[0] and rows[2] == full[2]
    assert set(mtp_generations.PartialGenerations(partial.path, prompts).done) == {0, 1, 2}


def test_a_spent_generation_budget_keeps_the_finished_ones(trained: Path) -> None:
    loaded = load(trained, mtp_head=False)
    prompts = [loaded.tokenizer.encode(t) for t in ("def f(x):", "import os\n")]
    args = train_mtp.build_parser().parse_args(
        ["--model", str(trained), "--gen-minutes", "1", *TRAIN_ARGS]
    )
    partial = mtp_generations.PartialGenerations(trained.parent / "spent.npz", prompts)
    partial.add(0, [7, 7])
    partial.seconds = 60.0  # the whole budget spent by an earlier run
    rows = trio.run(mtp_generations.generate, loaded, prompts, args, partial)
    assert rows == [(prompts[0], [7, 7])]
    assert mtp_generations.PartialGenerations(partial.path, prompts).seconds >= 60.0


def test_init_head_starts_from_the_current_head(trained: Path, tmp_path: Path) -> None:
    out = tmp_path / "again.safetensors"
    rc = train_mtp.main(
        ["--model", str(trained), "--work-dir", str(tmp_path / "work"), "--out", str(out),
         "--init-head", "--steps", "0", *TRAIN_ARGS]
    )  # fmt: skip
    assert rc == 0
    from safetensors.numpy import load_file

    before, after = load_file(str(trained / HEAD_FILE)), load_file(str(out))
    layer = [k for k in before if "draft_vocab" not in k]
    assert layer and all(np.array_equal(before[k], after[k]) for k in layer)


def test_init_head_without_a_head_is_refused(tmp_path: Path, bundled: LoadedModel) -> None:
    folder = headless_copy(bundled, tmp_path / "model")
    rc = train_mtp.main(
        ["--model", str(folder), "--work-dir", str(tmp_path / "work"), "--init-head",
         "--steps", "0", *TRAIN_ARGS]
    )  # fmt: skip
    assert rc == 2
