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
| ``shared_expert_overlap`` | off (CUDA streams) | as the plan says (alltoall only) |

The process groups (EP, ETP, expert-DP, expert TP x EP) are the stage's own (``parallel.layout``); expert
parameters are reduced over expert-DP (``mark_expert_params``: every routed expert parameter, whatever the ep).

``refusal(env, plan)`` names what this runtime cannot run yet, one line, before any process group exists (MLA and
MTP run: ``model.mtp``, ``patches.mla_mtp_tp_group``; ``mla_mtp_refusal`` keeps what of them does not).
"""

from __future__ import annotations

from search.moe_plan import MoEPlanSettings, expert_tp

EXPERTS = ".mlp.experts."   # routed experts in canonical names (not ``.mlp.shared_experts.``)


def settings(plan) -> MoEPlanSettings:
    return plan.moe or MoEPlanSettings()


def fast_fields(cuda: bool, te: bool, s: MoEPlanSettings) -> dict:
    """The MoE fast paths (``TransformerConfig`` fields) for an environment; see the module table."""
    return {"moe_grouped_gemm": cuda and te and s.grouped_gemm,
            "moe_permute_fusion": cuda and te and s.permute_fusion,
            "moe_shared_expert_overlap": cuda and s.shared_expert_overlap}


def stage_fields(plan, stage: int, cuda: bool, te: bool) -> dict:
    """``TransformerConfig`` fields of stage ``stage``'s MoE layers (empty for a dense model)."""
    if plan.model.moe is None:
        return {}
    st, s = plan.stages[stage], settings(plan)
    return {"expert_model_parallel_size": st.ep, "expert_tensor_parallel_size": expert_tp(st),
            "moe_token_dispatcher_type": s.token_dispatcher, **fast_fields(cuda, te, s)}


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


def mla_mtp_refusal(plan) -> str | None:
    """What of MLA / MTP the runtime does not run (one line), or None: MTP units run unrecomputed (megatron-core's
    MTP recompute is its whole-block ``full`` only), MLA attention units without ``attn_dropout`` (its core
    attention has separate key and value widths)."""
    m = plan.model
    if m.mtp_num_layers:
        last = plan.stages[-1]
        if len(last.chunks) > 1:
            return (f"mtp_num_layers ({m.mtp_num_layers}) with virtual stages ({len(last.chunks)} chunks on the last "
                    "stage): the runtime's MTP block is proven without interleaving only; use one chunk per stage")
        if last.cp > 1:
            return (f"mtp_num_layers ({m.mtp_num_layers}) with cp {last.cp} on the last stage: the runtime's MTP "
                    "block is proven without context parallelism only; use cp 1 there")
    for s, j, ch in plan.chunks_in_order():
        for k, rc in enumerate(ch.recompute):
            unit = m.units[ch.start_unit + k]
            if unit.kind == "mtp" and rc != "none":
                return (f"stages[{s}] unit {ch.start_unit + k} (mtp): recompute {rc}: the runtime runs the MTP "
                        "block without recompute; set it none")
            if unit.kind == "attention" and m.mla is not None and rc == "attn_dropout":
                return (f"stages[{s}] unit {ch.start_unit + k}: attn_dropout with multi-latent attention: the "
                        "runtime's recomputed dropout assumes equal key and value widths; use selective or full")
    return None


def refusal(env, plan) -> str | None:
    """One line naming what of ``plan``'s MoE / MLA / MTP this runtime cannot run (on ``env``; None: what no
    environment runs), or None."""
    m = plan.model
    if (msg := mla_mtp_refusal(plan)) is not None:
        return msg
    if m.moe is None:
        return None
    s = settings(plan)
    if m.add_bias_linear:
        return (f"model {m.name}: add_bias_linear with MoE: megatron-core 0.16.1's expert MLP adds its bias in place "
                "on the output of its TP reduction, which autograd refuses; set add_bias_linear false")
    if m.moe.moe_router_enable_expert_bias:
        return ("moe.moe_router_enable_expert_bias: megatron-core 0.16.1 updates the expert bias over the global "
                "parallel_state groups, which per-stage groups leave unset; set it false")
    if s.overlap_ep_comm:
        return ("moe.overlap_ep_comm: the runtime does not run megatron-core's combined 1F1B EP overlap yet; set "
                "it false")
    if env is None:
        return None
    if s.token_dispatcher == "flex" and not env.cuda:
        return "moe.token_dispatcher flex: DeepEP/HybridEP need CUDA, not available on CPU; use alltoall or allgather"
    if not env.cuda and s.token_dispatcher == "alltoall":
        for i, st in enumerate(plan.stages):
            if expert_tp(st) > 1:
                return (f"stages[{i}].etp ({expert_tp(st)}) with the alltoall dispatcher on CPU: megatron-core "
                        "all-gathers uneven token counts over expert-TP, which gloo cannot; use etp 1 or the "
                        "allgather dispatcher")
    if s.grouped_gemm and env.cuda and not env.te:
        return ("moe.grouped_gemm: megatron-core's grouped experts need transformer-engine, not importable here; "
                "set grouped_gemm false or install transformer-engine")
    return None
