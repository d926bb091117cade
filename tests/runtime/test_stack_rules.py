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


# ----- the fine-grained offload with CUDA graphs and MoE recompute, keyed on the release (stack.offload_graphs_refusal,
# stack.moe_recompute_offload_refusal): the plan, priced at the installed megatron-core's release, refuses exactly what
# its TransformerConfig refuses (0.16.1 on Python 3.11: nothing; 0.19.x on 3.12: its rules)
PADDED = {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}
OFFLOAD_CASES = {   # name: (graph scope, impl, MoE spec fields, offloaded modules)
    "te attn + router, core_attn": (["attn", "moe_router", "moe_preprocess"], "transformer_engine", {},
                                    ["core_attn", "attn_proj"]),
    "te attn + router, experts": (["attn", "moe_router", "moe_preprocess"], "transformer_engine", {},
                                  ["expert_fc1", "moe_act"]),
    "te moe scope, experts": (["attn", "moe"], "transformer_engine", PADDED, ["expert_fc1"]),
    "local attn, core_attn": (["attn"], "local", {}, ["core_attn"]),
    "local router, experts": (["moe_router", "moe_preprocess"], "local", {}, ["moe_act"]),
    "local router, experts and core_attn": (["moe_router", "moe_preprocess"], "local", {}, ["core_attn", "moe_act"]),
    "local whole layers, experts": ([], "local", PADDED, ["moe_act"]),
    "local full_iteration, core_attn": (["full_iteration"], "local", PADDED, ["core_attn"]),
}


def _installed_core() -> tuple[int, int]:
    from megatron.core import package_info
    return package_info.MAJOR, package_info.MINOR


def _config_refuses(kw) -> bool:
    from megatron.core.transformer.transformer_config import TransformerConfig
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_router_topk=2, bf16=True,
                params_dtype=torch.bfloat16, moe_token_dispatcher_type="alltoall", expert_model_parallel_size=1,
                moe_grouped_gemm=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            TransformerConfig(**base, **kw)
    except (AssertionError, ValueError):
        return True
    return False


@pytest.mark.parametrize("name", list(OFFLOAD_CASES))
def test_the_plan_refuses_the_offload_with_graphs_as_its_megatron_core_does(name):
    from search.settings.stack import FineGrainedOffload
    scope, impl, spec, modules = OFFLOAD_CASES[name]
    core = _installed_core()
    theirs = _config_refuses(dict(cuda_graph_impl=impl, cuda_graph_scope=list(scope), **spec,
                                  fine_grained_activation_offloading=True, offload_modules=list(modules)))
    plan = uniform_plan(tiny_moe(**spec), 1, 1, 4, 4, 8, cluster=parse_cluster("1x4-cpu"))
    data = plan.model_dump()
    data["settings"]["release"] = "%d.%d" % core
    data["settings"]["stack"] = StackSettings(cuda_graphs=CudaGraphs(impl=impl, scope=tuple(scope)),
                                              offload=FineGrainedOffload(modules=tuple(modules))).model_dump()
    try:
        type(plan).model_validate(data)
        ours = False
    except pydantic.ValidationError:
        ours = True
    assert ours == theirs, (name, core)
    if core < (0, 18):       # 0.16 / 0.17 state no rule for the two together
        assert not theirs, name


@pytest.mark.parametrize("recompute", [["moe"], ["moe_act"], ["core_attn", "moe"]])
@pytest.mark.parametrize("modules", [["expert_fc1"], ["moe_act"], ["core_attn"]])
def test_moe_recompute_with_expert_offload_is_refused_as_megatron_core_does(recompute, modules):
    from search.settings.stack import moe_recompute_offload_refusal
    theirs = _config_refuses(dict(recompute_granularity="selective", recompute_modules=list(recompute),
                                  fine_grained_activation_offloading=True, offload_modules=list(modules)))
    ours = moe_recompute_offload_refusal(recompute, modules, _installed_core())
    assert (ours is not None) == theirs
