"""The plan's software-stack switches (``ParallelPlan.stack``): CUDA graphs, fine-grained activation offload, the
cross-entropy fusion; and megatron-core's rules on them.

These do not change which GPU holds what; they change how the same work runs: how much of it the host launches
kernel by kernel (CUDA graphs), where some activations live (offload), which kernels the loss runs. Each is priced
as itself by ``search/costmodel/stack_cost.py`` (named time and memory terms). The MoE-specific switches (the EP
overlap, delayed weight gradients, the router's dtype and fusion, paged stashing) are ``MoEPlanSettings`` fields
(``moe_plan.py``); the optimizer and the software release are ``PlanSettings`` fields (``plan_settings.py``).

**CUDA graphs** (``--cuda-graph-impl local|transformer_engine --cuda-graph-scope S ...``; megatron-core 0.16.1
``TransformerConfig.cuda_graph_impl`` / ``cuda_graph_scope``; 0.18+ call the scope ``cuda_graph_modules``): the
scopes ``attn`` (``TransformerLayer._forward_attention``), ``mlp`` (a dense layer's MLP), ``moe`` (a whole
drop-and-pad MoE layer's MLP), ``moe_router`` (up to the router, with the shared expert when not overlapped),
``moe_preprocess`` (the dispatcher's preprocessing, with ``moe_router``), ``mamba`` (a hybrid model's whole Mamba
layer, below); an empty scope list is the whole layer; ``full_iteration`` (``local`` only) the whole
forward-backward. The rules (``refusal``), one line each, are those of ``TransformerConfig.__post_init__`` (0.16.1):
- ``full_iteration`` only with ``local``;
- whole layers (the empty scope) and ``full_iteration`` not on dropless MoE: megatron-core's config accepts both
  (0.16.1 and 0.19), but the capture breaks: the dispatcher copies the token counts to the host and waits for them
  inside the layer (``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``: ``d2h_event.synchronize()``; the
  grouped experts' ``tokens_per_expert.tolist()``; HybridEP sizes its buffers with a host sync unless 0.19's
  per-rank capacity bounds them, ``moe.rank_capacity_factor``, which is allowed); drop-and-pad counts are host
  tensors (``torch.full`` on the CPU), so padded MoE is captured whole;
- not ``moe`` with ``moe_router``; ``moe_preprocess`` needs ``moe_router``; ``moe`` / ``moe_router`` only on MoE
  models; ``mlp`` needs a dense layer; ``moe`` needs drop-and-pad (capacity factor and padding);
  ``moe_preprocess`` not with the alltoall dispatcher and a capacity factor (its preprocessing then copies to the
  host);
- not with CPU activation offload (``cpu_offloading``);
- full recompute only with ``full_iteration``;
- with the EP overlap (``overlap_moe_expert_parallel_comm``) only ``transformer_engine``, without ``moe`` / ``mlp``.

``mamba`` (megatron-core 0.16.1 ``CudaGraphScope.mamba``, transformer/enums.py:79; 0.17.1 enums.py:70; 0.18 and
0.19.2 ``CudaGraphModule.mamba``, enums.py:73, read from ``--cuda-graph-modules``, ``--cuda-graph-scope`` kept
deprecated) captures the whole ``MambaLayer``: ``transformer_engine`` graphs each layer that
``_layer_is_graphable`` (0.16.1 transformer/cuda_graphs.py:1645; 0.19.2 cuda_graphs.py:2063) finds a
``MambaLayer`` with ``mamba`` in the scope, ``local`` gives it a ``CudaGraphManager``
(``MambaLayer.create_mcore_cudagraph_manager``, 0.16.1 ssm/mamba_layer.py:93, 0.19.2 mamba_layer.py:110; also with
the empty scope), so its forward (``MambaLayer.forward``, 0.16.1 mamba_layer.py:100-146: the norm, the mixer's
in_proj, conv, SSD scan, gated norm and out_proj, the bias-dropout-add) and backward replay as one graph. The graph
keeps the layer's static input, output and output-gradient buffers per micro-batch in flight, as every per-layer
graph (``costmodel/host.py``). It combines with every other scope; ``__post_init__`` (0.16.1
transformer_config.py:1716-1830, 0.19.2 :2460-2575) has no rule of its own for it: those above on every graph
apply (not with CPU offloading, full recompute only under ``full_iteration``), and on a model without Mamba layers
it captures nothing (accepted, priced as nothing). Megatron-Bridge's Nemotron-3 recipes pass it (``attn mamba
moe_router moe_preprocess``; the Nano H100 recipe ``mamba`` alone).

**Fine-grained activation offload** (``--fine-grained-activation-offloading --offload-modules M ...``; 0.19
``--activation-offload-fraction F``): the inputs of the named modules go to host memory after their forward and
come back for their backward, ``F`` of the eligible groups (the earliest; 0.16.1 has no fraction: 1). Rules: not
with ``cpu_offloading``; ``attn_proj`` needs ``core_attn``; the MoE modules need an MoE model. With CUDA graphs
(``offload_graphs_refusal``, keyed on the plan's release: ``releases.megatron_core``): 0.16 and 0.17 state no rule;
core_v0.18.2 ``TransformerConfig.__post_init__`` (transformer_config.py:2351-2372) runs the offload only with
``transformer_engine`` graphs or a ``full_iteration`` one, never the ``moe`` scope ("Token-drop MoE is temporarily
not supported with activation offloading"), and a full-iteration graph needs
``--fine-grained-offloading-max-inflight-offloads`` (default None: refused; aceso neither sets nor prices it);
core_v0.19.0 (:2596-2641) adds ``local`` graphs of named scopes without ``moe`` when only the experts' inputs
(``expert_fc1``, ``moe_act``) are offloaded. With recompute (``moe_recompute_offload_refusal``, 0.19: :1874-1884):
``moe`` in ``--recompute-modules`` (or ``--moe-layer-recompute``) checkpoints the whole MoE forward, so offloading
``expert_fc1`` / ``moe_act`` inside it is refused; no plan field says ``moe`` recompute, so the import checks it
(``megatron/stack_flags.py``). The search offers less than these allow (``planner/fine_offload.graphs_ok``).

**Cross-entropy fusion** (``--cross-entropy-loss-fusion --cross-entropy-fusion-impl native|te``): the loss as one
fused kernel (``te``: transformer-engine's parallel cross-entropy, which keeps no fp32 softmax copy) or
megatron-core's jit-fused steps (``native``: the same passes as unfused, fewer launches).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

GraphScope = Literal["attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba", "full_iteration"]
GRAPH_SCOPES: tuple[str, ...] = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba", "full_iteration")
OffloadModule = Literal["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"]
OFFLOAD_MODULES: tuple[str, ...] = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1",
                                    "moe_act")
MOE_OFFLOAD = frozenset({"expert_fc1", "moe_act"})
OFFLOAD_GRAPHS_SINCE = (0, 18)      # the first megatron-core with rules on CUDA graphs with the fine-grained offload
OFFLOAD_FLAG = "--fine-grained-activation-offloading"
LOCAL_GRAPHS_OFFLOAD_SINCE = (0, 19)    # local graphs with the experts' offload only (MOE_OFFLOAD)
MOE_RECOMPUTE_OFFLOAD_SINCE = (0, 19)   # no expert offload inside a recomputed MoE layer


class CudaGraphs(BaseModel):
    """CUDA graphs of the training step (megatron-core ``cuda_graph_impl`` / ``cuda_graph_scope``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    impl: Literal["local", "transformer_engine"] = Field(description="local (megatron-core's own capture, also "
                                                         "the whole iteration) or transformer_engine (TE's "
                                                         "make_graphed_callables, per layer).")
    scope: tuple[GraphScope, ...] = Field((), description="What is captured: attn, mlp, moe, moe_router, "
                                          "moe_preprocess, mamba per layer, or full_iteration; empty: whole "
                                          "layers.")

    @field_validator("scope", mode="before")
    @classmethod
    def _listed(cls, v):            # a plan file's JSON array (strict mode takes only tuples)
        return tuple(v) if isinstance(v, list) else v

    @property
    def scopes(self) -> frozenset[str]:
        """The captured parts; whole layers (an empty scope) are every part (``host.captured``: ``layer``)."""
        return frozenset(self.scope) if self.scope else frozenset({"attn", "mlp", "moe", "layer"})

    @property
    def label(self) -> str:
        return f"{self.impl}:{'+'.join(self.scope) if self.scope else 'layer'}"


class FineGrainedOffload(BaseModel):
    """Module-level activation offload (megatron-core ``fine_grained_activation_offloading``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    modules: tuple[OffloadModule, ...] = Field(min_length=1, description="Modules whose input is offloaded: "
                                               "attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1, "
                                               "moe_act.")
    fraction: float = Field(1.0, ge=0.0, le=1.0, description="Share of the eligible offload groups offloaded (the "
                            "earliest first; megatron-core 0.19 activation_offload_fraction; 0.16: 1).")

    @field_validator("modules", mode="before")
    @classmethod
    def _listed(cls, v):            # a plan file's JSON array (strict mode takes only tuples)
        return tuple(v) if isinstance(v, list) else v


class StackSettings(BaseModel):
    """The plan's software-stack switches (module docstring); absent: none of them."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    cuda_graphs: CudaGraphs | None = Field(None, description="CUDA graphs (--cuda-graph-impl / --cuda-graph-scope); "
                                           "absent: none.")
    offload: FineGrainedOffload | None = Field(None, description="Fine-grained activation offload "
                                               "(--fine-grained-activation-offloading --offload-modules); absent: "
                                               "none.")
    cross_entropy_fusion: Literal["native", "te"] | None = Field(None, description="--cross-entropy-loss-fusion "
                                                                  "with --cross-entropy-fusion-impl; absent: "
                                                                  "unfused.")

    @property
    def empty(self) -> bool:
        return self.cuda_graphs is None and self.offload is None and self.cross_entropy_fusion is None


def graph_scopes(plan) -> frozenset[str]:
    """The captured parts of the plan's CUDA graphs (empty: none)."""
    s = plan.stack
    return s.cuda_graphs.scopes if s is not None and s.cuda_graphs is not None else frozenset()


def drop_and_pad(moe_spec) -> bool:
    """Whether an MoE spec drops and pads (a capacity factor and ``moe_pad_expert_input_to_capacity``): its token
    counts are host tensors, so the ``moe`` scope and whole-layer / ``full_iteration`` graphs capture it."""
    return moe_spec.moe_expert_capacity_factor is not None and moe_spec.moe_pad_expert_input_to_capacity


def offload_graphs_refusal(impl: str, scope: tuple[str, ...], modules, core: tuple[int, int]) -> str | None:
    """Why megatron-core ``core`` (major, minor) refuses CUDA graphs ``impl`` of ``scope`` (the plan's: empty =
    whole layers, ``full_iteration`` = 0.18's impl of that name) with the fine-grained offload of ``modules``, or
    None (module docstring). One line: the field and the fix."""
    if core < OFFLOAD_GRAPHS_SINCE or not modules:
        return None
    sc = set(scope)
    v = "%d.%d" % core
    if "moe" in sc:
        return (f"stack.cuda_graphs.scope moe (--cuda-graph-scope moe) with stack.offload ({OFFLOAD_FLAG}): "
                f"megatron-core {v} refuses the fine-grained offload with moe-scope graphs ('Token-drop MoE is "
                "temporarily not supported with activation offloading'); use scope moe_router or drop the offload")
    if "full_iteration" in sc:
        return (f"stack.cuda_graphs.scope full_iteration (--cuda-graph-impl full_iteration) with stack.offload "
                f"({OFFLOAD_FLAG}): megatron-core {v} needs --fine-grained-offloading-max-inflight-offloads under a "
                "full-iteration graph, which aceso neither sets nor prices; use impl transformer_engine or drop the "
                "offload")
    if impl != "local":
        return None
    if core < LOCAL_GRAPHS_OFFLOAD_SINCE:
        return (f"stack.cuda_graphs.impl local (--cuda-graph-impl local) with stack.offload ({OFFLOAD_FLAG}): "
                f"megatron-core {v} runs the fine-grained offload only with transformer_engine graphs; use impl "
                "transformer_engine")
    other = [m for m in modules if m not in MOE_OFFLOAD]
    if other:
        return (f"stack.cuda_graphs.impl local (--cuda-graph-impl local) with stack.offload.modules "
                f"{' '.join(other)} (--offload-modules): megatron-core {v} runs local graphs only with the experts' "
                "offload (expert_fc1, moe_act); use impl transformer_engine or offload only expert_fc1 / moe_act")
    if not sc:
        return (f"stack.cuda_graphs.scope empty (whole layers: --cuda-graph-impl local without --cuda-graph-scope) "
                f"with stack.offload ({OFFLOAD_FLAG}): megatron-core {v} refuses whole-layer local graphs with the "
                "offload; name the scopes or use impl transformer_engine")
    return None


def moe_recompute_offload_refusal(recompute_modules, modules, core: tuple[int, int]) -> str | None:
    """Why megatron-core ``core`` refuses selective recompute of ``recompute_modules`` (``--recompute-modules``;
    ``--moe-layer-recompute`` adds ``moe``) with the fine-grained offload of ``modules``, or None (module
    docstring)."""
    inside = [m for m in modules if m in MOE_OFFLOAD]
    if core < MOE_RECOMPUTE_OFFLOAD_SINCE or "moe" not in recompute_modules or not inside:
        return None
    return (f"--recompute-modules moe with --offload-modules {' '.join(inside)}: megatron-core {'%d.%d' % core} "
            "refuses offloading inside a recomputed MoE layer (the checkpoint wraps the whole MoE forward); remove "
            f"moe from --recompute-modules or {' '.join(inside)} from --offload-modules")


def refusal(plan) -> str | None:
    """What of the plan's stack switches the megatron-core of its release refuses (one line: the field and the
    fix), or None: megatron-core 0.16.1's rules, and the offload's with CUDA graphs from 0.18."""
    s = plan.stack
    if s is None:
        return None
    m = plan.model
    moe = plan.moe
    g = s.cuda_graphs
    if g is not None:
        sc = set(g.scope)
        if "full_iteration" in sc and (g.impl != "local" or len(sc) > 1):
            return ("stack.cuda_graphs.scope full_iteration needs impl local and no other scope (megatron-core "
                    "captures the whole iteration with its own implementation only); use impl local alone")
        if {"moe", "moe_router"} <= sc:
            return "stack.cuda_graphs.scope has both moe and moe_router (megatron-core refuses it); keep one"
        if "moe_preprocess" in sc and "moe_router" not in sc:
            return "stack.cuda_graphs.scope moe_preprocess needs moe_router (megatron-core asserts it); add moe_router"
        if sc & {"moe", "moe_router"} and m.moe is None:
            return "stack.cuda_graphs.scope moe / moe_router: the model has no experts; remove them"
        if m.moe is not None:
            if "mlp" in sc and not any(not m.moe.is_moe_layer(i) for i in range(m.num_layers)):
                return ("stack.cuda_graphs.scope mlp: every layer is an MoE layer (mlp graphs capture dense "
                        "layers; megatron-core asserts one exists); remove mlp")
            padded = drop_and_pad(m.moe)
            if "moe" in sc and not padded:
                return ("stack.cuda_graphs.scope moe needs drop-and-pad MoE (a capacity factor and "
                        "moe_pad_expert_input_to_capacity); use moe_router or pad the expert input")
            whole = not sc or "full_iteration" in sc
            if whole and not padded and (moe is None or moe.rank_capacity_factor is None):
                what = "full_iteration (the whole iteration)" if sc else "empty (whole layers)"
                return (f"stack.cuda_graphs.scope {what} on dropless MoE: the dispatcher copies the token counts to "
                        "the host and synchronizes inside the layer, which a CUDA graph cannot capture; use scope "
                        "moe_router moe_preprocess (with attn) or pad the expert input")
            dispatcher = moe.token_dispatcher if moe is not None else "alltoall"
            if "moe_preprocess" in sc and dispatcher == "alltoall" and m.moe.moe_expert_capacity_factor is not None:
                return ("stack.cuda_graphs.scope moe_preprocess with the alltoall dispatcher and a capacity factor: "
                        "its preprocessing copies to the host (megatron-core refuses it); remove moe_preprocess")
        if plan.activation_offload is not None:
            return ("stack.cuda_graphs with activation_offload: megatron-core has no CUDA graphs with CPU "
                    "offloading; remove one")
        full = "full_iteration" in sc
        if not full and any(r == "full" for st in plan.stages for r in st.all_recompute):
            return ("stack.cuda_graphs with full recompute: megatron-core runs full recompute only under a "
                    "full_iteration graph; use selective recompute or scope full_iteration")
        if moe is not None and moe.overlap_ep_comm and (g.impl != "transformer_engine" or sc & {"moe", "mlp"}
                                                        or not sc):
            return ("stack.cuda_graphs with moe.overlap_ep_comm: megatron-core runs the EP overlap only with "
                    "transformer_engine graphs outside moe and mlp; use impl transformer_engine with attn / "
                    "moe_router / moe_preprocess")
    o = s.offload
    if o is not None:
        if plan.activation_offload is not None:
            return ("stack.offload with activation_offload: megatron-core refuses fine-grained offload with CPU "
                    "offloading; keep one")
        if "attn_proj" in o.modules and "core_attn" not in o.modules:
            return ("stack.offload.modules attn_proj needs core_attn (its input is core_attn's output, which "
                    "core_attn's backward needs); add core_attn")
        if MOE_OFFLOAD & set(o.modules) and m.moe is None:
            return "stack.offload.modules expert_fc1 / moe_act: the model has no experts; remove them"
        if moe is not None and moe.paged_stash and MOE_OFFLOAD & set(o.modules):
            return ("stack.offload.modules expert_fc1 / moe_act with moe.paged_stash (paged stashing holds those "
                    "activations; megatron-core refuses both); remove them")
        if g is not None:
            from search.settings.releases import megatron_core
            return offload_graphs_refusal(g.impl, g.scope, o.modules, megatron_core(plan.settings.release))
    return None


def describe(plan) -> str:
    """``graphs transformer_engine:attn+moe_router, offload core_attn (0.5)`` (empty without switches)."""
    s = plan.stack
    if s is None:
        return ""
    parts = []
    if s.cuda_graphs is not None:
        parts.append(f"graphs {s.cuda_graphs.label}")
    if s.offload is not None:
        parts.append(f"offload {' '.join(s.offload.modules)}" + (f" ({s.offload.fraction:g})"
                                                                  if s.offload.fraction < 1 else ""))
    if s.cross_entropy_fusion:
        parts.append(f"ce fusion {s.cross_entropy_fusion}")
    return ", ".join(parts)
