"""Nemotron-3 Super exported to Megatron-Bridge runs from the Nano recipe (``nemotron_3_nano_pretrain_config``,
search/megatron/bridge_hybrid.py ``MOE_RECIPE``): Bridge applies the YAML's ``model`` fields over what that recipe
builds, so every field the recipe sets (or leaves at ``HybridModelProvider``'s default) that Super runs otherwise
must be in the YAML. The YAML, applied over the recipe's values, must give Super's values field by field.

The references, hand-copied with their sources:
- the Nano recipe at Megatron-Bridge v0.6.0 (tag commit 51885cf13): recipes/nemotronh/h100/nemotron_3_nano.py
  ``nemotron_3_nano_pretrain_8gpu_h100_bf16_config`` (the ``HybridModelProvider(...)`` call and the
  ``cfg.model.*`` lines after it), and models/hybrid/hybrid_provider.py's defaults for what it leaves unset
  (``mtp_num_layers`` 0, ``layernorm_epsilon`` 1e-5, ``mamba_chunk_size`` 128; ``mtp_loss_scaling_factor``:
  megatron-core's TransformerConfig 0.1);
- Super: Megatron-LM's Super pre-training release test (tests/functional_tests/test_cases/nemotron/
  nemotron3_super_release_gb200/model_config.yaml, read at 0b2ad8fe70f8) and Megatron-Bridge v0.6.0's own Super
  recipe (recipes/nemotronh/h100/nemotron_3_super.py: ``init_method_std`` 0.014, ``mtp_num_layers`` 2 with
  ``mtp_use_repeated_layer``; its HF config through ``NemotronHBridge.provider_bridge``: ``moe_router_dtype`` fp32,
  ``mtp_loss_scaling_factor`` 0.3, one router group)."""

from __future__ import annotations

import pytest

from search.megatron.bridge_hybrid import finalized_pattern, overrides
from search.settings.moe_plan import MoEPlanSettings
from search.spec.presets import load_model
from tests.hybrid_plans import cut_plan

NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
SUPER_PATTERN = ("MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME")
# field: (the Nano recipe's value, Super's value)
FIELDS = {
    "hybrid_layer_pattern": (NANO_PATTERN, SUPER_PATTERN + "/*E/*E"), "num_layers": (52, 88),
    "hidden_size": (2688, 4096), "mamba_num_heads": (64, 128), "kv_channels": (128, 128),
    "mamba_state_dim": (128, 128), "ffn_hidden_size": (1856, 2688), "num_attention_heads": (32, 32),
    "mamba_head_dim": (64, 64), "seq_length": (8192, 8192), "num_query_groups": (2, 2),
    "num_moe_experts": (128, 512), "moe_ffn_hidden_size": (1856, 2688),
    "moe_shared_expert_intermediate_size": (3712, 5376), "moe_router_topk": (6, 22),
    "moe_router_topk_scaling_factor": (2.5, 5.0), "moe_router_num_groups": (1, 1), "moe_router_group_topk": (1, 1),
    "mamba_num_groups": (8, 8), "make_vocab_size_divisible_by": (128, 128), "moe_aux_loss_coeff": (0.0001, 0.0001),
    "moe_router_score_function": ("sigmoid", "sigmoid"), "moe_router_enable_expert_bias": (True, True),
    "moe_router_load_balancing_type": ("seq_aux_loss", "seq_aux_loss"), "moe_router_dtype": ("fp32", "fp32"),
    "init_method_std": (0.0173, 0.014),                         # Nano: cfg.model.init_method_std = 0.0173
    # HybridModelProvider / TransformerConfig defaults the recipe leaves
    "mtp_num_layers": (0, 2), "mtp_hybrid_override_pattern": (None, "*E"), "mtp_use_repeated_layer": (False, True),
    "mtp_loss_scaling_factor": (0.1, 0.3), "layernorm_epsilon": (1e-5, 1e-5), "moe_latent_size": (None, 1024),
    "share_embeddings_and_output_weights": (False, False), "add_bias_linear": (False, False),
    "position_embedding_type": ("none", "none"), "normalization": ("RMSNorm", "RMSNorm"),
    "hidden_dropout": (0.0, 0.0), "attention_dropout": (0.0, 0.0),
}
NANO_RECIPE = {k: v[0] for k, v in FIELDS.items()}
SUPER = {k: v[1] for k, v in FIELDS.items()}
# megatron-core routes without groups when moe_router_num_groups is None or 1 (TopKRouter: group-limited only with
# more than one group), so the YAML's null is the recipe's 1
NO_GROUPS = {"moe_router_num_groups", "moe_router_group_topk"}


def _applied(plan) -> dict:
    """The recipe's model fields with the YAML's ``model`` section applied, as Bridge's override does; the pattern as
    ``HybridModelProvider.finalize`` makes it (the MTP depths appended)."""
    recipe, _, ov = overrides(plan, pipes=True)
    assert recipe == "nemotron_3_nano_pretrain_config"
    model = {**NANO_RECIPE, **ov["model"]}
    model["hybrid_layer_pattern"] = finalized_pattern(model).replace("|", "")
    for k in NO_GROUPS:
        model[k] = model[k] or 1
    return model


def _super_plan(router_dtype="fp32"):
    sup = load_model("nemotron-3-super")
    return cut_plan(sup, [0, 40, sup.num_units], 2, tp=2, sp=True, gbs=16,
                    settings={"moe": MoEPlanSettings(router_dtype=router_dtype)})


def test_the_recipe_differs_from_super_where_the_yaml_must_speak():
    """The fields this file checks are the ones where Nano's recipe would run something else than Super."""
    differ = {k for k in SUPER if SUPER[k] != NANO_RECIPE[k]}
    assert {"init_method_std", "mtp_loss_scaling_factor", "moe_latent_size", "moe_router_topk_scaling_factor",
            "mtp_num_layers"} <= differ


@pytest.mark.parametrize("field", sorted(SUPER))
def test_super_yaml_over_the_nano_recipe_is_super(field):
    assert _applied(_super_plan())[field] == SUPER[field]


def test_the_router_dtype_is_the_plans_not_the_recipes():
    """A plan priced with the router in the model's dtype (router_dtype None) states null, so the recipe's fp32 does
    not run unpriced; NVIDIA's runs (fp32) are the plan's fp32."""
    assert _applied(_super_plan(None))["moe_router_dtype"] is None
    assert _applied(_super_plan("fp32"))["moe_router_dtype"] == "fp32"


# ----- GPT models: the Qwen3 recipe runs every MoE model without MLA (search/megatron/bridge.py recipe_for) ---------
# Megatron-Bridge's Qwen3MoEModelProvider (removed in 4da8a6d93; its parent: layernorm_epsilon 1e-6), and v0.6.0's
# recipe builds Qwen3-30B-A3B from its config.json (rms_norm_eps 1e-6): the recipe's epsilon is 1e-6
QWEN3_RECIPE_EPSILON = 1e-6


@pytest.mark.parametrize("name, hf", [("mixtral-8x7b", "mixtral-8x7b"), ("qwen3-30b-a3b", "qwen3-30b-a3b")])
def test_the_norm_epsilon_is_the_models_config_over_the_qwen3_recipe(name, hf):
    """Mixtral-8x7B's config.json says rms_norm_eps 1e-5: under the Qwen3 recipe the YAML must state it."""
    import json
    from pathlib import Path

    from search.megatron import megatron_config
    from search.megatron.bridge import overrides as gpt_overrides
    from search.spec.cluster import parse_cluster
    from search.spec.plan import uniform_plan
    cfg = json.loads((Path(__file__).parent / "data" / "hf" / hf / "config.json").read_text())
    m = load_model(name).model_copy(update={"num_layers": 8})
    plan = uniform_plan(m, 2, 2, 1, 1, 8, cluster=parse_cluster("1x4-h100"), sequence_parallel=True)
    recipe, ov = gpt_overrides(megatron_config(plan))
    assert recipe == "qwen3_30b_a3b_pretrain_config"
    assert {"layernorm_epsilon": QWEN3_RECIPE_EPSILON, **ov["model"]}["layernorm_epsilon"] == cfg["rms_norm_eps"]
