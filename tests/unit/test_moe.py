"""MoE / MLA / MTP model specs (search.layers.moe_spec, search.layers.moe_params, search.spec.hf_moe): counts against hand-computed formulas
and the published totals, the HF import against the presets, the refusal where pricing starts.

megatron-core's own modules count the same models in tests/runtime/test_moe_params.py."""

import json
from pathlib import Path

import pydantic
import pytest

import model_specs
from search.cli.import_hf import hf_to_spec
from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.io.errors import AcesoError
from search.spec.model import ModelSpec
from search.layers.moe_params import counts
from search.spec.presets import load_model
from search.spec.training import TrainingSpec

HF = json.loads((Path(__file__).parent / "data" / "hf_moe_configs.json").read_text())

# Published (total, active) in billions and the relative tolerance the published rounding allows
# (model_specs/presets/SOURCES-moe.md cites each).
PUBLISHED = {
    "mixtral-8x7b": (46.7, 12.9, 0.005),
    "mixtral-8x22b": (141.0, 39.0, 0.005),
    "qwen3-30b-a3b": (30.5, 3.3, 0.02),
    "qwen3-235b-a22b": (235.0, 22.0, 0.01),
    "deepseek-v3-no-mtp": (671.0, 37.0, 0.015),
    "kimi-k2": (1000.0, 32.0, 0.03),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_total_and_active(name):
    total, active, tol = PUBLISHED[name]
    c = counts(load_model(name))
    assert c.total / 1e9 == pytest.approx(total, rel=tol)
    assert c.active / 1e9 == pytest.approx(active, rel=tol)


def test_deepseek_v3_mtp_is_the_published_14b_less_the_shared_embedding_and_head():
    m = load_model("deepseek-v3")
    c = counts(m)
    assert c.total == counts(load_model("deepseek-v3-no-mtp")).total + c.mtp
    hf_mtp = c.mtp + 2 * m.padded_vocab_size * m.hidden_size        # HF stores its own embedding and head copy
    assert hf_mtp / 1e9 == pytest.approx(14.0, rel=0.05)
    assert c.total / 1e9 + 2 * m.padded_vocab_size * m.hidden_size / 1e9 == pytest.approx(685, rel=0.005)


def test_mixtral_by_hand():
    m = load_model("mixtral-8x7b")
    h, L, V, ffn, kv, E, k = 4096, 32, 32000, 14336, 8 * 128, 8, 2
    att = h * (h + 2 * kv) + h * h + h
    expert = 3 * h * ffn
    mlp = E * h + h
    c = counts(m)
    assert c.total == L * (att + mlp + E * expert) + 2 * V * h + h
    assert c.active == L * (att + mlp + k * expert) + 2 * V * h + h
    assert c.router_per_layer == E * h and c.experts_per_layer == E * expert and c.shared_expert_per_layer == 0
    assert m.num_parameters == c.total


def test_deepseek_layer_by_hand():
    """One MLA layer and one MoE block of DeepSeek-V3, the formulas written out (no biases, RMSNorm)."""
    from search.layers.moe_params import layer_mlp_params, mla_params
    m = load_model("deepseek-v3")
    h, n, ql, kvl, d, r, v = 7168, 128, 1536, 512, 128, 64, 128
    mla = h * ql + ql + ql * n * (d + r) + h * (kvl + r) + kvl + kvl * n * (d + v) + n * v * h + h
    assert mla_params(m) == mla
    dense, _ = layer_mlp_params(m, 2)
    assert dense == 3 * h * 18432 + h
    moe, act = layer_mlp_params(m, 3)
    assert moe == 256 * h + 3 * h * 2048 * (256 + 1) + h and act == 256 * h + 3 * h * 2048 * (8 + 1) + h


def test_layer_patterns():
    ds = load_model("deepseek-v3").moe
    assert [ds.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]
    tiny = {"family": "llama", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128,
            "seq_length": 32, "vocab_size": 256}
    moe = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32}
    every2 = ModelSpec.model_validate({**tiny, "moe": {**moe, "moe_layer_freq": 2}}).moe
    assert [every2.is_moe_layer(i) for i in range(4)] == [True, False, True, False]       # Megatron: i % N == 0
    listed = ModelSpec.model_validate({**tiny, "moe": {**moe, "moe_layer_freq": [0, 1, 1, 0]}}).moe
    assert [listed.is_moe_layer(i) for i in range(4)] == [False, True, True, False]
    with pytest.raises(pydantic.ValidationError, match="not t5"):
        ModelSpec.model_validate({**tiny, "family": "t5", "num_decoder_layers": 2, "decoder_seq_length": 8,
                                  "moe": moe})


def test_dense_models_unchanged():
    m = load_model("llama3-8b")
    assert m.moe is None and m.mla is None and m.mtp_num_layers is None
    assert counts(m).total == m.num_parameters == counts(m).active


def plain_rope(cfg: dict) -> dict:
    """GPT-OSS's config without its YaRN: megatron-core 0.16.1 runs YaRN on multi-latent attention only, so the
    import refuses it (tests/unit/test_hf_real_configs.py); the presets are Megatron-LM's GPT-OSS (plain RoPE)."""
    return {k: v for k, v in cfg.items() if not k.startswith("_") and not (k == "rope_scaling" and
                                                                          cfg["model_type"] == "gpt_oss")}


@pytest.mark.parametrize("name", sorted(k for k in HF if not k.startswith("_")))
def test_hf_import_matches_preset(name):
    cfg = plain_rope(HF[name])
    spec = hf_to_spec(cfg, source=name, seq_length=4096)
    preset = load_model(name)
    for f in ("moe", "mla", "mtp_num_layers", "megatron", "num_layers", "hidden_size", "vocab_size",
              "num_attention_heads"):
        assert getattr(spec, f) == getattr(preset, f), f
    assert counts(spec) == counts(preset)


def test_presets_and_hf_imports_route_as_they_learn():
    """Issue 32: ``models --from-hf`` of a Qwen3-MoE config wrote moe_router_force_load_balancing true (benchmark
    routing: random router scores). Megatron-LM's default is learned routing (the flag is store_true, off), so no
    preset or HF import forces balance."""
    imported = 0
    for name in sorted(k for k in HF if not k.startswith("_")):
        cfg = {k: v for k, v in HF[name].items() if not k.startswith("_")}
        try:
            spec = hf_to_spec(cfg, source=name, seq_length=4096)
        except AcesoError as e:          # GPT-OSS's published config: YaRN on standard attention is refused
            assert "rope_scaling" in str(e), (name, e)
            continue
        assert not spec.moe.moe_router_force_load_balancing, name
        imported += 1
    assert imported >= 4
    moe = [m for m in map(load_model, model_specs.preset_names()) if m.moe is not None]
    assert len(moe) >= 10 and not any(m.moe.moe_router_force_load_balancing for m in moe)


def test_qwen3_sparse_step_follows_hf_rule():
    cfg = {k: v for k, v in HF["qwen3-30b-a3b"].items() if not k.startswith("_")}
    spec = hf_to_spec({**cfg, "num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}, "q")
    assert spec.moe.moe_layer_freq == [0, 1, 0, 0]           # HF: (i + 1) % step == 0, minus mlp_only_layers


@pytest.mark.parametrize("name", ["mixtral-8x7b", "deepseek-v3", "kimi-k2"])
def test_analytic_prices_moe_the_others_refuse(name):
    """The profile kind prices MoE layers from a database's moe rows (tests/unit/test_profiledb_moe.py), not MLA
    or MTP; aceso-compat none of them."""
    model, cluster, training = load_model(name), parse_cluster("1x8-h100"), TrainingSpec(global_batch_size=8)
    assert make_cost_model(model, cluster, training).kind == "analytic"
    said = "no profile database at x" if name == "mixtral-8x7b" else "the profile cost model does not price them"
    with pytest.raises(AcesoError, match=said):
        make_cost_model(model, cluster, training, "profile", db="x")
    with pytest.raises(AcesoError, match="the aceso-compat cost model does not price them"):
        make_cost_model(model, cluster, training, "aceso-compat", db="x")
