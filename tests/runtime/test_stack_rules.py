"""The plan's stack rules (``search.settings.stack.refusal``, ``moe_plan.settings_refusal``) against megatron-core 0.16.1's
own ``TransformerConfig``: a combination of CUDA-graph scopes, MoE settings, recompute and CPU offload is refused by
the plan exactly when megatron-core refuses it."""

import warnings

import pydantic
import pytest
import torch

from search.spec.cluster import parse_cluster
from search.settings.fsdp import ActivationOffload
from search.settings.moe_plan import MoEPlanSettings
from search.spec.plan import uniform_plan
from search.settings.stack import CudaGraphs, StackSettings
from tests.unit.test_moe_cost import tiny_moe

CASES = {   # name: (graph scope or None, impl, MoE spec fields, MoEPlanSettings fields, recompute, cpu offload)
    "router + preprocess": (["moe_router", "moe_preprocess"], "transformer_engine", {}, {}, "none", False),
    "attn + router + preprocess": (["attn", "moe_router", "moe_preprocess"], "transformer_engine", {}, {}, "none",
                                   False),
    "moe and moe_router": (["moe", "moe_router"], "transformer_engine", {}, {}, "none", False),
    "preprocess alone": (["moe_preprocess"], "transformer_engine", {}, {}, "none", False),
    "te full_iteration": (["full_iteration"], "transformer_engine", {}, {}, "none", False),
    "local full_iteration, padded": (["full_iteration"], "local",
                                     {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True},
                                     {}, "none", False),
    "moe, dropless": (["moe"], "transformer_engine", {}, {}, "none", False),
    "moe, padded": (["moe"], "transformer_engine",
                    {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}, {}, "none", False),
    "preprocess, alltoall with a capacity": (["moe_router", "moe_preprocess"], "transformer_engine",
                                             {"moe_expert_capacity_factor": 1.0}, {}, "none", False),
    "mlp on an all-MoE model": (["mlp"], "transformer_engine", {}, {}, "none", False),
    "attn with full recompute": (["attn"], "transformer_engine", {}, {}, "full", False),
    "attn with CPU offload": (["attn"], "transformer_engine", {}, {}, "none", True),
    "delay_wgrad without the overlap": (None, None, {}, {"delay_wgrad": True}, "none", False),
}


def _megatron_core_refuses(scope, impl, spec, settings, recompute, offload) -> bool:
    from megatron.core.transformer.transformer_config import TransformerConfig
    kw = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_router_topk=2,
              bf16=True, params_dtype=torch.bfloat16, moe_token_dispatcher_type="alltoall",
              expert_model_parallel_size=1, delay_wgrad_compute=settings.get("delay_wgrad", False),
              moe_expert_capacity_factor=spec.get("moe_expert_capacity_factor"),
              moe_pad_expert_input_to_capacity=spec.get("moe_pad_expert_input_to_capacity", False))
    if scope is not None:
        kw.update(cuda_graph_impl=impl, cuda_graph_scope=list(scope))
    if recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if offload:
        kw.update(cpu_offloading=True, cpu_offloading_num_layers=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            TransformerConfig(**kw)
    except (AssertionError, ValueError):
        return True
    return False


def _we_refuse(scope, impl, spec, settings, recompute, offload) -> bool:
    m = tiny_moe(**spec)
    cl = parse_cluster("1x4-cpu")
    stack = StackSettings(cuda_graphs=CudaGraphs(impl=impl, scope=tuple(scope))) if scope is not None else None
    plan = uniform_plan(m, 1, 1, 4, 4, 8, recompute=recompute, cluster=cl)
    data = plan.model_dump()
    s = data["settings"]
    s["moe"] = MoEPlanSettings(**settings).model_dump()
    s["stack"] = stack.model_dump() if stack is not None else None
    if offload:
        s["activation_offload"] = ActivationOffload(num_layers=1).model_dump()
    try:
        type(plan).model_validate(data)
    except pydantic.ValidationError:
        return True
    return False


@pytest.mark.parametrize("name", list(CASES))
def test_the_plan_refuses_what_megatron_core_refuses(name):
    case = CASES[name]
    assert _we_refuse(*case) == _megatron_core_refuses(*case), name


# Graphs megatron-core's config accepts but whose capture breaks on dropless MoE: the dispatcher and the grouped
# experts synchronize with the host inside the layer (search/settings/stack.py); the plan refuses them, its own rule
BEYOND_CONFIG = {
    "local full_iteration, dropless": (["full_iteration"], "local", {}, {}, "none", False),
    "whole layers, dropless": ([], "transformer_engine", {}, {}, "none", False),
}


@pytest.mark.parametrize("name", list(BEYOND_CONFIG))
def test_the_plan_refuses_graphs_whose_capture_breaks_on_dropless_moe(name):
    case = BEYOND_CONFIG[name]
    assert not _megatron_core_refuses(*case), name       # the config accepts it: the refusal is aceso's own
    assert _we_refuse(*case), name
    padded = {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}
    assert not _we_refuse(case[0], case[1], padded, *case[3:]), name      # drop-and-pad counts live on the host
