"""MoE layers in the runtime: a stage's expert config, which expert parameters are which, and what is refused.

A stage of an MoE model runs megatron-core 0.16.1's own ``MoELayer`` (router, token dispatcher, experts, shared
expert) at the ``mlp`` place of its MoE layers (``model_specs.builders.gpt_layer_spec``); the architecture comes
from ``builders.moe_kwargs``, the stage's expert shape and the plan's MoE settings from here (``stage_fields``):
``expert_model_parallel_size`` = the stage's ``ep``, ``expert_tensor_parallel_size`` = its ``etp`` (None = tp), the
token dispatcher, and the fast paths ``fast_fields`` picks from the environment (pure, like ``fast_path.choose``):

| setting | CPU | CUDA |
|---|---|---|
| ``grouped_gemm`` | off (``SequentialMLP``: one GEMM per local expert) | TE's grouped experts; refused without TE |
| ``permute_fusion`` | off | TE's fused permute (TE importable) |
| ``shared_expert_overlap`` | off (CUDA streams) | as the plan says (alltoall; flex too on megatron-core 0.18+) |
| ``router_fusion`` | off | TE's fused router kernels (TE importable) |

The router dtype (``moe_router_dtype``), the flex backend and squared ReLU's fused weighted activation
(``use_fused_weighted_squared_relu``, torch code: CPU too) are the plan's everywhere; the model's routing
(capacity factor, padding to capacity, forced balance) comes with the architecture (``builders.moe_kwargs``).

The process groups (EP, ETP, expert-DP, expert TP x EP) are the stage's own (``parallel.layout``); expert
parameters are reduced over expert-DP (``mark_expert_params``: every routed expert parameter, whatever the ep).

What of MoE / MLA / MTP this runtime cannot run yet is the capability table's (``search.targets.runtime_rules``), asked
by the one pre-flight and the runtime's entry check (``aceso_megatron.preflight.refusal``).
"""

from __future__ import annotations

from search.settings.moe_plan import MoEPlanSettings, expert_tp

EXPERTS = ".mlp.experts."   # routed experts in canonical names (not ``.mlp.shared_experts.``)


def settings(plan) -> MoEPlanSettings:
    return plan.moe or MoEPlanSettings()


def fast_fields(cuda: bool, te: bool, s: MoEPlanSettings) -> dict:
    """The MoE fast paths (``TransformerConfig`` fields) for an environment; see the module table."""
    return {"moe_grouped_gemm": cuda and te and s.grouped_gemm,
            "moe_permute_fusion": cuda and te and s.permute_fusion,
            "moe_router_fusion": cuda and te and s.router_fusion,
            "moe_shared_expert_overlap": cuda and s.shared_expert_overlap}


def stage_fields(plan, stage: int, cuda: bool, te: bool) -> dict:
    """``TransformerConfig`` fields of stage ``stage``'s MoE layers (empty for a dense model)."""
    if plan.model.moe is None:
        return {}
    st, s = plan.stages[stage], settings(plan)
    return {"expert_model_parallel_size": st.ep, "expert_tensor_parallel_size": expert_tp(st),
            "moe_token_dispatcher_type": s.token_dispatcher, "moe_flex_dispatcher_backend": s.flex_backend,
            "moe_router_dtype": s.router_dtype, **fast_fields(cuda, te, s),
            **({"use_fused_weighted_squared_relu": True} if s.fused_weighted_squared_relu else {})}


def is_expert(canonical: str) -> bool:
    """A routed expert's parameter (sharded over ETP, spread over EP, reduced over expert-DP)."""
    return EXPERTS in canonical


def global_expert_name(local: str, ep_rank: int, local_experts: int) -> str:
    """``...experts.local_experts.<i>.rest`` on EP rank ``ep_rank`` -> the stock model's ``local_experts.<j>``."""
    head, sep, tail = local.partition(".experts.local_experts.")
    if not sep:
        return local
    i, rest = tail.split(".", 1)
    return f"{head}{sep}{ep_rank * local_experts + int(i)}.{rest}"


def mark_expert_params(chunk) -> None:
    """Every routed expert parameter reduced over expert-DP by megatron-core's DDP (``allreduce`` False), also at
    ep 1 where megatron-core would reduce them over DP: at ep 1 with etp below tp the two groups differ."""
    for name, canon in chunk.canonical_names().items():
        if is_expert(canon):
            chunk.get_parameter(name).allreduce = False

