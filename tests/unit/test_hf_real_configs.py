"""`aceso models --from-hf` on the published config.json of nine models (tests/unit/data/hf, SOURCES.md there):
every architecture field is kept (and counted, and exported) or the import stops naming it; the training length is
--seq-length or 4096 with a note, never the model's context; parameter counts against each model card and against
the models' modules counted by hand; unknown enum values and fields are refused in one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from search.cli import main
from search.cli.import_hf import hf_to_spec
from search.io.errors import AcesoError
from search.layers.moe_params import counts
from search.spec.presets import load_model

DATA = Path(__file__).parent / "data" / "hf"
IMPORTED = ("llama-3.1-8b", "qwen2.5-7b", "qwen3-8b", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3", "glm-4.5")
REFUSED = {"llama-4-scout": "text_config.attention_chunk_size 8192: Llama 4's chunked local attention",
           "gemma-3-27b": "model_type gemma3 (Gemma): its layer"}


def config(name: str) -> dict:
    return json.loads((DATA / name / "config.json").read_text())


def spec(name: str, cfg: dict | None = None, **kw):
    return hf_to_spec(cfg if cfg is not None else config(name), source=name, **kw)


def _emb(m) -> int:
    return m.padded_vocab_size * m.hidden_size


# ----- what the import keeps ----------------------------------------------------------------------------------------
def test_architecture_fields_are_kept():
    llama, qwen25, qwen3 = spec("llama-3.1-8b"), spec("qwen2.5-7b"), spec("qwen3-8b")
    assert llama.rope_scaling.type == "llama3" and llama.rope_scaling.factor == 8.0 and llama.rotary_base == 500000
    assert llama.megatron is None and not llama.tied_embeddings and llama.groups == 8
    assert qwen25.megatron == {"add_qkv_bias": True, "layernorm_epsilon": 1e-6} and not qwen25.add_bias_linear
    assert qwen25.window_size is None                          # use_sliding_window false
    assert qwen3.megatron == {"qk_layernorm": True, "layernorm_epsilon": 1e-6} and qwen3.head_dim == 128
    moe = spec("qwen3-30b-a3b")
    assert moe.kv_channels == 128 and moe.hidden_size // moe.num_attention_heads == 64       # head_dim != h / heads
    ds = spec("deepseek-v3")
    assert ds.rope_scaling.model_dump(exclude_none=True) == {"type": "yarn", "factor": 40.0, "mscale_all_dim": 1.0}
    assert [ds.rope_scaling.yarn(k) for k in ("original_max_position_embeddings", "beta_fast", "beta_slow",
                                              "mscale")] == [4096, 32, 1, 1.0]      # megatron-core's defaults
    assert ds.megatron == {"qk_layernorm": True, "layernorm_epsilon": 1e-6, "moe_router_topk_scaling_factor": 2.5}
    assert (ds.moe.moe_router_score_function, ds.moe.moe_router_enable_expert_bias, ds.moe.moe_router_num_groups,
            ds.moe.moe_router_group_topk, ds.mtp_num_layers) == ("sigmoid", True, 8, 4, 1)
    glm = spec("glm-4.5")
    assert glm.megatron == {"add_qkv_bias": True, "qk_layernorm": True, "moe_router_topk_scaling_factor": 2.5}
    assert (glm.rotary_percent, glm.kv_channels, glm.num_query_groups, glm.mtp_num_layers) == (0.5, 128, 8, 1)
    assert (glm.moe.num_experts, glm.moe.moe_router_topk, glm.moe.first_k_dense_layers,
            glm.moe.moe_shared_expert_intermediate_size, glm.moe.moe_router_score_function,
            glm.moe.moe_router_enable_expert_bias, glm.moe.moe_router_num_groups) == \
        (160, 8, 3, 1536, "sigmoid", True, None)
    mistral = spec("mistral", {**config("llama-3.1-8b"), "model_type": "mistral", "rope_scaling": None,
                               "sliding_window": 4096})
    assert (mistral.window_size, mistral.window_attn_skip_freq) == ([4095, 0], None)     # every layer, 4096 keys
    qwen_swa = spec("q", {**config("qwen2.5-7b"), "use_sliding_window": True, "sliding_window": 4096,
                          "max_window_layers": 26})
    assert qwen_swa.window_size == [4095, 0] and qwen_swa.window_attn_skip_freq == [0] * 26 + [1] * 2


# ----- the training length -----------------------------------------------------------------------------------------
def test_seq_length_is_the_option_or_4096_with_a_note(tmp_path, capsys):
    out = tmp_path / "q.json"
    assert main(["models", "--from-hf", str(DATA / "qwen2.5-7b" / "config.json"), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert load_model(str(out)).seq_length == 4096
    assert "note: seq_length 4096: max_position_embeddings 131072 is the longest context" in err
    assert main(["models", "--from-hf", str(DATA / "qwen2.5-7b" / "config.json"), "--seq-length", "8192", "-o",
                 str(out)]) == 0
    assert load_model(str(out)).seq_length == 8192 and "note" not in capsys.readouterr().err
    assert main(["import-hf", str(DATA / "mixtral-8x7b" / "config.json"), "--seq-length", "2048", "-o", str(out)]) == 0
    assert load_model(str(out)).seq_length == 2048


# ----- parameter counts ---------------------------------------------------------------------------------------------
# (model card total, active, relative tolerance of the published rounding): SOURCES.md names each card
PUBLISHED = {"llama-3.1-8b": (8.03, None, 0.001), "qwen2.5-7b": (7.61, None, 0.001), "qwen3-8b": (8.2, None, 0.005),
             "qwen3-30b-a3b": (30.5, 3.3, 0.02), "mixtral-8x7b": (46.7, 12.9, 0.005)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_counts_match_the_model_card(name):
    total, active, tol = PUBLISHED[name]
    c = counts(spec(name))
    assert c.total / 1e9 == pytest.approx(total, rel=tol)
    if active:
        assert c.active / 1e9 == pytest.approx(active, rel=tol)


def test_non_embedding_counts_match_the_qwen_cards():
    """Qwen's cards also give the count without the embedding and output layer: 6.53B, 6.95B, 29.9B."""
    for name, want in (("qwen2.5-7b", 6.53), ("qwen3-8b", 6.95), ("qwen3-30b-a3b", 29.9)):
        m = spec(name)
        assert (counts(m).total - 2 * _emb(m)) / 1e9 == pytest.approx(want, rel=0.002), name


def test_deepseek_v3_is_671b_plus_the_mtp_module_37b_active():
    m = spec("deepseek-v3")
    c = counts(m)
    assert (c.total - c.mtp) / 1e9 == pytest.approx(671, rel=0.002)
    assert (c.mtp + 2 * _emb(m)) / 1e9 == pytest.approx(14, rel=0.05)        # HF's MTP keeps its own copies
    routed = m.moe.num_experts - m.moe.moe_router_topk
    mtp_active = c.mtp - routed * (3 * m.hidden_size * m.moe.moe_ffn_hidden_size)
    assert (c.active - mtp_active) / 1e9 == pytest.approx(37, rel=0.015)


def test_glm45_is_355b_with_32b_active():
    """GLM-4.5's card: 355B total, 32B active (a rounded headline: our main model 352.8B, with the MTP layer
    356.8B; active without the embedding and output layer and the MTP layer 32.1B)."""
    m = spec("glm-4.5")
    c = counts(m)
    expert = 3 * m.hidden_size * m.moe.moe_ffn_hidden_size
    assert (c.total - c.mtp) / 1e9 == pytest.approx(355, rel=0.01)
    mtp_active = c.mtp - (m.moe.num_experts - m.moe.moe_router_topk) * expert
    assert (c.active - mtp_active - 2 * _emb(m)) / 1e9 == pytest.approx(32, abs=0.15)


def _attention(h, heads, groups, d, qkv_bias=False, qk_norm=False):
    """One HF self-attention with its input RMSNorm: q/k/v/o projections, their biases, per-head q/k norms."""
    q, kv = heads * d, groups * d
    return h * q + 2 * h * kv + q * h + (q + 2 * kv if qkv_bias else 0) + (2 * d if qk_norm else 0) + h


def _mlp(h, ffn):
    return 3 * h * ffn + h                               # gate, up, down and the post-attention RMSNorm


@pytest.mark.parametrize("name, layer", [
    ("llama-3.1-8b", lambda: _attention(4096, 32, 8, 128) + _mlp(4096, 14336)),
    ("qwen2.5-7b", lambda: _attention(3584, 28, 4, 128, qkv_bias=True) + _mlp(3584, 18944)),
    ("qwen3-8b", lambda: _attention(4096, 32, 8, 128, qk_norm=True) + _mlp(4096, 12288)),
])
def test_dense_counts_by_hand(name, layer):
    """HF's modules counted by hand: the layers, the untied embedding and output layer, the final norm (Qwen2.5-7B:
    7,615,616,512 with its QKV biases)."""
    m = spec(name)
    cfg = config(name)
    assert m.num_parameters == cfg["num_hidden_layers"] * layer() + 2 * cfg["vocab_size"] * cfg["hidden_size"] + \
        cfg["hidden_size"]
    assert m.padded_vocab_size == cfg["vocab_size"]


def test_glm45_by_hand():
    """GLM-4.5's modules: QKV biases, per-head q/k norms (head_dim 128, not 5120 / 96), 3 dense layers, 89 MoE layers
    (router, 160 experts, one shared expert), the MTP layer (enorm, hnorm, eh_proj, one MoE layer, its norm)."""
    m = spec("glm-4.5")
    h, V = 5120, 151552
    att = _attention(h, 96, 8, 128, qkv_bias=True, qk_norm=True)
    moe = 160 * h + 160 * 3 * h * 1536 + 3 * h * 1536 + h
    mtp = 2 * h + 2 * h * h + att + moe + h
    assert counts(m).total == 92 * att + 3 * _mlp(h, 12288) + 89 * moe + mtp + 2 * V * h + h


# ----- refusals: one line naming the field --------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_models_megatron_core_cannot_build_are_refused(name, tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["models", "--from-hf", str(DATA / name / "config.json"), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert REFUSED[name] in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def _edit(name: str, path: str, value):
    cfg = copy.deepcopy(config(name))
    node, keys = cfg, path.split(".")
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value
    return cfg


@pytest.mark.parametrize("name, path, value, needle", [
    ("deepseek-v3", "scoring_func", "sqrtsoftplus", "scoring_func 'sqrtsoftplus' is not one aceso's import knows "
                                                    "(softmax, sigmoid)"),
    ("deepseek-v3", "topk_method", "noaux_tc2", "topk_method 'noaux_tc2' is not one"),
    ("deepseek-v3", "topk_method", "group_limited_greedy", "topk_method \"group_limited_greedy\": DeepSeek-V2's"),
    ("deepseek-v3", "norm_topk_prob", False, "norm_topk_prob false: HF keeps the sigmoid router's top-k weights "
                                             "unnormalized; megatron-core's sigmoid router renormalizes them"),
    ("glm-4.5", "norm_topk_prob", False, "norm_topk_prob false: HF keeps the sigmoid router's top-k weights"),
    ("deepseek-v3", "rope_scaling.type", "dynamic", "rope_scaling.type \"dynamic\": megatron-core scales"),
    ("llama-3.1-8b", "rope_scaling.high_freq_factor", 2.0, "rope_scaling.high_freq_factor 2.0: megatron-core"),
    ("llama-3.1-8b", "rope_scaling.attention_factor", 1.0, "rope_scaling.attention_factor: a field aceso's import "
                                                           "does not know for llama3 RoPE scaling"),
    ("llama-3.1-8b", "attention_bias", True, "attention_bias true: HF biases the q, k, v and output projections"),
    ("llama-3.1-8b", "hidden_act", "gelu", "hidden_act \"gelu\": aceso's import reads the SwiGLU MLP"),
    ("llama-3.1-8b", "some_new_field", 1, "some_new_field: a field aceso's import does not know for model_type llama"),
    ("qwen2.5-7b", "use_mrope", True, "use_mrope true: multimodal RoPE"),
    ("mixtral-8x7b", "router_jitter_noise", 0.1, "router_jitter_noise 0.1: noise on the router's input"),
    ("glm-4.5", "topk_method", "greedy", "topk_method 'greedy' is not one aceso's import knows (noaux_tc)"),
    ("glm-4.5", "partial_rotary_factor", 1.5, "partial_rotary_factor is 1.5; it must be a fraction in (0, 1]"),
])
def test_unknown_values_are_refused_naming_the_field(name, path, value, needle):
    with pytest.raises(AcesoError) as e:
        spec(name, _edit(name, path, value) if value is not None else
             {k: v for k, v in config(name).items() if k != path})
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_yarn_on_standard_attention_is_kept():
    """YaRN on standard attention (Qwen3's long-context recipe) is megatron-core's position_embedding_type yarn:
    kept with the config's original length; Megatron-LM core_v0.19.0 builds it
    (tests/unit/test_yarn_standard_attention.py)."""
    cfg = {**config("qwen3-8b"), "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 32768}}
    m = spec("qwen3-8b", cfg)
    assert m.rope_scaling.model_dump(exclude_none=True) == {"type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 32768}


def test_transformers5_rope_parameters():
    """transformers 5 writes rope_parameters (theta and scaling together) instead of rope_theta / rope_scaling."""
    cfg = {k: v for k, v in config("llama-3.1-8b").items() if k not in ("rope_scaling", "rope_theta")}
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    m = spec("llama-3.1-8b", cfg)
    assert (m.rotary_base, m.rope_scaling.type, m.rope_scaling.factor) == (500000.0, "llama3", 8.0)


# ----- exported, and read back -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", IMPORTED)
def test_megatron_lm_export_reads_back_the_same_model(name):
    """Every kept field is in the exported Megatron-LM flags: importing them gives the spec back (the name aside)."""
    from search.spec.cluster import parse_cluster
    from search.megatron import megatron_config
    from search.megatron.importer import read_megatron
    from search.megatron.script import args_line
    from search.spec.plan import uniform_plan

    m = spec(name).model_copy(update={"num_layers": 4 if name not in ("deepseek-v3", "glm-4.5") else 5})
    if m.moe is not None and isinstance(m.moe.moe_layer_freq, list):
        pytest.skip("a per-layer MoE pattern")
    plan = uniform_plan(m, 1, 1, 8, 8, 64, cluster=parse_cluster("1x8-h100"))
    back = read_megatron(args_line(megatron_config(plan)), world_size=8).plan.model
    skip = {"name", "make_vocab_size_divisible_by", "params_dtype", "attention_dropout", "hidden_dropout",
            "aceso_db_key", "nominal_params_b"}
    a, b = m.model_dump(exclude=skip), back.model_dump(exclude=skip)
    if m.moe is not None:          # the run's router settings are the plan's, not the spec's
        for d in (a, b):
            d["moe"].pop("moe_router_force_load_balancing")
    assert {k: (a[k], b[k]) for k in a if a[k] != b[k]} == {}


def test_bridge_export_carries_the_fields():
    from search.spec.cluster import parse_cluster
    from search.megatron import megatron_config
    from search.megatron.names import bridge_fields
    from search.spec.plan import uniform_plan

    fields = {}
    for name in ("llama-3.1-8b", "qwen2.5-7b", "glm-4.5", "deepseek-v3"):
        m = spec(name).model_copy(update={"num_layers": 5})
        fields[name] = bridge_fields(megatron_config(uniform_plan(m, 1, 1, 8, 8, 64,
                                                                  cluster=parse_cluster("1x8-h100"))))["model"]
    assert (fields["llama-3.1-8b"]["rope_scaling"], fields["llama-3.1-8b"]["rope_scaling_factor"]) == (True, 8.0)
    assert fields["qwen2.5-7b"]["add_qkv_bias"] is True and fields["qwen2.5-7b"]["layernorm_epsilon"] == 1e-6
    assert fields["glm-4.5"]["rotary_percent"] == 0.5 and fields["glm-4.5"]["moe_router_topk_scaling_factor"] == 2.5
    assert {k: fields["deepseek-v3"][k] for k in ("rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim")} \
        == {"rope_type": "yarn", "rotary_scaling_factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def test_a_moe_config_with_every_layer_dense_is_a_dense_model():
    """Qwen3-MoE with every layer in mlp_only_layers: HF builds dense MLPs of intermediate_size everywhere."""
    cfg = {**config("qwen3-30b-a3b"), "mlp_only_layers": list(range(48))}
    m = spec("qwen3-30b-a3b", cfg)
    assert m.moe is None and m.ffn_hidden_size == 6144


def test_deepseek_router_defaults_are_transformers():
    """transformers' DeepseekV3 router is sigmoid with the score-correction bias: a config without scoring_func /
    topk_method is that router, not a softmax one (aceso read it as softmax without the bias before)."""
    cfg = {k: v for k, v in config("deepseek-v3").items() if k not in ("scoring_func", "topk_method")}
    moe = spec("deepseek-v3", cfg).moe
    assert (moe.moe_router_score_function, moe.moe_router_enable_expert_bias, moe.moe_router_num_groups) == \
        ("sigmoid", True, 8)


def test_mla_yarn_fields_in_the_megatron_block_point_to_rope_scaling():
    """MLATransformerConfig's YaRN fields are not TransformerConfig's (the block refused rope_type with 'did you mean
    pipeline_dtype?'): the message names the spec field that carries them."""
    import pydantic

    from search.spec.model import ModelSpec

    ds = load_model("deepseek-v3")
    with pytest.raises(pydantic.ValidationError, match="megatron.rope_type: an MLATransformerConfig field; set the "
                                                       "spec's rope_scaling"):
        ModelSpec.model_validate({**ds.model_dump(), "megatron": {"rope_type": "yarn"}})


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_an_absent_router_aux_loss_coef_is_transformers_default(name):
    """transformers' Qwen3MoeConfig and MixtralConfig default ``router_aux_loss_coef`` to 0.001 (as Qwen2MoeConfig):
    a config without the key trains with that coefficient, not without the aux loss (aceso read 0.0 before)."""
    cfg = {k: v for k, v in config(name).items() if k != "router_aux_loss_coef"}
    assert spec(name, cfg).moe.moe_aux_loss_coeff == 0.001
