"""Each architecture the decoder runs, against Hugging Face transformers.

``tests/data/archs/<case>/`` holds a tiny random checkpoint per case (Llama plain, with
attention and MLP bias and llama3 RoPE, with linear and dynamic RoPE, Qwen2 in bfloat16
shards, Qwen3 with q/k norms in an index of shards, ERNIE 4.5 with bias), and
``golden.json`` transformers' float64 greedy tokens for them; both come from
``tests/hf_golden.py tiny`` (run in a scratch environment with torch). Here spectrio's
dense oracle, its paged serving forward, and a two-rank tensor-parallel group must emit
exactly those tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import paddle
import pytest
from test_tensor_parallel import run_ranks

from spectrio.errors import ModelConfigError
from spectrio.models import LoadedModel, ModelConfig, PackedBatch, PagedKVCache, load, reference
from spectrio.models.loading.checkpoint import half_to_interleaved, interleaved_to_half

ARCHS = Path(__file__).resolve().parent / "data" / "archs"
GOLDEN = json.loads((ARCHS / "golden.json").read_text())
CASES = sorted(GOLDEN["cases"])


def paged_greedy(loaded: LoadedModel, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy decoding through the serving forward: the prompt as one prefill, then one
    row per step over the paged cache."""
    cfg = loaded.config
    model = loaded.model
    block = 4
    blocks = (len(prompt) + new_tokens) // block + 1
    cache = PagedKVCache(
        cfg.num_hidden_layers, blocks, block, cfg.num_key_value_heads, cfg.head_dim, model.dtype
    )
    table = np.arange(blocks)
    out: list[int] = []
    with paddle.no_grad():
        logits = model.forward(PackedBatch.from_sequences([prompt], [0], [table]), cache).logits
        while True:
            out.append(int(logits[-1].numpy().argmax()))
            if len(out) == new_tokens:
                return out
            pos = len(prompt) + len(out) - 1
            batch = PackedBatch.from_sequences([[out[-1]]], [pos], [table])
            logits = model.forward(batch, cache).logits


@pytest.fixture(scope="module", params=CASES)
def case(request: pytest.FixtureRequest) -> tuple[str, LoadedModel]:
    return request.param, load(ARCHS / request.param, dtype="float64")


def test_golden_cases_cover_every_family() -> None:
    families = {ModelConfig.from_json(ARCHS / c / "config.json").family for c in CASES}
    assert families == {"llama", "qwen2", "qwen3", "ernie4_5"}
    kinds = {
        (ModelConfig.from_json(ARCHS / c / "config.json").rope_scaling or "none").__str__()
        for c in CASES
    }
    assert any("llama3" in k for k in kinds) and any("linear" in k for k in kinds)
    assert any("dynamic" in k for k in kinds)


def test_dense_greedy_equals_transformers(case: tuple[str, LoadedModel]) -> None:
    name, loaded = case
    for prompt, want in zip(GOLDEN["prompts"], GOLDEN["cases"][name], strict=True):
        got = reference.greedy_generate(loaded.model, prompt, GOLDEN["new_tokens"])
        assert got.token_ids == want, name


def test_paged_greedy_equals_transformers(case: tuple[str, LoadedModel]) -> None:
    name, loaded = case
    for prompt, want in zip(GOLDEN["prompts"], GOLDEN["cases"][name], strict=True):
        assert paged_greedy(loaded, prompt, GOLDEN["new_tokens"]) == want, name


def test_each_switch_changes_the_output() -> None:
    """The goldens are sensitive to what they prove: turning off the part a family adds
    (bias, q/k norm, the interleaved-RoPE permutation, RoPE scaling) changes tokens."""
    prompt, n = GOLDEN["prompts"][0], GOLDEN["new_tokens"]

    def tokens(loaded: LoadedModel) -> list[int]:
        return reference.greedy_generate(loaded.model, prompt, n).token_ids

    for name, part in [
        ("qwen2", "self_attn.q_proj.bias"),
        ("qwen3", "self_attn.q_norm.weight"),
        ("llama_bias_llama3", "mlp.down_proj.bias"),
    ]:
        loaded = load(ARCHS / name, dtype="float64")
        with paddle.no_grad():
            for layer in loaded.model.model.layers:
                p = dict(layer.named_parameters())[part]
                p.set_value(paddle.zeros_like(p) if "bias" in part else paddle.ones_like(p))
        loaded.model.drop_serving_cache()
        assert tokens(loaded) != GOLDEN["cases"][name][0], (name, part)
    # ERNIE without the q/k permutation: its pairs would rotate the wrong dimensions.
    loaded = load(ARCHS / "ernie4_5", dtype="float64")
    with paddle.no_grad():
        for layer in loaded.model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                w = half_to_interleaved(proj.weight.numpy().T, 16).T
                proj.weight.set_value(np.ascontiguousarray(w))
    assert tokens(loaded) != GOLDEN["cases"]["ernie4_5"][0]
    # llama3 RoPE read as unscaled.
    cfg = load(ARCHS / "llama_bias_llama3", dtype="float64")
    plain = ModelConfig.from_dict(
        {**cfg.config.to_dict(), "rope_scaling": None, "num_nextn_predict_layers": 0}
    )
    assert not np.allclose(plain.inv_freq(), cfg.config.inv_freq())


def test_permutation_round_trips() -> None:
    rows = np.arange(2 * 8 * 3).reshape(16, 3)
    assert np.array_equal(half_to_interleaved(interleaved_to_half(rows, 8), 8), rows)
    # Row 2i of a head moves to i, row 2i+1 to D/2 + i.
    assert interleaved_to_half(np.arange(8), 8).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


def test_ernie_round_trips_through_save(tmp_path: Path) -> None:
    """Saving writes q/k back in ERNIE's interleaved order, so the file reloads as the
    same model (and transformers would read it as written)."""
    from safetensors.numpy import load_file

    from spectrio.models import save_checkpoint

    loaded = load(ARCHS / "ernie4_5", dtype="float64")
    save_checkpoint(loaded.model, tmp_path)
    ours = load_file(str(tmp_path / "model.safetensors"))
    theirs = load_file(str(ARCHS / "ernie4_5" / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_array_equal(ours[name], theirs[name])
    assert json.loads((tmp_path / "config.json").read_text())["use_bias"] is True


def test_dynamic_rope_refuses_positions_past_the_limit() -> None:
    loaded = load(ARCHS / "llama_dynamic", dtype="float64")
    limit = loaded.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"position {limit} is past"):
        loaded.model._rope(paddle.to_tensor(np.array([limit])))


def test_transformers_5_rope_parameters_are_read() -> None:
    raw = json.loads((ARCHS / "llama_bias_llama3" / "config.json").read_text())
    scaling = raw.pop("rope_scaling")
    theta = raw.pop("rope_theta")
    raw["rope_parameters"] = {**scaling, "rope_theta": theta}
    old = ModelConfig.from_json(ARCHS / "llama_bias_llama3" / "config.json")
    assert ModelConfig.from_dict(raw) == old


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"architectures": ["MistralForCausalLM"]}, "unknown architecture 'MistralForCausalLM'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "type 'yarn' is not supported"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "'longrope'"),
        ({"rope_scaling": {"rope_type": "linear"}}, "needs 'factor'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2, "beta": 1}}, "field 'beta'"),
        ({"use_sliding_window": True}, "use_sliding_window=True is not supported"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "'sliding_attention'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"use_bias": True}, "field 'use_bias' \\(a ernie4_5 field\\) is not implemented"),
        ({"rope_interleave": True}, "field 'rope_interleave' is not implemented"),
    ],
)
def test_config_refusals_name_the_field(edit: dict[str, object], message: str) -> None:
    raw = json.loads((ARCHS / "qwen2" / "config.json").read_text())
    raw.update(edit)
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dict(raw)


def test_family_defaults_follow_transformers() -> None:
    raw = json.loads((ARCHS / "llama" / "config.json").read_text())
    del raw["tie_word_embeddings"]
    assert ModelConfig.from_dict(raw).tie_word_embeddings is False  # LlamaConfig's default
    raw = json.loads((ARCHS / "ernie4_5" / "config.json").read_text())
    del raw["tie_word_embeddings"], raw["rms_norm_eps"]
    cfg = ModelConfig.from_dict(raw)
    assert cfg.tie_word_embeddings is True and cfg.rms_norm_eps == 1e-5
    raw["eos_token_id"] = [2, 7]
    cfg = ModelConfig.from_dict(raw)
    assert cfg.eos_token_id == 2 and cfg.eos_token_ids == (2, 7)


TP_FORWARD = r"""
import json, sys, numpy as np, paddle
from spectrio.models import PackedBatch, PagedKVCache
from spectrio.models.architecture.parallel import load_sharded
from spectrio.runtime.tp import GroupEnv, init_collectives
tp = init_collectives(GroupEnv.from_environ())
out = {}
for name in sys.argv[3:]:
    m = load_sharded(sys.argv[2] + "/" + name, tp, "float64").model
    cfg = m.config
    kvh = cfg.num_key_value_heads // tp.size
    cache = PagedKVCache(cfg.num_hidden_layers, 8, 8, kvh, cfg.head_dim, "float64")
    tables = [np.array([0, 1]), np.array([2, 3])]
    b = PackedBatch.from_sequences([[5, 17, 30, 40, 22], [9, 8, 7]], [0, 0], tables)
    with paddle.no_grad():
        pre = m.forward(b, cache).logits.numpy()
        dec = m.forward(PackedBatch.from_sequences([[11], [12]], [5, 3], tables), cache)
        dense = m.forward_dense(paddle.to_tensor(np.array([[5, 17, 30, 40, 22]])))[0].numpy()
    out[name] = [pre.tolist(), dec.logits.numpy().tolist(), dense.tolist()]
json.dump(out, open(sys.argv[1] + f"/tp_rank{tp.rank}.json", "w"))
"""


def test_two_rank_shards_equal_the_whole_model(tmp_path: Path) -> None:
    """Biases (split with their columns, or replicated and added once after the
    all-reduce), q/k norms and ERNIE's permuted rows shard correctly: two ranks'
    prefill, decode and dense logits equal the single-process model's."""
    names = ["llama_bias_llama3", "qwen2", "qwen3", "ernie4_5"]
    run_ranks(lambda r: ["-c", TP_FORWARD, str(tmp_path), str(ARCHS), *names], timeout=180)
    ranks = [json.loads((tmp_path / f"tp_rank{r}.json").read_text()) for r in range(2)]
    for name in names:
        m = load(ARCHS / name, dtype="float64").model
        cfg = m.config
        cache = PagedKVCache(
            cfg.num_hidden_layers, 8, 8, cfg.num_key_value_heads, cfg.head_dim, "float64"
        )
        tables = [np.array([0, 1]), np.array([2, 3])]
        with paddle.no_grad():
            pre = m.forward(
                PackedBatch.from_sequences([[5, 17, 30, 40, 22], [9, 8, 7]], [0, 0], tables),
                cache,
            ).logits.numpy()
            dec = m.forward(PackedBatch.from_sequences([[11], [12]], [5, 3], tables), cache)
            dense = m.forward_dense(paddle.to_tensor(np.array([[5, 17, 30, 40, 22]])))[0]
        for r in ranks:
            got = [np.array(x) for x in r[name]]
            np.testing.assert_allclose(got[0], pre, rtol=0, atol=1e-12, err_msg=name)
            np.testing.assert_allclose(got[1], dec.logits.numpy(), rtol=0, atol=1e-12)
            np.testing.assert_allclose(got[2], dense.numpy(), rtol=0, atol=1e-12)
