"""MTP layers stored the way the models that ship them store them (issue 42, item 3).

Each test writes tiny random checkpoints with safetensors: one model's weights in its
family's MTP layout (DeepSeek-V3 for a Llama, MiMo's for ``MiMoForCausalLM``, ERNIE 4.5's
for ``Ernie4_5ForCausalLM``) and, for MiMo and ERNIE, the very same values in the
DeepSeek layout beside it. The renaming below is written from the engines' sources, not
from :mod:`spectrio.models.loading.mtp_layout`, and a NumPy forward pass that follows each
engine's MTP math on the stored tensors checks the whole wiring: names, the order of the
concatenation, which norm runs where, which target state the layer reads and which of
its own states the next substep reads.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest
import trio
from safetensors.numpy import load_file, save_file
from test_tensor_parallel import run_ranks

from spectrio import RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.errors import CheckpointError, ModelConfigError
from spectrio.models import (
    LoadedModel,
    ModelConfig,
    PackedBatch,
    PagedKVCache,
    build_model,
    load,
    reference,
    save_checkpoint,
)
from spectrio.models.loading.loader import state_dict_hf
from spectrio.models.loading.mtp_layout import convert, detect, hf_name

LAYOUTS = ["deepseek", "mimo", "ernie"]
ARCH = {"deepseek": "LlamaForCausalLM", "mimo": "MiMoForCausalLM", "ernie": "Ernie4_5ForCausalLM"}
L = 2  # target layers: DeepSeek's MTP layer is layer 2
D = 32  # hidden size


def tiny_config(layout: str) -> ModelConfig:
    return ModelConfig(
        vocab_size=64,
        hidden_size=D,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=layout == "ernie",  # ERNIE 4.5 ties, MiMo-7B does not
        num_nextn_predict_layers=1,
        architectures=(ARCH[layout],),
    )


def deepseek_tensors(layout: str, seed: int = 3) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Random weights under DeepSeek-layout names (spectrio's own writer, float32). Norm
    weights and biases are random too, so a norm applied to the wrong tensor shows."""
    cfg = tiny_config(layout)
    model = build_model(cfg, "float32", seed=seed)
    rng = np.random.default_rng(seed)
    with paddle.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.set_value(rng.normal(0.0, 0.25, size=p.shape).astype("float32"))
            elif name.endswith("bias"):
                p.set_value(rng.normal(0.0, 0.1, size=p.shape).astype("float32"))
            else:
                p.set_value((1.0 + rng.normal(0.0, 0.3, size=p.shape)).astype("float32"))
        if layout == "ernie":
            # ERNIE's layout has one final norm for the target and the MTP layer, so its
            # DeepSeek twin carries the same values in both.
            model.mtp.shared_head.norm.weight.set_value(model.model.norm.weight)
    return cfg, state_dict_hf(model)


def relayout(tensors: dict[str, np.ndarray], layout: str) -> dict[str, np.ndarray]:
    """The same tensors under ``layout``'s names, as the engines' loaders read them:
    vLLM/SGLang ``mimo_mtp.py`` (``input_proj`` reads ``cat[hidden, embedding]``, so its
    halves are DeepSeek's eh_proj halves swapped) and FastDeploy ``ernie4_5_mtp.py`` /
    vLLM ``ernie_mtp.py`` (its output norm is the target's ``model.norm``)."""
    if layout == "deepseek":
        return dict(tensors)
    mimo = {
        "enorm.weight": "token_layernorm.weight",
        "hnorm.weight": "hidden_layernorm.weight",
        "eh_proj.weight": "input_proj.weight",
        "shared_head.norm.weight": "final_layernorm.weight",
    }
    ernie = {
        "enorm.weight": "model.mtp_emb_norm.0.weight",
        "hnorm.weight": "model.mtp_hidden_norm.0.weight",
        "eh_proj.weight": "model.mtp_linear_proj.0.weight",
    }
    prefix = f"model.layers.{L}."
    out: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        if not name.startswith(prefix):
            out[name] = arr
            continue
        part = name[len(prefix) :]
        if layout == "mimo":
            if part == "eh_proj.weight":  # [embedding | hidden] columns -> [hidden | embedding]
                arr = np.ascontiguousarray(np.concatenate([arr[:, D:], arr[:, :D]], axis=1))
            out["model.mtp_layers.0." + mimo.get(part, part)] = arr
        elif part == "shared_head.norm.weight":
            assert np.array_equal(arr, tensors["model.norm.weight"])
        else:
            out[ernie.get(part) or "model.mtp_block.0." + part] = arr
    return out


def write(
    folder: Path, cfg: ModelConfig, tensors: dict[str, np.ndarray], extra: dict[str, object]
) -> Path:
    from tokenizers import Tokenizer, models

    folder.mkdir(parents=True)
    raw = {**cfg.to_dict(), **extra}
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(folder / "tokenizer.json"))
    return folder


# MiMo-7B's config.json carries these beside Qwen2's fields (vLLM, SGLang and
# megatron-bridge test configs mirror it); ERNIE's MTP loss weight rides in its config.
EXTRA = {
    "deepseek": {},
    "mimo": {"attention_bias": True, "max_window_layers": L, "sliding_window": 32768},
    "ernie": {"multi_token_pred_lambda": 0.3},
}


def make(root: Path, layout: str, seed: int = 3) -> tuple[Path, Path]:
    """(the checkpoint in ``layout``, the same weights in the DeepSeek layout)."""
    cfg, tensors = deepseek_tensors(layout, seed)
    twin = write(root / f"{layout}-as-deepseek", cfg, tensors, EXTRA[layout])
    if layout == "deepseek":
        return twin, twin
    return write(root / layout, cfg, relayout(tensors, layout), EXTRA[layout]), twin


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("mtp_layouts")
    return {layout: make(root, layout) for layout in LAYOUTS}


# ---- the engines' MTP math on the stored tensors, in NumPy ------------------------------


class NumpyReference:
    """Target and MTP forward passes over the raw stored tensors, float64, dense causal,
    written from the engines: the target's decoder (Llama, Qwen2 for MiMo, ERNIE with its
    interleaved RoPE on the stored q/k rows), and each layout's MTP layer as its engine
    runs it (vLLM ``deepseek_mtp.py``; vLLM ``mimo.py``/``mimo_mtp.py``; FastDeploy
    ``ernie4_5_moe.py``/``ernie4_5_mtp.py``)."""

    def __init__(self, folder: Path, layout: str) -> None:
        raw = load_file(str(folder / "model.safetensors"))
        self.t = {k: v.astype(np.float64) for k, v in raw.items()}
        self.cfg = ModelConfig.from_json(folder / "config.json")
        self.layout = layout

    def norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.cfg.rms_norm_eps) * self.t[name]

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        y = x @ self.t[name + ".weight"].T
        return y + self.t[name + ".bias"] if name + ".bias" in self.t else y

    def rope(self, x: np.ndarray) -> np.ndarray:
        """``x``: [T, heads, Dh] at positions 0..T-1."""
        dh = x.shape[-1]
        inv = 1.0 / self.cfg.rope_theta ** (np.arange(0, dh, 2) / dh)
        ang = np.arange(x.shape[0])[:, None, None] * inv  # [T, 1, Dh/2]
        cos, sin = np.cos(ang), np.sin(ang)
        if self.layout == "ernie":  # ERNIE rotates adjacent pairs (2i, 2i+1)
            a, b = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
            return out
        a, b = x[..., : dh // 2], x[..., dh // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    def layer(self, x: np.ndarray, p: str) -> np.ndarray:
        cfg = self.cfg
        h = self.norm(x, p + "input_layernorm.weight")
        dh, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        q = self.rope(self.linear(h, p + "self_attn.q_proj").reshape(-1, nh, dh))
        k = self.rope(self.linear(h, p + "self_attn.k_proj").reshape(-1, nkv, dh))
        v = self.linear(h, p + "self_attn.v_proj").reshape(-1, nkv, dh)
        k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(dh)
        s = s + np.triu(np.full(s.shape[1:], -np.inf), 1)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", w, v).reshape(len(x), -1)
        x = x + self.linear(attn, p + "self_attn.o_proj")
        h = self.norm(x, p + "post_attention_layernorm.weight")
        g = self.linear(h, p + "mlp.gate_proj")
        silu = g / (1 + np.exp(-g))
        return x + self.linear(silu * self.linear(h, p + "mlp.up_proj"), p + "mlp.down_proj")

    def head(self, x: np.ndarray) -> np.ndarray:
        key = "model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"
        return x @ self.t[key].T

    def target(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(logits, the hidden state this engine hands its MTP layer)."""
        x = self.t["model.embed_tokens.weight"][ids]
        for i in range(self.cfg.num_hidden_layers):
            x = self.layer(x, f"model.layers.{i}.")
        normed = self.norm(x, "model.norm.weight")
        # vLLM's MiMoModel returns the state before the final norm (compute_logits norms);
        # FastDeploy's ERNIE and vLLM's DeepSeek return the normed state.
        return self.head(normed), x if self.layout == "mimo" else normed

    def mtp(self, prev: np.ndarray, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Row r reads ``prev[r]`` and token ``ids[r]`` at MTP position r: (logits, the
        state the next substep reads)."""
        e = self.t["model.embed_tokens.weight"][ids]
        if self.layout == "deepseek":  # eh_proj(cat[enorm(e), hnorm(h)]), norm in the head
            p = f"model.layers.{L}."
            e, h = self.norm(e, p + "enorm.weight"), self.norm(prev, p + "hnorm.weight")
            x = self.layer(self.linear(np.concatenate([e, h], -1), p + "eh_proj"), p)
            return self.head(self.norm(x, p + "shared_head.norm.weight")), x
        if self.layout == "mimo":  # input_proj(cat[h, e]), then final_layernorm in the layer
            p = "model.mtp_layers.0."
            e = self.norm(e, p + "token_layernorm.weight")
            h = self.norm(prev, p + "hidden_layernorm.weight")
            x = self.layer(self.linear(np.concatenate([h, e], -1), p + "input_proj"), p)
            x = self.norm(x, p + "final_layernorm.weight")
            return self.head(x), x
        # FastDeploy's ERNIE: linear_proj(cat[e, h]), then the target's shared final norm
        e = self.norm(e, "model.mtp_emb_norm.0.weight")
        h = self.norm(prev, "model.mtp_hidden_norm.0.weight")
        x = self.linear(np.concatenate([e, h], -1), "model.mtp_linear_proj.0")
        x = self.norm(self.layer(x, "model.mtp_block.0."), "model.norm.weight")
        return self.head(x), x


PROMPT = [5, 17, 30, 41, 22, 9, 60, 3]


def spectrio_two_substeps(loaded: LoadedModel, ids: list[int]) -> tuple[np.ndarray, ...]:
    """spectrio's dense path: target logits, catch-up MTP logits over every position, and
    the chained second substep's logits (its input: the last catch-up row's state and
    that row's greedy draft)."""
    m = loaded.model
    with paddle.no_grad():
        logits, hidden, _ = m.forward_dense(paddle.to_tensor(np.array([ids])))
        g1 = int(logits[0, -1].numpy().argmax())
        nxt = paddle.to_tensor(np.array([[*ids[1:], g1]]))
        mtp_logits, mtp_hidden, past = m.mtp_forward_dense(nxt, hidden)
        d = int(mtp_logits[0, -1].numpy().argmax())
        step2, _, _ = m.mtp_forward_dense(
            paddle.to_tensor(np.array([[d]])), mtp_hidden[:, -1:], past
        )
    return logits[0].numpy(), mtp_logits[0].numpy(), step2[0, -1].numpy()


# ---- (a) each layout loads, as the engines compute it ------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_loads_and_computes_what_its_engine_computes(
    folders: dict[str, tuple[Path, Path]], layout: str
) -> None:
    folder, _ = folders[layout]
    loaded = load(folder, dtype="float64")
    assert loaded.config.mtp_layout == layout
    assert loaded.config.architectures == (ARCH[layout],)
    ref = NumpyReference(folder, layout)
    target, mtp1, mtp2 = spectrio_two_substeps(loaded, PROMPT)
    want_target, h = ref.target(PROMPT)
    np.testing.assert_allclose(target, want_target, rtol=0, atol=1e-10)
    g1 = int(want_target[-1].argmax())
    want_mtp1, state = ref.mtp(h, [*PROMPT[1:], g1])
    np.testing.assert_allclose(mtp1, want_mtp1, rtol=0, atol=1e-10)
    # Substep 2: the layer over the catch-up rows plus one row that reads the last
    # row's own output state and the draft it made (a dense causal pass equals the
    # cached one).
    d = int(want_mtp1[-1].argmax())
    want_mtp2, _ = ref.mtp(np.concatenate([h, state[-1:]]), [*PROMPT[1:], g1, d])
    np.testing.assert_allclose(mtp2, want_mtp2[-1], rtol=0, atol=1e-10)
    # The serving passes, as the MTP proposer chains them over paged caches.
    m, cfg, table = loaded.model, loaded.config, [np.arange(4)]
    kv = (cfg.num_key_value_heads, cfg.head_dim, "float64")
    cache, mcache = PagedKVCache(L, 4, 4, *kv), PagedKVCache(1, 4, 4, *kv)
    with paddle.no_grad():
        out = m.forward(PackedBatch.from_sequences([PROMPT], [0], table), cache)
        np.testing.assert_allclose(out.hidden.numpy(), h, rtol=0, atol=1e-10)
        batch = PackedBatch.from_sequences([[*PROMPT[1:], g1]], [0], table)
        step1 = m.mtp_forward(batch, out.hidden, mcache)
        np.testing.assert_allclose(step1.logits.numpy(), want_mtp1, rtol=0, atol=1e-10)
        batch = PackedBatch.from_sequences([[d]], [len(PROMPT)], table)
        step2 = m.mtp_forward(batch, step1.hidden[-1:], mcache)
        np.testing.assert_allclose(step2.logits.numpy()[-1], want_mtp2[-1], rtol=0, atol=1e-10)


def test_the_wiring_is_what_the_reference_checks() -> None:
    """Each switch the layouts set changes the draft logits, so the reference comparison
    above would fail if spectrio wired a layout like another: the NumPy reference of
    one layout disagrees with another layout's wiring on the same tensors."""
    cfg, tensors = deepseek_tensors("mimo")
    ref = NumpyReference.__new__(NumpyReference)
    ref.t = {k: v.astype(np.float64) for k, v in relayout(tensors, "mimo").items()}
    ref.cfg, ref.layout = cfg, "mimo"
    logits, pre = ref.target(PROMPT)
    normed = ref.norm(pre, "model.norm.weight")
    ids = [*PROMPT[1:], int(logits[-1].argmax())]
    assert not np.allclose(ref.mtp(pre, ids)[0], ref.mtp(normed, ids)[0], atol=1e-6)


def test_a_saved_model_keeps_its_layout(
    folders: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """Saving writes the MTP layer back in the layout it came in (MiMo's input_proj in its
    own column order), so the file reloads as the same model and other engines still
    read it; a change that the ERNIE layout cannot store (its MTP norm is the target's)
    is refused, not dropped."""
    for layout in ("mimo", "ernie"):
        folder, _ = folders[layout]
        loaded = load(folder)
        out = tmp_path / layout
        save_checkpoint(loaded.model, out)
        ours = load_file(str(out / "model.safetensors"))
        theirs = load_file(str(folder / "model.safetensors"))
        assert sorted(ours) == sorted(theirs)
        for name in theirs:
            np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
        assert json.loads((out / "config.json").read_text())["architectures"] == [ARCH[layout]]
    loaded = load(folders["ernie"][0])
    with paddle.no_grad():
        loaded.model.mtp.shared_head.norm.weight.set_value(
            loaded.model.mtp.shared_head.norm.weight * 2
        )
    with pytest.raises(CheckpointError, match="'model.norm.weight' in the ernie MTP layout"):
        save_checkpoint(loaded.model, tmp_path / "diverged")


def test_layout_names_are_detected_and_mapped() -> None:
    cfg = tiny_config("mimo")
    assert detect({"model.mtp_layers.0.input_proj.weight"}, cfg, "x") == "mimo"
    assert detect({"model.mtp_block.0.mlp.up_proj.weight"}, cfg, "x") == "ernie"
    assert detect({f"model.layers.{L}.enorm.weight"}, cfg, "x") == "deepseek"
    # No MTP tensor at all: named as the family stores it, so "missing" reads right.
    assert detect(set(), cfg, "x") == "mimo"
    assert detect(set(), dataclasses.replace(cfg, num_nextn_predict_layers=0), "x") == "deepseek"
    mimo = dataclasses.replace(cfg, mtp_layout="mimo")
    ernie = dataclasses.replace(tiny_config("ernie"), mtp_layout="ernie")
    assert hf_name("mtp.eh_proj.weight", mimo) == "model.mtp_layers.0.input_proj.weight"
    assert hf_name("mtp.self_attn.q_proj.bias", mimo) == "model.mtp_layers.0.self_attn.q_proj.bias"
    assert hf_name("mtp.shared_head.norm.weight", ernie) == "model.norm.weight"
    assert hf_name("mtp.mlp.down_proj.weight", ernie) == "model.mtp_block.0.mlp.down_proj.weight"
    w = np.arange(4 * 8).reshape(4, 8)
    swapped = convert("mtp.eh_proj.weight", w, mimo)
    assert swapped[0].tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
    assert np.array_equal(convert("mtp.eh_proj.weight", swapped, mimo), w)  # an involution
    assert convert("mtp.eh_proj.weight", w, ernie) is w  # ERNIE's order is eh_proj's


@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_chains_substeps_as_the_runtime_does(
    folders: dict[str, tuple[Path, Path]], layout: str
) -> None:
    """``train-mtp``'s unrolled chain feeds each substep what the serving path feeds it
    (the pre-norm target state for MiMo, the normed layer output for MiMo and ERNIE)."""
    from spectrio.tools.training.chain import mtp_chain, target_chain

    model = load(folders[layout][0], dtype="float64").model
    ids, s, depth = paddle.to_tensor(np.array([PROMPT])), 5, 3
    with paddle.no_grad():
        _, hidden, tokens = target_chain(model, ids, depth + 1)
        chained = [x.numpy() for x in mtp_chain(model, ids, hidden, tokens, depth)]
        _, h, _ = model.forward_dense(ids[:, : s + 1])
        g = [tokens[j][:, s : s + 1] for j in range(depth)]
        logits, mh, past = model.mtp_forward_dense(paddle.concat([ids[:, 1 : s + 1], g[0]], 1), h)
        for j in range(depth):
            if j:
                logits, mh, past = model.mtp_forward_dense(g[j], mh[:, -1:], past)
            np.testing.assert_allclose(chained[j][:, s], logits.numpy()[:, -1], rtol=0, atol=1e-10)


# ---- (b) the same weights in the DeepSeek layout: the same layer, bit for bit -----------


@pytest.mark.parametrize("layout", ["mimo", "ernie"])
def test_same_weights_in_the_deepseek_layout_give_identical_logits(
    folders: dict[str, tuple[Path, Path]], layout: str
) -> None:
    folder, twin = folders[layout]
    a, b = load(folder, dtype="float64").model, load(twin, dtype="float64").model
    assert b.config.mtp_layout == "deepseek"
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:  # MiMo's swapped halves land back in eh_proj's order
        assert np.array_equal(pa[name].numpy(), pb[name].numpy()), name
    rng = np.random.default_rng(0)
    prev = paddle.to_tensor(rng.normal(size=(1, len(PROMPT), D)))
    ids = paddle.to_tensor(np.array([PROMPT]))
    with paddle.no_grad():
        la, ha, _ = a.mtp_forward_dense(ids, prev)
        lb, hb, _ = b.mtp_forward_dense(ids, prev)
        assert np.array_equal(la.numpy(), lb.numpy())
        assert np.array_equal(la.numpy().argmax(-1), lb.numpy().argmax(-1))  # the drafts
        # The layout's layer ends in its norm: the state it passes on is the normed one.
        assert np.array_equal(ha.numpy(), b.mtp.shared_head.norm(hb).numpy())
        # The serving (paged) pass likewise.
        table = [np.arange(4)]
        batch = PackedBatch.from_sequences([PROMPT], [0], table)
        outs = []
        for m in (a, b):
            cache = PagedKVCache(1, 4, 4, 2, m.config.head_dim, "float64")
            outs.append(m.mtp_forward(batch, prev[0], cache).logits.numpy())
        assert np.array_equal(outs[0], outs[1])


# ---- (c) drafting in the runtime stays lossless -------------------------------------------


async def _greedy(folder: Path, spec: SpeculativeConfig) -> tuple[list[list[int]], int]:
    cfg = RuntimeConfig(
        model=str(folder),
        dtype="float64",
        max_model_len=96,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        speculative=spec,
    )
    prompts = [PROMPT, [7, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    out: list[list[int]] = [[] for _ in prompts]
    with trio.fail_after(120):
        async with open_runtime(cfg, encoded_channels=True) as rt:

            async def one(i: int) -> None:
                async for delta in rt.generate(prompts[i], SamplingParams(max_tokens=20)):
                    out[i].extend(delta.token_ids)

            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i)
            await rt.wait_idle()
            return out, rt.num_drafts_proposed


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_mtp_drafting_is_lossless_in_each_layout(
    folders: dict[str, tuple[Path, Path]], layout: str
) -> None:
    folder, _ = folders[layout]
    mtp = SpeculativeConfig(method="mtp", num_speculative_tokens=3, adaptive=False)
    drafted, proposed = await _greedy(folder, mtp)
    plain, none = await _greedy(folder, SpeculativeConfig(method=None))
    assert proposed > 0 and none == 0
    assert drafted == plain
    loaded = load(folder, dtype="float64")
    assert plain[0] == reference.greedy_generate(loaded.model, PROMPT, 20).token_ids


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_runtime_drafts_are_the_dense_chain_every_step(
    folders: dict[str, tuple[Path, Path]], layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lossless output says nothing about the drafts: a wrong MTP cache entry, catch-up row
    or hidden state only lowers acceptance. So every step's drafts, from the serving
    proposer (paged MTP cache caught up across steps, stale chain entries left behind by
    rejected drafts), must equal the dense reference chain run afresh on the same
    context."""
    from spectrio.stages.device.draft.mtp import MTPProposer

    folder, _ = folders[layout]
    seen: list[tuple[list[int], list[int]]] = []  # (history through the step's token, drafts)
    propose = MTPProposer.propose

    def recording(self: MTPProposer, plan: Any, history: Any) -> Any:
        out = propose(self, plan, history)
        for w in plan.seqs:
            if out.drafts.get(w.slot):
                seen.append((list(history.tokens(w.seq_id)), list(out.drafts[w.slot])))
        return out

    monkeypatch.setattr(MTPProposer, "propose", recording)
    await _greedy(folder, SpeculativeConfig(method="mtp", num_speculative_tokens=3, adaptive=False))
    model = load(folder, dtype="float64").model
    assert len(seen) > 20
    for context, drafts in seen:
        target, dense = reference.greedy_mtp_drafts(model, [context[:-1]], 3)
        assert target[0, 0] == context[-1]
        assert drafts == dense[0, : len(drafts)].tolist(), f"after {len(context)} tokens"


# ---- (d) tensor parallel 2 ------------------------------------------------------------------

TP_MTP = r"""
import json, sys, numpy as np, paddle
from spectrio.models import PackedBatch, PagedKVCache
from spectrio.models.architecture.parallel import load_sharded
from spectrio.runtime.tp import GroupEnv, init_collectives
tp = init_collectives(GroupEnv.from_environ())
out = {}
for folder in sys.argv[2:]:
    m = load_sharded(folder, tp, "float64").model
    cfg = m.config
    kvh = cfg.num_key_value_heads // tp.size
    ids = [5, 17, 30, 41, 22, 9]
    table = [np.arange(2)]
    cache = PagedKVCache(cfg.num_hidden_layers, 4, 8, kvh, cfg.head_dim, "float64")
    mcache = PagedKVCache(1, 4, 8, kvh, cfg.head_dim, "float64")
    with paddle.no_grad():
        t = m.forward(PackedBatch.from_sequences([ids], [0], table), cache)
        b = PackedBatch.from_sequences([ids[1:] + [3]], [0], table)
        mt = m.mtp_forward(b, t.hidden, mcache)
        logits, hidden, _ = m.forward_dense(paddle.to_tensor(np.array([ids])))
        dense = m.mtp_forward_dense(paddle.to_tensor(np.array([ids[1:] + [3]])), hidden)[0]
    out[folder] = [cfg.mtp_layout, mt.logits.numpy().tolist(), dense.numpy().tolist()]
json.dump(out, open(sys.argv[1] + f"/tp_rank{tp.rank}.json", "w"))
"""


def _single(folder: Path) -> list[np.ndarray]:
    m = load(folder, dtype="float64").model
    cfg = m.config
    ids = [5, 17, 30, 41, 22, 9]
    table = [np.arange(2)]
    kv = (cfg.num_key_value_heads, cfg.head_dim, "float64")
    cache, mcache = PagedKVCache(cfg.num_hidden_layers, 4, 8, *kv), PagedKVCache(1, 4, 8, *kv)
    with paddle.no_grad():
        t = m.forward(PackedBatch.from_sequences([ids], [0], table), cache)
        batch = PackedBatch.from_sequences([[*ids[1:], 3]], [0], table)
        paged = m.mtp_forward(batch, t.hidden, mcache).logits.numpy()
        _, hidden, _ = m.forward_dense(paddle.to_tensor(np.array([ids])))
        nxt = paddle.to_tensor(np.array([[*ids[1:], 3]]))
        dense = m.mtp_forward_dense(nxt, hidden)[0].numpy()
    return [paged, dense]


def test_two_ranks_load_each_layout(folders: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """A two-rank group shards the MTP block of each layout (MiMo's q/k/v biases and its
    permuted, replicated input_proj; ERNIE's block and shared norm) and computes what one
    process computes."""
    paths = [str(folders[layout][0]) for layout in LAYOUTS]
    run_ranks(lambda r: ["-c", TP_MTP, str(tmp_path), *paths], timeout=180)
    ranks = [json.loads((tmp_path / f"tp_rank{r}.json").read_text()) for r in range(2)]
    for layout, path in zip(LAYOUTS, paths, strict=True):
        want = _single(Path(path))
        for r in ranks:
            assert r[path][0] == layout
            for got, ref in zip(r[path][1:], want, strict=True):
                np.testing.assert_allclose(np.array(got), ref, rtol=0, atol=1e-12, err_msg=layout)


# ---- (e) what the layer cannot hold is refused, naming the tensor ---------------------------


def _edited(root: Path, layout: str, edit: dict[str, np.ndarray | None]) -> Path:
    cfg, tensors = deepseek_tensors(layout)
    tensors = relayout(tensors, layout)
    for name, arr in edit.items():
        if arr is None:
            del tensors[name]
        else:
            tensors[name] = arr
    return write(root / "edited", cfg, tensors, EXTRA[layout])


Z = np.zeros((D,), dtype=np.float32)


@pytest.mark.parametrize(
    "layout,edit,message",
    [
        ("mimo", {"model.mtp_layers.0.token_layernorm.weight": None},
         r"missing tensor 'model.mtp_layers.0.token_layernorm.weight'"),
        ("mimo", {"model.mtp_layers.0.input_proj.weight": np.zeros((D, D), np.float32)},
         r"'model.mtp_layers.0.input_proj.weight' has shape \[32, 32\], expected \[32, 64\]"),
        ("mimo", {"model.mtp_layers.0.input_proj.bias": Z},
         r"unexpected MTP tensor 'model.mtp_layers.0.input_proj.bias'"),
        ("mimo", {"model.mtp_layers.1.final_layernorm.weight": Z},
         r"unexpected MTP tensor 'model.mtp_layers.1.final_layernorm.weight'"),
        ("mimo", {f"model.layers.{L}.enorm.weight": Z},
         rf"two layouts, 'model.layers.{L}.enorm.weight' \(deepseek\) and "
         r"'model.mtp_layers.0.final_layernorm.weight' \(mimo\)"),
        ("ernie", {"model.mtp_hidden_norm.0.weight": None},
         r"missing tensor 'model.mtp_hidden_norm.0.weight'"),
        ("ernie", {"model.mtp_block.0.mlp.up_proj.weight": np.zeros((D, 48), np.float32)},
         r"'model.mtp_block.0.mlp.up_proj.weight' has shape \[32, 48\], expected \[48, 32\]"),
        # PaddleFormers gives mtp_linear_proj a bias when use_bias is on; spectrio's
        # eh_proj has none (nor does FastDeploy's, which would leave it unread).
        ("ernie", {"model.mtp_linear_proj.0.bias": Z},
         r"unexpected MTP tensor 'model.mtp_linear_proj.0.bias'"),
        ("ernie", {"model.mtp_block.1.input_layernorm.weight": Z},
         r"unexpected MTP tensor 'model.mtp_block.1.input_layernorm.weight'"),
        # FastDeploy's Paddle checkpoints name it ernie.*: not the names spectrio's ERNIE
        # target reads, so not silently mixed in.
        ("ernie", {"ernie.mtp_emb_norm.0.weight": Z},
         r"unexpected tensor 'ernie.mtp_emb_norm.0.weight'"),
    ],
)  # fmt: skip
def test_a_malformed_layout_is_refused_naming_the_tensor(
    tmp_path: Path, layout: str, edit: dict[str, np.ndarray | None], message: str
) -> None:
    folder = _edited(tmp_path, layout, edit)
    with pytest.raises(CheckpointError, match=message):
        load(folder)


def test_a_mimo_config_spectrio_cannot_build_is_refused() -> None:
    raw = {**tiny_config("mimo").to_dict(), **EXTRA["mimo"]}
    assert ModelConfig.from_dict(raw).qkv_bias and not ModelConfig.from_dict(raw).o_bias
    with pytest.raises(ModelConfigError, match="num_nextn_predict_layers must be 0 or 1"):
        ModelConfig.from_dict({**raw, "num_nextn_predict_layers": 2})
    with pytest.raises(ModelConfigError, match="use_sliding_window=True"):
        ModelConfig.from_dict({**raw, "use_sliding_window": True})
    with pytest.raises(ModelConfigError, match="field 'use_bias'"):
        ModelConfig.from_dict({**raw, "use_bias": True})


@pytest.mark.parametrize("max_lag", [1024, 2])
async def test_drafts_after_deferred_catch_ups_are_the_dense_chain(
    folders: dict[str, tuple[Path, Path]], monkeypatch: pytest.MonkeyPatch, max_lag: int
) -> None:
    """Steps that draft 0 defer the MTP layer's catch-up (stages/device/draft/mtp.py); the next
    step that drafts catches up on every held row at once, from hidden states kept across
    several steps. Its drafts must still be the dense chain's on the same context, with
    the lag limit far (a stretch of k = 0 caught up only when drafting resumes) and near
    (catch-ups forced between drafting steps)."""
    from spectrio.stages.device.draft import mtp
    from spectrio.stages.planning.spec_policy import SpecPolicy

    monkeypatch.setattr(mtp, "MIN_LAG", min(max_lag, mtp.MIN_LAG))
    monkeypatch.setattr(mtp, "MAX_LAG", max_lag)
    pattern = itertools.cycle([0, 0, 0, 0, 0, 3, 0, 0, 2, 0, 1, 0, 0, 0])
    monkeypatch.setattr(SpecPolicy, "choose", lambda self, n, closing=None: next(pattern))
    deferred: list[bool] = []
    may_defer = mtp.CatchUp.may_defer

    def counting(self: mtp.CatchUp, work: Any, lag: int) -> bool:
        deferred.append(may_defer(self, work, lag))
        return deferred[-1]

    monkeypatch.setattr(mtp.CatchUp, "may_defer", counting)
    seen: list[tuple[list[int], list[int]]] = []
    propose = mtp.MTPProposer.propose

    def recording(self: mtp.MTPProposer, plan: Any, history: Any) -> Any:
        out = propose(self, plan, history)
        for w in plan.seqs:
            if out.drafts.get(w.slot):
                seen.append((list(history.tokens(w.seq_id)), list(out.drafts[w.slot])))
        return out

    monkeypatch.setattr(mtp.MTPProposer, "propose", recording)
    folder, _ = folders[LAYOUTS[0]]
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=3, adaptive=True)
    drafted, _ = await _greedy(folder, spec)
    plain, _ = await _greedy(folder, SpeculativeConfig(method=None))
    assert drafted == plain
    assert sum(deferred) >= 10 and len(seen) >= 6
    model = load(folder, dtype="float64").model
    for context, drafts in seen:
        target, dense = reference.greedy_mtp_drafts(model, [context[:-1]], 3)
        assert target[0, 0] == context[-1]
        assert drafts == dense[0, : len(drafts)].tolist(), f"after {len(context)} tokens"
