"""SmolLM2 speculates with the MTP head ``spectrio train-mtp`` made for it: the shipped
head attaches to ``load("smollm2")`` and to the same model loaded by its file's path or
from its converted folder, its checksum holds, it drafts from its draft
vocabulary, drafts are accepted, and the output equals no speculation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from spectrio import RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.models import LoadedModel, load
from spectrio.models.loading.gguf_cache import cached_folder
from spectrio.models.loading.loader import model_config
from spectrio.models.loading.mtp_head import SHIPPED_HEADS, file_sha256

PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef list_files(path):\n"]


@pytest.fixture(scope="module")
def smol(smollm2_gguf: Path) -> LoadedModel:
    return load("smollm2")


def test_the_shipped_head_attaches_with_its_checksum(smol: LoadedModel) -> None:
    head = SHIPPED_HEADS["smollm2"]
    want = head.with_name(head.name + ".sha256").read_text().split()[0]
    assert file_sha256(head) == want
    assert smol.config.has_mtp and smol.model.mtp is not None
    assert smol.model.draft_vocab is not None and 1000 < smol.model.draft_vocab.size < 49152


def test_the_shipped_head_attaches_by_path_and_to_the_converted_folder(
    smollm2_gguf: Path, smol: LoadedModel
) -> None:
    """Found by the target's fingerprint, not by the name ``smollm2``."""
    folder = cached_folder(smollm2_gguf)  # what spectrio convert writes from the file
    assert folder is not None
    for path in (smollm2_gguf, folder):
        loaded = load(path)
        assert loaded.head_path == SHIPPED_HEADS["smollm2"], path
        assert loaded.config == smol.config and model_config(path) == smol.config
        assert loaded.model.draft_vocab is not None
        assert (loaded.model.draft_vocab == smol.model.draft_vocab).all()
        del loaded
    assert load(smollm2_gguf, mtp_head=False).head_path is None


async def _run(
    smol: LoadedModel, spec: SpeculativeConfig, params: SamplingParams | None = None
) -> tuple[list[list[int]], int, int]:
    config = RuntimeConfig(model="smollm2", speculative=spec, max_model_len=256)
    out: list[list[int]] = [[] for _ in PROMPTS]
    params = params or SamplingParams(max_tokens=32, ignore_eos=True)
    with trio.fail_after(300):
        async with open_runtime(config, loaded=smol, warmup=False) as rt:

            async def one(i: int) -> None:
                async for delta in rt.generate(PROMPTS[i], params):
                    out[i] += delta.token_ids

            async with trio.open_nursery() as nursery:
                for i in range(len(PROMPTS)):
                    nursery.start_soon(one, i)
            return out, rt.num_drafts_proposed, rt.num_drafts_accepted


def test_the_head_speculates_losslessly_and_is_accepted(smol: LoadedModel) -> None:
    plain, _, _ = trio.run(_run, smol, SpeculativeConfig(method=None))
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=3, adaptive=False)
    got, proposed, accepted = trio.run(_run, smol, spec)
    assert got == plain
    # the share accepted depends on the head (its held-out figures: docs/performance.md);
    # here: it is drafting and being accepted, not noise
    assert proposed > 0 and accepted / proposed > 0.05, (accepted, proposed)


def test_speculation_on_the_quantized_blocks_is_lossless(smollm2_gguf: Path) -> None:
    """Served from the file's Q4_1 blocks (a runtime's own load), greedy and seeded
    output with MTP drafts equal the output without: the block products are batch
    invariant, so verifying k+1 rows computes each row as decoding it alone does."""
    from spectrio.models.ops import native_ops

    if not native_ops.native_ops_available():
        pytest.skip("the block kernels do not build here")
    served = load("smollm2", serving=True)
    assert served.model.model.layers[0].self_attn._qkv_weight.blocks
    mtp = served.model.mtp
    assert mtp is not None  # drafting from Q8_0 blocks of the head (the default)
    assert mtp.self_attn._qkv_weight.ggml_type == 8 and mtp._eh_weight is not None
    assert mtp._eh_weight.ggml_type == 8
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=3, adaptive=False)
    greedy = SamplingParams(max_tokens=32, ignore_eos=True)
    seeded = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.8, seed=7)
    for params in (greedy, seeded):
        plain, _, _ = trio.run(_run, served, SpeculativeConfig(method=None), params)
        got, proposed, accepted = trio.run(_run, served, spec, params)
        assert got == plain, params
        assert proposed > 0 and accepted > 0


def test_a_quantized_file_drafts_from_float16_panels_when_asked(
    smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SPECTRIO_GGUF_DRAFT=F16``: the MTP pass keeps float16 panels; a type without a
    draft format is refused, naming the ones there are."""
    from spectrio.errors import ConfigError
    from spectrio.models.ops import native_ops

    if not native_ops.native_ops_available():
        pytest.skip("the block kernels do not build here")
    monkeypatch.setenv("SPECTRIO_GGUF_DRAFT", "F16")
    mtp = load("smollm2", serving=True).model.mtp
    assert mtp is not None and mtp.self_attn._qkv_weight.half
    monkeypatch.setenv("SPECTRIO_GGUF_DRAFT", "Q4_0")
    with pytest.raises(ConfigError, match="Q8_0 \\(the default\\) or F16"):
        load("smollm2", serving=True)


def test_the_head_records_how_it_was_trained() -> None:
    from safetensors import safe_open

    with safe_open(str(SHIPPED_HEADS["smollm2"]), framework="numpy") as f:
        meta = f.metadata()
    assert meta["format"] == "spectrio-mtp-head/1"
    assert int(meta["steps"]) > 0 and len(json.loads(meta["accepted"])) == 3


def test_train_mtp_writes_its_own_user_messages(smol: LoadedModel, tmp_path: Path) -> None:
    """``--chat-prompts self``: the target writes the chat half's requests itself from
    its template's opened user turn; they are kept in the work folder, so a resumed run
    builds the same prompts, and become chat prompts through the template."""
    import argparse

    import numpy as np

    from spectrio.models.text.chat import chat_template_for
    from spectrio.tools.training.chat_prompts import usable_messages
    from spectrio.tools.training.mtp_generations import build_prompts, user_messages, write_messages

    args = argparse.Namespace(
        chat_prompts="self", text=None, prompts=8, gen_batch=4, seed=3, threads=None,
        bar_interval=60.0, work_dir=tmp_path, prompt_tokens=32,
    )  # fmt: skip

    async def write() -> list[str]:
        with trio.fail_after(300):
            return await write_messages(smol, 4, args)

    messages = trio.run(write)
    assert len(messages) == 4
    assert usable_messages([(m, True) for m in messages], 4) == messages  # all usable
    # user_messages keeps them in the work folder; a resumed run reads them back
    (tmp_path / "user_messages.json").write_text(json.dumps(messages))
    assert user_messages(smol, args) == messages
    prompts = build_prompts(smol, args, np.random.default_rng(0), messages)
    template = chat_template_for(smol)
    assert template is not None
    chat = {tuple(template.encode([{"role": "user", "content": m}])) for m in messages}
    assert len(prompts) == 8 and sum(tuple(p) in chat for p in prompts) == 4
