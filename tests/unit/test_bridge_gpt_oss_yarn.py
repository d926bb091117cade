"""GPT-OSS on Megatron-Bridge: the export writes Bridge's own GPT-OSS recipe, whose provider runs GPT-OSS's YaRN as
transformers does, so a model with YaRN on standard attention is exported there instead of refused.

The reference is Megatron-Bridge v0.3.1's source (hand-copied): ``recipes/gpt_oss/gpt_oss.py:25, 144``
(``gpt_oss_20b_pretrain_config``, ``gpt_oss_120b_pretrain_config``) build the provider from the HF config
(``gpt_oss_bridge.py:89`` activation_func quick_gelu; ``:101-105`` yarn_rotary_scaling_factor 32,
yarn_original_max_position_embeddings 4096, yarn_beta_fast 32, yarn_beta_slow 1, yarn_correction_range_round_to_int
False; ``conversion/model_bridge.py:387-396`` yarn_mscale / yarn_mscale_all_dim from rope_scaling, None for GPT-OSS),
and megatron-core 0.16.1 reads None as the attention factor ``0.1 ln(factor) + 1``
(``yarn_rotary_pos_embedding._yarn_get_concentration_factor``), transformers' ``_compute_yarn_parameters``' for
GPT-OSS. A YAML override of a yarn_* attribute applies on that provider (``omegaconf_utils._apply_overrides``:
what ``hasattr`` finds) and is skipped on the Llama / Qwen3 ones. Before, every YaRN model was refused for Bridge, and
GPT-OSS's plain-RoPE presets were written for the Qwen3-MoE recipe, whose SiLU activation (a callable no YAML
sets) Bridge then trained instead of quick GEGLU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from search.cli.import_hf import hf_to_spec
from search.megatron import megatron_config
from search.megatron.bridge import overrides
from search.spec.cluster import parse_cluster
from search.spec.plan import uniform_plan
from search.spec.presets import load_model
from search.targets.capabilities import plan_refusal

HF = Path(__file__).parent / "data" / "hf" / "gpt-oss-20b" / "config.json"
# GPTOSSBridge.provider_bridge (v0.3.1 gpt_oss_bridge.py:101-105)
BRIDGE_YARN = {"yarn_rotary_scaling_factor": 32.0, "yarn_original_max_position_embeddings": 4096,
               "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_correction_range_round_to_int": False}


def _plan(m):
    return uniform_plan(m.model_copy(update={"num_layers": 4}), 1, 1, 8, 8, 64, cluster=parse_cluster("1x8-h100"))


def _concentration(factor, mscale, mscale_all_dim):
    """megatron-core's _yarn_get_concentration_factor (None: the plain attention factor)."""
    def get(s, m=1.0):
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0
    if mscale is None or mscale_all_dim is None:
        return get(factor)
    return get(factor, mscale) / get(factor, mscale_all_dim)


def test_gpt_oss_yarn_is_exported_for_the_gpt_oss_recipe():
    m = hf_to_spec(json.loads(HF.read_text()), source="gpt-oss-20b")
    assert m.rope_scaling.type == "yarn" and m.activation == "quick_geglu"
    plan = _plan(m)
    assert plan_refusal(plan, "megatron-bridge") is None
    recipe, ov = overrides(megatron_config(plan))
    model = ov["model"]
    assert recipe == "gpt_oss_20b_pretrain_config"
    assert model["position_embedding_type"] == "yarn"
    assert {k: model[k] for k in BRIDGE_YARN} == BRIDGE_YARN
    # the attention factor the written mscales give is the one Bridge's None runs (transformers': 0.1 ln 32 + 1)
    assert _concentration(32.0, model["yarn_mscale"], model["yarn_mscale_all_dim"]) == \
        pytest.approx(_concentration(32.0, None, None)) == pytest.approx(0.1 * math.log(32) + 1)


def test_plain_rope_presets_run_quick_geglu_on_the_gpt_oss_recipe():
    """The gpt-oss presets (plain RoPE, as the published Megatron-LM rows) take the GPT-OSS recipe for its activation,
    and state position_embedding_type rope so the recipe's yarn does not stand in."""
    for name, recipe in (("gpt-oss-20b", "gpt_oss_20b_pretrain_config"),
                         ("gpt-oss-120b", "gpt_oss_120b_pretrain_config")):
        got, ov = overrides(megatron_config(_plan(load_model(name))))
        assert got == recipe and ov["model"]["position_embedding_type"] == "rope"
        assert not any(k.startswith("yarn_") for k in ov["model"])


def test_the_recipes_gpt_oss_layer_never_stands_in():
    """A quick-GEGLU model without windows or sinks states megatron-core's defaults over the provider's (128, 0)
    window, alternate-layer skip, learnable softmax, offset 1 and clamp 7."""
    m = load_model("gpt-oss-20b").model_copy(update={"window_size": None, "window_attn_skip_freq": None,
                                                      "softmax_type": None, "glu_linear_offset": None,
                                                      "activation_func_clamp_value": None})
    model = overrides(megatron_config(_plan(m)))[1]["model"]
    assert {k: model[k] for k in ("window_size", "window_attn_skip_freq", "softmax_type", "glu_linear_offset",
                                  "activation_func_clamp_value")} == \
        {"window_size": None, "window_attn_skip_freq": None, "softmax_type": "vanilla", "glu_linear_offset": 0.0,
         "activation_func_clamp_value": None}


def test_yarn_on_another_recipe_stays_refused():
    """Qwen3-MoE with YaRN: the Qwen3 recipe's provider has no yarn_* attribute, Bridge would skip them."""
    yarn = hf_to_spec(json.loads(HF.read_text()), source="gpt-oss-20b").rope_scaling
    plan = _plan(load_model("qwen3-30b-a3b").model_copy(update={"rope_scaling": yarn}))
    why = plan_refusal(plan, "megatron-bridge")
    assert why is not None and "only the GPT-OSS recipes' provider holds the yarn_* fields" in why and "\n" not in why
