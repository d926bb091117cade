"""The MoE part of the plan contract (schema version 3): each stage's expert shape and the plan's MoE settings.

**Expert shape (MoE parallel folding).** megatron-core lays the expert groups of a stage over the same
``tp x cp x dp`` GPUs as its attention groups, folded differently: ``etp x ep x edp`` (Liu et al., "MoE Parallel
Folding", arXiv 2504.14960; megatron-core 0.16.1 ``parallel_state.initialize_model_parallel``, whose expert
``RankGenerator`` orders ranks ``tp-ep-dp`` with the expert TP fastest). So inside a stage the ETP groups are blocks
of ``etp`` adjacent ranks, the EP groups are strided by ``etp``, and expert-DP groups by ``etp x ep``. A stage's
``ep`` and ``etp`` are ``StageSpec`` fields (``etp`` None = the stage's ``tp``, megatron-core's default for
``expert_tensor_parallel_size``); ``edp = num_gpus / (etp x ep)``.

**Rules** (``check_expert_shape``; one line each, naming the field and the fix), from megatron-core 0.16.1:
- ``etp x ep`` divides the stage's GPUs (``parallel_state``: "world_size is not divisible by
  expert_tensor_model_pipeline_parallel size");
- ``ep`` divides ``num_experts`` (each EP rank holds ``num_experts / ep`` local experts: ``MoELayer``);
- ``etp`` divides ``moe_ffn_hidden_size`` (and the shared expert's width: both are column/row-parallel over ETP);
- with linear biases, ``etp`` is 1 ("Bias in Moe is only supported when ETP==1", ``TransformerConfig``);
- attention ``tp > 1`` needs ``sequence_parallel`` (``MoELayer.forward`` raises during training otherwise);
- a dense model keeps ``ep`` 1 and no ``etp``.

**Plan settings** (``MoEPlanSettings``, the plan's ``moe`` field; None on an MoE model = the defaults): the token
dispatcher, grouped GEMM, permute fusion and the two communication overlaps megatron-core 0.16.1 has
(``moe_shared_expert_overlap``: alltoall only; ``overlap_moe_expert_parallel_comm``: ep > 1, alltoall or flex,
no full recompute, virtual stages when pp > 1, a bf16 / fp16 model), the EP overlap's delayed weight gradients
(``delay_wgrad_compute``: needs the overlap and grouped GEMM), the router's dtype (``moe_router_dtype``) and fused
kernels (``moe_router_fusion``); and megatron-core 0.19's per-rank capacity (``moe_expert_rank_capacity_factor``:
the HybridEP backend only) with paged stashing of the routed experts' activations (``moe_paged_stash``: needs the
capacity). ``search/costmodel/stack_cost.py`` prices each.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

Dispatcher = Literal["alltoall", "allgather", "flex"]


def drop_defaults(out, defaults: dict):
    """A model's dump without the fields at their ``defaults`` (fields added later: older dumps and plan digests stay
    as they were)."""
    if isinstance(out, dict):
        for name, value in defaults.items():
            if name in out and (out[name] is value or isinstance(value, float) and type(out[name]) is float
                                and out[name] == value):        # a float by value; None / bools by identity
                del out[name]
    return out

FlexBackend = Literal["deepep", "hybridep"]


class MoEPlanSettings(BaseModel):
    """How the plan's MoE layers run (megatron-core ``TransformerConfig`` fields of the same meaning)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    token_dispatcher: Dispatcher = Field(
        "alltoall", description="Token dispatcher (moe_token_dispatcher_type): alltoall (published runs), "
        "allgather, or flex (DeepEP / HybridEP; GPU only).")
    flex_backend: FlexBackend = Field(
        "deepep", description="The flex dispatcher's backend (moe_flex_dispatcher_backend): deepep (DeepEP, "
        "Megatron-LM's default) or hybridep (HybridEP, NVLink domains such as NVL72 racks); flex only.")
    grouped_gemm: bool = Field(True, description="All local experts in one grouped GEMM (moe_grouped_gemm; "
                               "transformer-engine GroupedLinear on GPU); off: one GEMM per expert (SequentialMLP).")
    permute_fusion: bool = Field(True, description="Fused token permute/unpermute kernels (moe_permute_fusion; "
                                 "transformer-engine on GPU).")
    shared_expert_overlap: bool = Field(False, description="The shared expert runs concurrently with the dispatch "
                                        "(moe_shared_expert_overlap; alltoall, and flex from megatron-core 0.18: "
                                        "shared_overlap_dispatchers).")
    overlap_ep_comm: bool = Field(False, description="Dispatch/combine all-to-all overlapped with another "
                                  "micro-batch's compute (overlap_moe_expert_parallel_comm): needs ep > 1, the "
                                  "alltoall or flex dispatcher, no full recompute, virtual stages when pp > 1.")
    delay_wgrad: bool = Field(False, description="Under overlap_ep_comm, the weight-gradient GEMMs run after the "
                              "next communication is launched (delay_wgrad_compute); needs overlap_ep_comm.")
    router_dtype: Literal["fp32", "fp64"] | None = Field(None, description="The router's gating GEMM and scores in "
                                                         "this dtype (moe_router_dtype); None: the model's.")
    router_fusion: bool = Field(False, description="The router's score / top-k / aux-loss steps in fused kernels "
                                "(moe_router_fusion; transformer-engine).")
    rank_capacity_factor: float | None = Field(None, gt=0, le=1e3, description="megatron-core 0.19: each EP "
                                               "rank's token budget over the even share (moe_expert_rank_capacity_"
                                               "factor; flex hybridep only): the dispatch needs no host copy.")
    paged_stash: bool = Field(False, description="megatron-core 0.19: the routed experts' activations in a paged "
                              "buffer sized by the average tokens, not the capacity (moe_paged_stash); needs "
                              "rank_capacity_factor.")
    hybridep_num_sms: Literal[16, 32] | None = Field(
        None, description="SMs of HybridEP's dispatch / combine kernels (moe_hybridep_num_sms; megatron-core 0.19: "
        "moe_flex_dispatcher_num_sms); flex hybridep only. 16 and 32: HybridEP's published GB200 NVL72 rates "
        "(costmodel/moe_primitives.py); None: the release's default as its calibration prices it.")
    fused_weighted_squared_relu: bool = Field(
        False, description="Squared-ReLU experts: the probs-weighted activation in one fused function "
        "(use_fused_weighted_squared_relu; Megatron-Bridge's Nemotron-3 recipes): it keeps its input and the probs, "
        "not the activation output the unfused multiply saves.")

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        """Without ``fused_weighted_squared_relu`` when off and ``hybridep_num_sms`` when unset: plans without them
        dump (and digest) as before."""
        return drop_defaults(handler(self), {"fused_weighted_squared_relu": False, "hybridep_num_sms": None})


def dispatcher_settings(model, dispatcher: str, base: MoEPlanSettings | None = None) -> MoEPlanSettings:
    """``base`` (None: the defaults) under ``dispatcher``; flex on HybridEP where the experts' input is padded to
    capacity (megatron-core pads with HybridEP only), else on ``base``'s backend; HybridEP's SM count kept on HybridEP
    only."""
    base = base or MoEPlanSettings()
    backend = ("hybridep" if model.moe.moe_pad_expert_input_to_capacity else base.flex_backend) \
        if dispatcher == "flex" else "deepep"
    sms = base.hybridep_num_sms if dispatcher == "flex" and backend == "hybridep" else None   # HybridEP's only
    return base.model_copy(update={"token_dispatcher": dispatcher, "flex_backend": backend, "hybridep_num_sms": sms})


def expert_tp(stage) -> int:
    """The stage's expert tensor-parallel degree (``etp``; None = its attention ``tp``)."""
    return stage.tp if stage.etp is None else stage.etp


def expert_dp(stage) -> int:
    """The stage's expert data-parallel degree: its GPUs over ``etp x ep``."""
    return stage.num_gpus // (expert_tp(stage) * stage.ep)


def has_expert_shape(stage) -> bool:
    """Whether the stage says anything about experts (``ep`` above 1 or an explicit ``etp``)."""
    return stage.ep > 1 or stage.etp is not None


def expert_shape_text(stage) -> str:
    """``ep4 etp1`` (empty for a stage without an expert shape): appended to ``StageSpec.shape_text``."""
    return f"ep{stage.ep} etp{expert_tp(stage)}" if has_expert_shape(stage) else ""


def check_expert_shape(model, i: int, stage) -> None:
    """megatron-core 0.16.1's rules for stage ``i``'s expert shape on ``model`` (ValueError, one line)."""
    at = f"stages[{i}]"
    moe = model.moe
    if moe is None:
        if has_expert_shape(stage):
            what = f"ep ({stage.ep})" if stage.ep > 1 else f"etp ({stage.etp})"
            raise ValueError(f"{at}.{what}: the model {model.name} has no experts; use ep 1 and no etp")
        return
    etp, ep = expert_tp(stage), stage.ep
    if stage.num_gpus % (etp * ep):
        raise ValueError(f"{at}: etp ({etp}) x ep ({ep}) must divide the stage's num_gpus ({stage.num_gpus}) "
                         "(the expert groups fold over the same GPUs as tp x cp x dp); change ep or etp")
    if moe.num_experts % ep:
        raise ValueError(f"{at}.ep ({ep}) must divide num_experts ({moe.num_experts}); use an ep that divides it")
    widths = [("moe_ffn_hidden_size", moe.moe_ffn_hidden_size)]
    if moe.moe_shared_expert_intermediate_size:
        widths.append(("moe_shared_expert_intermediate_size", moe.moe_shared_expert_intermediate_size))
    for name, width in widths:
        if width % etp:
            raise ValueError(f"{at}: etp ({etp}) must divide {name} ({width}); use an etp that divides it")
    if model.add_bias_linear and etp > 1:
        raise ValueError(f"{at}: etp ({etp}) with linear biases: megatron-core supports MoE biases only with "
                         "etp 1; set etp 1")
    if stage.tp > 1 and not stage.sequence_parallel:
        raise ValueError(f"{at}: tp ({stage.tp}) on an MoE model needs sequence_parallel (megatron-core's "
                         "MoELayer refuses MoE + TP without it in training); turn sequence_parallel on")


def check_moe_settings(plan) -> None:
    """The plan-wide MoE settings against the model and stages (ValueError, one line)."""
    s = plan.moe
    if s is None:
        return
    if plan.model.moe is None:
        raise ValueError(f"moe: the model {plan.model.name} has no experts; remove the plan's moe block")
    if s.flex_backend != "deepep" and s.token_dispatcher != "flex":
        raise ValueError(f"moe.flex_backend {s.flex_backend} is the flex dispatcher's backend (token_dispatcher is "
                         f"{s.token_dispatcher}); set token_dispatcher flex or flex_backend deepep")
    if (s.token_dispatcher == "flex" and s.flex_backend == "deepep"
            and plan.model.moe.moe_pad_expert_input_to_capacity):
        raise ValueError("moe.flex_backend deepep with the model's moe_pad_expert_input_to_capacity: megatron-core "
                         "0.16.1 pads expert input only with the hybridep backend (TransformerConfig raises); use "
                         "flex_backend hybridep or another dispatcher")
    msg = settings_refusal(s, plan.model)
    if msg:
        raise ValueError(msg)
    if s.shared_expert_overlap:
        from search.settings.releases import megatron_core
        msg = shared_overlap_refusal(s, megatron_core(plan.settings.release))
        if msg:
            raise ValueError(msg)
        if not plan.model.moe.moe_shared_expert_intermediate_size:
            raise ValueError("moe.shared_expert_overlap: the model has no shared expert; turn the overlap off")
    msg = overlap_ep_refusal(s, plan.num_stages, plan.num_virtual_stages, any(st.ep > 1 for st in plan.stages),
                             any(rc == "full" for st in plan.stages for rc in st.all_recompute))
    if msg:
        raise ValueError(msg)


# megatron-core version -> the dispatchers moe_shared_expert_overlap runs with (TransformerConfig.__post_init__:
# "only works with alltoall token dispatcher" through core_v0.17.1, "alltoall or flex" from core_v0.18.0)
SHARED_OVERLAP_DISPATCHERS = {(0, 0): ("alltoall",), (0, 18): ("alltoall", "flex")}


def shared_overlap_dispatchers(core: tuple[int, int]) -> tuple[str, ...]:
    """The dispatchers megatron-core ``core`` (major, minor) runs the shared-expert overlap with."""
    return SHARED_OVERLAP_DISPATCHERS[max(v for v in SHARED_OVERLAP_DISPATCHERS if v <= core)]


def shared_overlap_refusal(s: "MoEPlanSettings", core: tuple[int, int]) -> str | None:
    """Why megatron-core ``core`` refuses ``moe_shared_expert_overlap`` with these settings (its dispatcher; the EP
    overlap, which asserts it off in 0.16.1 and 0.19), or None."""
    if not s.shared_expert_overlap:
        return None
    ok = shared_overlap_dispatchers(core)
    if s.token_dispatcher not in ok:
        return (f"moe.shared_expert_overlap works with the {' or '.join(ok)} dispatcher in megatron-core "
                f"{core[0]}.{core[1]} (it is {s.token_dispatcher}); set token_dispatcher {ok[0]} or turn the "
                "overlap off" + ("" if "flex" in ok else " (megatron-core 0.18+ also runs it with flex: state "
                                                           "that release, --megatron-version 0.19 or settings.release "
                                                           "0.19)"))
    if s.overlap_ep_comm:
        return ("moe.shared_expert_overlap with moe.overlap_ep_comm: megatron-core asserts the shared-expert "
                "overlap off under the EP overlap; turn one off")
    return None


def settings_refusal(s: "MoEPlanSettings", model) -> str | None:
    """megatron-core's rules on the delayed weight gradients, the EP overlap's dtype and MTP depth, the per-rank
    capacity and paged stashing (``TransformerConfig.__post_init__``, 0.16.1 and 0.19), or None."""
    if s.delay_wgrad and not s.overlap_ep_comm:
        return ("moe.delay_wgrad needs moe.overlap_ep_comm (megatron-core asserts delay_wgrad_compute only with "
                "overlap_moe_expert_parallel_comm); turn the overlap on or delay_wgrad off")
    if s.delay_wgrad and not s.grouped_gemm:
        return "moe.delay_wgrad needs moe.grouped_gemm (transformer-engine's grouped linear delays it); turn it on"
    if s.overlap_ep_comm and model.params_dtype == "fp32":
        return ("moe.overlap_ep_comm needs a bf16 or fp16 model (megatron-core asserts it); use --bf16 or turn the "
                "overlap off")
    if s.overlap_ep_comm and (model.mtp_num_layers or 0) > 1:
        # core_v0.16.1 transformer_config.py:1889 ... core_v0.19.0 :2709 ("MTP layernum only supports 1" / "MTP
        # supports at most one layer when enabling overlap_moe_expert_parallel_comm")
        return (f"moe.overlap_ep_comm with model.mtp_num_layers {model.mtp_num_layers}: megatron-core asserts at most "
                "one MTP layer with the EP overlap; turn the overlap off")
    if s.hybridep_num_sms is not None and (s.token_dispatcher != "flex" or s.flex_backend != "hybridep"):
        return ("moe.hybridep_num_sms needs the flex dispatcher with the hybridep backend (HybridEP's kernels are the "
                "only ones it sizes); set token_dispatcher flex and flex_backend hybridep, or drop it")
    if s.rank_capacity_factor is not None and (s.token_dispatcher != "flex" or s.flex_backend != "hybridep"):
        return ("moe.rank_capacity_factor needs the flex dispatcher with the hybridep backend (megatron-core 0.19 "
                "raises otherwise); set token_dispatcher flex and flex_backend hybridep, or drop it")
    if s.paged_stash and s.rank_capacity_factor is None:
        return ("moe.paged_stash needs moe.rank_capacity_factor (megatron-core 0.19: no need to page without a "
                "capacity); set it or turn paged_stash off")
    return None


def overlap_ep_refusal(s: "MoEPlanSettings", num_stages: int, num_virtual: int, any_ep: bool,
                       any_full: bool = False) -> str | None:
    """Why megatron-core cannot run ``overlap_ep_comm`` (``--overlap-moe-expert-parallel-comm``) with these
    settings and this structure, or None. The plan check raises it; the search's ``Space.legal`` keeps out the
    structures it names (and the recompute search the full recompute), so a searched plan always validates."""
    if not s.overlap_ep_comm:
        return None
    if s.token_dispatcher == "allgather":
        return ("moe.overlap_ep_comm needs the alltoall or flex dispatcher; change token_dispatcher or turn the "
                "overlap off")
    if not any_ep:
        return "moe.overlap_ep_comm needs ep > 1 on some stage; raise ep or turn the overlap off"
    if any_full:
        return ("moe.overlap_ep_comm cannot run with full recompute (megatron-core refuses it); use none or "
                "selective, or turn the overlap off")
    if num_stages > 1 and num_virtual == 1:
        return ("moe.overlap_ep_comm with pipeline stages needs virtual chunks (megatron-core interleaves the "
                "overlapped micro-batches); use 2+ chunks per stage or turn it off")
    return None


def moe_settings(plan) -> MoEPlanSettings | None:
    """The MoE settings a plan runs with: its own, the defaults for an MoE model, None for a dense one."""
    if plan.model.moe is None:
        return None
    return plan.moe or MoEPlanSettings()
