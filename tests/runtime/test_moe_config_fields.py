"""The runtime's megatron-core ``TransformerConfig`` of an MoE stage holds the plan's routing and MoE settings as
Megatron-LM's config builder makes them from the exported flags (issue 32): padding the expert input to capacity
and forced balance (the spec's ``moe`` fields), the router dtype and the flex backend (the plan's ``moe``). The
runtime popped the padding, never passed forced balance, the router dtype nor the flex backend, so a plan priced
with them ran without them.

References: ``_expected_moe`` (tests/runtime/test_megatron_lm_oracle.py), the config Megatron-LM core_v0.16.1's
``core_transformer_config_from_args`` builds from each case's exported command line (that test runs Megatron-LM's
own code on it where ``ACESO_MEGATRON_LM`` names a checkout); and here, when it does, that oracle itself."""

from __future__ import annotations

import pytest

from aceso_megatron.model.config import stage_config
from aceso_megatron.model.moe import stage_fields
from search.megatron import megatron_config
from tests.megatron_moe_plans import MOE_CASES, moe_case_plan
from tests.runtime.test_megatron_lm_oracle import _expected_moe

# the fields a CPU stage sets as the plan says (the fast paths grouped GEMM / permute fusion / shared-expert overlap
# are off on CPU: aceso_megatron.model.moe's table; the EP overlap is refused by the runtime)
FIELDS = ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
          "moe_router_score_function", "moe_router_num_groups", "moe_router_group_topk",
          "moe_router_enable_expert_bias", "moe_aux_loss_coeff", "moe_router_load_balancing_type",
          "moe_expert_capacity_factor", "moe_router_force_load_balancing", "moe_pad_expert_input_to_capacity",
          "expert_model_parallel_size", "expert_tensor_parallel_size", "moe_token_dispatcher_type",
          "moe_flex_dispatcher_backend")
ROUTED = ["tiny-list-shared-overlap", "tiny-list-ep1-allgather-block", "tiny-list-padded-flex-hybridep",
          "qwen30-cp2-flex", "mixtral-tp2-ep4-etp2-allgather"]


def _runtime_config(plan, stage: int = 0):
    st = plan.stages[stage]
    layers = sum(c.end_unit - c.start_unit for c in st.chunks)  # (a count the config needs; its value is not read)
    return stage_config(plan.model, st.tp, "cpu", max(layers // 2, 1), cp=st.cp,
                        sequence_parallel=st.sequence_parallel, moe=stage_fields(plan, stage, False, False))


@pytest.mark.parametrize("name", ROUTED)
def test_the_runtime_config_holds_the_plans_routing_as_megatron_lm_builds_it(name):
    plan = moe_case_plan(name)
    cfg, want = _runtime_config(plan), _expected_moe(megatron_config(plan))
    assert {f: getattr(cfg, f) for f in FIELDS} == {f: want[f] for f in FIELDS}
    assert cfg.moe_router_dtype == (plan.moe.router_dtype if plan.moe else None)


def test_forced_balance_padding_and_the_router_dtype_reach_the_config():
    """The cases above carry forced balance, a capacity with padding (flex on HybridEP) and, here, an fp32 router."""
    plan = moe_case_plan("tiny-list-padded-flex-hybridep")
    plan = plan.model_copy(update={"moe": plan.moe.model_copy(update={"router_dtype": "fp32"})})
    cfg = _runtime_config(plan)
    assert (cfg.moe_router_force_load_balancing, cfg.moe_pad_expert_input_to_capacity, cfg.moe_expert_capacity_factor,
            cfg.moe_router_dtype, cfg.moe_flex_dispatcher_backend) == (True, True, 1.5, "fp32", "hybridep")


def test_the_runtime_config_equals_megatron_lms_own():
    """Where a Megatron-LM checkout is named, its own config builder on each case's exported line (the oracle)."""
    from tests.runtime.test_megatron_lm_oracle import _oracle
    plans = {n: moe_case_plan(n) for n in ROUTED}
    for (name, plan), got in zip(plans.items(), _oracle(plans, "core_v0.16.1")):
        assert "error" not in got, (name, got)
        cfg = _runtime_config(plan)
        assert {f: getattr(cfg, f) for f in FIELDS} == {f: got["moe"][f] for f in FIELDS}, name


@pytest.mark.parametrize("lb", ["seq_aux_loss", "global_aux_loss"])
def test_the_load_balancing_type_reaches_the_config(lb):
    """DeepSeek-V3's seq_aux_loss (and global_aux_loss) run as the plan says: the runtime built aux_loss from the
    coefficient alone, whatever the type; megatron-core's own TransformerConfig (built by stage_config) takes it."""
    plan = moe_case_plan("tiny-list-shared-overlap")
    moe = plan.model.moe.model_copy(update={"moe_router_load_balancing_type": lb})
    plan = plan.model_copy(update={"model": plan.model.model_copy(update={"moe": moe})})
    cfg = _runtime_config(plan)
    assert (cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff) == (lb, 0.01)
    assert cfg.moe_router_load_balancing_type == _expected_moe(megatron_config(plan))["moe_router_load_balancing_type"]


@pytest.mark.parametrize("name, factor", [("nemotron-3-nano", 2.5), ("kimi-k2", 2.827), ("qwen3-30b-a3b", None)])
def test_the_router_topk_scaling_factor_reaches_the_config(name, factor):
    """The preset's factor (its HF config.json's routed_scaling_factor, tests/unit/test_topk_scaling.py) is the
    stage config's, as Megatron-LM's --moe-router-topk-scaling-factor sets it (None: megatron-core scales nothing)."""
    from search.spec.presets import load_model
    assert stage_config(load_model(name), 1, "cpu", 1).moe_router_topk_scaling_factor == factor
