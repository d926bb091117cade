"""Result types shared by every cost model (analytic, profile database, aceso-compat) and the search.

Times are milliseconds, memory is MiB (2^20 bytes; ``_mb`` in python names, ``_mib`` in files). Recompute choices are coded as ints in arrays:
0 = none, 1 = selective, 2 = full, 3 = attn_dropout, 4 = mla_up_proj (``RC[code]`` gives the plan's string; the plan's
``RECOMPUTE_CHOICES`` order). A choice a unit cannot take (``attn_dropout`` on an MLP unit, ``mla_up_proj`` outside MLA attention, or where it frees
nothing: flash attention, no attention dropout) has recompute time ``UNAVAILABLE_MS`` and the ``none`` activations,
so no search picks it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..layers.kind import UNAVAILABLE_MS  # noqa: F401  (a choice a unit cannot take: the kinds set it)
from search.spec.plan import RECOMPUTE_CHOICES

RC: tuple[str, ...] = RECOMPUTE_CHOICES
RC_CODE = {name: i for i, name in enumerate(RC)}
N_RC = len(RC)
ATTN_DROPOUT = RC_CODE["attn_dropout"]
MLA_UP_PROJ = RC_CODE["mla_up_proj"]


# What a cost model can price beyond a v1 plan (``CostModel.features``); the search explores only these.
ALL_FEATURES = frozenset({"sequence_parallel", "context_parallel", "interleaved", "distributed_optimizer",
                          "overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "megatron_fsdp",
                          "activation_offload"})


class Shape(NamedTuple):
    """A stage's parallel shape: ``tp * cp * dp`` GPUs, sequence parallelism on or off, and (MoE models) the expert
    shape folded over the same GPUs: ``ep`` and ``etp`` (0 = the stage's tp; ``search/settings/moe_plan.py``)."""

    tp: int
    dp: int
    cp: int = 1
    sp: bool = False
    ep: int = 1
    etp: int = 0

    @property
    def num_gpus(self) -> int:
        return self.tp * self.cp * self.dp

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        return self.num_gpus // (self.expert_tp * self.ep)

    @classmethod
    def of(cls, shape) -> "Shape":
        """A ``Shape`` from a ``(tp, dp)`` / ``(tp, dp, cp, sp[, ep, etp])`` tuple or a plan's ``StageSpec``."""
        if shape is None or isinstance(shape, Shape):
            return shape
        if hasattr(shape, "tp"):
            return cls(shape.tp, shape.dp, shape.cp, shape.sequence_parallel, getattr(shape, "ep", 1),
                       getattr(shape, "etp", None) or 0)
        return cls(*shape)


class Features(NamedTuple):
    """The cost model's hashable view of the plan's switches (``PlanSettings``, ``plan_settings.py``): what the
    search varies per state and the stage cost reads. ``of_settings`` derives it, ``switches`` gives the
    ``PlanSettings`` fields back (the search's plans)."""

    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    tp_comm_overlap: bool = False
    fsdp: str = ""              # settings.megatron_fsdp's data_parallel_sharding_strategy ("": DDP; search/settings/fsdp.py)
    offload_layers: int = 0     # settings.activation_offload's transformer layers (0: none)
    stack: "StackKey" = None    # settings.stack and Megatron FSDP's main dtypes as priced (None: none; ``StackKey``)

    @classmethod
    def of_settings(cls, s) -> "Features":
        """The view of a ``PlanSettings``."""
        fsdp, off = s.megatron_fsdp, s.activation_offload
        return cls(s.distributed_optimizer, s.overlap_grad_reduce, s.overlap_param_gather, s.tp_comm_overlap,
                   fsdp.data_parallel_sharding_strategy if fsdp else "", off.num_layers if off else 0,
                   StackKey.of_settings(s))

    @classmethod
    def of_plan(cls, plan) -> "Features":
        return cls.of_settings(plan.settings)

    def switches(self) -> dict:
        """The ``PlanSettings`` fields of this view (the inverse of ``of_settings``)."""
        from search.settings.fsdp import ActivationOffload, MegatronFSDP
        sk = self.stack
        fsdp = MegatronFSDP(data_parallel_sharding_strategy=self.fsdp,
                            main_params_dtype=(sk.fsdp_main_params or None) if sk else None,
                            main_grads_dtype=(sk.fsdp_main_grads or None) if sk else None) if self.fsdp else None
        return {"distributed_optimizer": self.distributed_optimizer, "overlap_grad_reduce": self.overlap_grad_reduce,
                "overlap_param_gather": self.overlap_param_gather, "tp_comm_overlap": self.tp_comm_overlap,
                "megatron_fsdp": fsdp, "stack": sk.settings() if sk is not None else None,
                "activation_offload": ActivationOffload(num_layers=self.offload_layers) if self.offload_layers else None}


class TableStack(NamedTuple):
    """The stack switches a unit table depends on: the CUDA-graph scopes (host time, static buffers) and the
    cross-entropy fusion (the loss's kernels)."""

    graphs: frozenset = frozenset()
    ce_fusion: str = ""


class StackKey(NamedTuple):
    """The plan's stack switches as the cost model keys them (``search/settings/stack.py``, ``search/settings/fsdp.py``; hashable):
    the CUDA-graph scopes (``stack.CudaGraphs.scopes``), the fine-grained offload's modules and fraction, the
    cross-entropy fusion, Megatron FSDP's main-params / main-grads dtypes."""

    graphs: frozenset = frozenset()
    offload_modules: tuple = ()
    offload_fraction: float = 0.0
    ce_fusion: str = ""
    fsdp_main_params: str = ""
    fsdp_main_grads: str = ""
    graph_impl: str = ""

    @classmethod
    def of_settings(cls, settings) -> "StackKey | None":
        s, f = settings.stack, settings.megatron_fsdp
        mp = (f.main_params_dtype or "") if f is not None else ""
        mg = (f.main_grads_dtype or "") if f is not None else ""
        if (s is None or s.empty) and not mp and not mg:
            return None
        cg = s.cuda_graphs if s is not None else None
        o = s.offload if s is not None else None
        return cls(frozenset(cg.scopes) if cg else frozenset(), tuple(o.modules) if o else (),
                   o.fraction if o else 0.0, (s.cross_entropy_fusion or "") if s is not None else "", mp, mg,
                   cg.impl if cg else "")

    def settings(self):
        """The plan's ``StackSettings`` of this key (None: no switch), the inverse of ``of_settings``."""
        from search.settings.stack import GRAPH_SCOPES, CudaGraphs, FineGrainedOffload, StackSettings
        cg = None
        if self.graphs:
            scope = () if "layer" in self.graphs else tuple(x for x in GRAPH_SCOPES if x in self.graphs)
            cg = CudaGraphs(impl=self.graph_impl or "transformer_engine", scope=scope)
        off = FineGrainedOffload(modules=self.offload_modules, fraction=self.offload_fraction) \
            if self.offload_modules else None
        st = StackSettings(cuda_graphs=cg, offload=off, cross_entropy_fusion=self.ce_fusion or None)
        return None if st.empty else st


class RunSettings(NamedTuple):
    """The cost model's view of how a framework runs a plan beyond what the plan says, derived from the plan's settings
    in one place (``plan_view.run_settings``); the defaults are our runtime on megatron-core 0.16 (and any recent
    megatron-core / Megatron-LM); ``LEGACY_V1`` turns every refinement added with plan v2 off (the v1 model, for
    regression tests).

    grad_reduce_in_fp32  gradient buffer and DP reduction in fp32 (4 B per parameter instead of the parameter dtype;
                         Megatron-LM's arguments.py forces it for bf16; megatron-core's DDP default is off)
    overlap_tp_dgrad     megatron-core's column-parallel backward (``LinearWithGradAccumulationAndAsyncCommunication``):
                         the input-gradient all-reduce (SP: reduce-scatter) runs async behind the weight-gradient
                         GEMM and the SP re-gather of the input behind the input-gradient GEMM (Megatron-LM of
                         2021, SC'21's runs, had neither)
    p2p_scatter_gather   Megatron-LM 2021's boundary transfer: each TP rank sends 1/tp of the activation, then the
                         receiving TP group all-gathers it (megatron-core without SP sends it whole)
    overlap_p2p_comm     interleaved schedule: p2p sends/receives async behind the next chunk (megatron-core's
                         default with virtual stages); only the part longer than the op it hides behind is exposed
    optimizer_barrier    the optimizer step of every stage starts when the slowest stage has its gradients (the
                         gradient-norm clip all-reduces over the model-parallel group)
    fp32_grad_copy       the mixed-precision optimizer's fp32 copy of gradients kept in a bf16/fp16 grad buffer
                         (``main_param.grad = main_grad.float()``): 4 B per parameter (/ dp x cp with the distributed
                         optimizer) alive during the step, after the activations are freed
    bucket_params        the least DDP bucket size in parameters (megatron-core: max(40M, 1M x dp) with
                         overlap_grad_reduce, when no bucket size is given)
    ddp_bucket_size      ``--ddp-bucket-size`` (parameters per bucket); None: megatron-core's default above
    ddp_num_buckets      ``--ddp-num-buckets N``: a rank's bucket size is its parameter count // N (Megatron-LM
                         ``resolve_ddp_bucket_size``, ``settings/data_parallel.py``); None: ``ddp_bucket_size``
    align_grad_reduce    the schedule launches each model chunk's gradient reduction (Megatron-LM's default
                         ``grad_sync_func``; our runtime does not: bucket hooks, ``dp_timeline.py``)
    align_param_gather   ``--align-param-gather``: the interleaved schedule gathers chunk j+1's parameters at chunk
                         j's first forward (otherwise each chunk's first bucket is gathered when first needed)
    rank_order           megatron-core's rank order: ``tp-cp-ep-dp-pp`` (default) or ``tp-cp-ep-pp-dp``
                         (``--use-tp-pp-dp-mapping``: pipeline stages side by side, each DP group across the
                         cluster; uniform stages only)
    nvls, sharp          NCCL's in-network reductions for the DP collectives (``comm.py``): NVLink SHARP
                         (``NCCL_NVLS_ENABLE``) inside an NVLink domain, InfiniBand SHARP (``--use-sharp``) across
    precision_aware      megatron-core's precision-aware optimizer (``settings/optimizer_state.py``): Adam's master
                         weight and moments in its dtypes, held by TE's FusedAdam (``costmodel/optimizer_state.py``);
                         None: fp32 master weights and moments
    release              the software release priced (a container of ``search/settings/releases.py``; "" = the newest): the
                         kernel efficiencies fitted per release (``release_constants.py``)
    """

    grad_reduce_in_fp32: bool = False
    overlap_tp_dgrad: bool = True
    p2p_scatter_gather: bool = False
    overlap_p2p_comm: bool = True
    optimizer_barrier: bool = True
    fp32_grad_copy: bool = True
    bucket_params: int = 40_000_000
    multi_nic: bool = True
    batched_p2p: bool = True
    fused_swiglu: bool = True
    release: str = ""
    ddp_bucket_size: int | None = None
    ddp_num_buckets: int | None = None
    align_grad_reduce: bool = False
    align_param_gather: bool = False
    rank_order: str = "tp-cp-ep-dp-pp"
    nvls: bool = False
    sharp: bool = False
    precision_aware: object = None       # a PrecisionAwareOptimizer (frozen) or None


LEGACY_V1 = RunSettings(overlap_tp_dgrad=False, overlap_p2p_comm=False, optimizer_barrier=False,
                        fp32_grad_copy=False, multi_nic=False, batched_p2p=False, fused_swiglu=False)


@dataclass(frozen=True)
class UnitTable:
    """Per-unit costs of all the model's units at one (per-rank batch, tp). Arrays are indexed by unit."""

    batch: int
    tp: int
    fwd_ms: np.ndarray            # (U,) forward, the unit's own TP collectives included
    bwd_ms: np.ndarray            # (U,) backward
    recompute_ms: np.ndarray      # (U, N_RC) extra time per micro-batch for each recompute choice
    act_mb: np.ndarray            # (U, N_RC) MB kept for backward per in-flight micro-batch, per choice
    peak_mb: np.ndarray           # (U, N_RC) transient re-materialisation MB during the unit's backward
    weight_params: np.ndarray     # (U,) parameters per rank after the TP split
    boundary_mb: np.ndarray       # (U+1,) MB per rank crossing a boundary placed before unit u (u=U: after the last)
    embed_fwd_ms: float = 0.0
    embed_bwd_ms: float = 0.0
    embed_params: float = 0.0
    embed_act_mb: float = 0.0
    head_fwd_ms: float = 0.0
    head_bwd_ms: float = 0.0
    head_params: float = 0.0
    head_act_mb: float = 0.0
    # optional detail (additive): TP collective ms inside each unit (fwd + bwd), the tied word-embedding copy the
    # last stage holds when the pipeline has more than one stage, and the T5 encoder output a decoder stage keeps
    tp_comm_ms: np.ndarray | None = None
    word_embed_params: float = 0.0
    encoder_output_mb: float = 0.0
    head_peak_mb: float = 0.0     # transient of the loss on the last stage (fp16 logits + an fp32 temporary)
    # optional detail (additive): TP collective ms hidden behind GEMMs, and ring-attention K/V exchange ms (exposed,
    # hidden) inside each unit (fwd + bwd); the exposed parts are already in fwd_ms/bwd_ms
    tp_hidden_ms: np.ndarray | None = None
    cp_comm_ms: np.ndarray | None = None
    cp_hidden_ms: np.ndarray | None = None
    # optional detail (timelines): (U, 4) the forward's shares of TP exposed (the ring's excluded), TP hidden, CP
    # exposed and CP hidden ms; the backward has the rest of each unit's totals above
    comm_fwd_ms: np.ndarray | None = None
    # optional detail (MoE models, ``moe_cost.py``): expert parameters per rank inside ``weight_params`` (their
    # gradients reduce, and their optimizer states shard, over the expert-DP group), the exposed and hidden
    # expert-parallel dispatch / combine ms (fwd + bwd; the exposed part is in fwd_ms / bwd_ms) and (U, 2) the
    # forward's (exposed, hidden) share
    expert_params: np.ndarray | None = None
    ep_comm_ms: np.ndarray | None = None
    ep_hidden_ms: np.ndarray | None = None
    ep_fwd_ms: np.ndarray | None = None
    # optional detail (stack features, ``stack_cost.py``): the host-bound wait added to each unit's forward
    # (``host.py``; inside fwd_ms) and the MB of CUDA-graph static buffers each unit keeps per micro-batch in flight
    host_ms: np.ndarray | None = None
    graph_mb: np.ndarray | None = None
    # optional detail (per-module precision overrides, ``settings.precision_overrides``): per recipe the linears run
    # (None: bf16), the (U,) weight parameters per rank of each unit's linears an override set, inside
    # ``weight_params``: their cached copies are charged at that recipe, not the plan's (``evaluate.py``)
    override_params: tuple[tuple[str | None, np.ndarray], ...] = ()


@dataclass
class StageCost:
    """One stage of a plan: per-micro-batch times, per-iteration sync, and peak memory per GPU."""

    fwd_ms: float
    bwd_ms: float
    recompute_ms: float
    p2p_ms: float
    dp_sync_ms: float = 0.0
    optimizer_ms: float = 0.0
    memory_mb: float = 0.0
    memory_breakdown: dict[str, float] = field(default_factory=dict)
    fits: bool = True
    # optional detail for reports and the search's bottleneck classification
    tp_comm_ms: float = 0.0       # part of fwd/bwd spent in TP collectives
    ep_comm_ms: float = 0.0       # part of fwd/bwd spent in exposed expert-parallel dispatch / combine (MoE)
    ideal_ms: float = 0.0         # fwd+bwd of the same units on one GPU at the full micro-batch, / num_gpus
    # interleaved plans: per model chunk of the stage, per micro-batch, forward (+ its p2p share) and backward
    # (+ recompute + its p2p share); empty = one chunk (then fwd_ms + p2p_ms / 2 and the rest)
    chunk_fwd_ms: tuple[float, ...] = ()
    chunk_bwd_ms: tuple[float, ...] = ()
    # communication per iteration by kind: (exposed ms, hidden ms behind compute). Kinds: tp (TP collectives in the
    # units, the recomputed forwards' excluded), cp (ring-attention K/V exchange), p2p (boundaries), dp (gradient
    # reduction), param_gather (distributed optimizer), embedding_grads (tied embedding between the end stages)
    comm: dict[str, tuple[float, float]] = field(default_factory=dict)
    prologue_ms: float = 0.0      # exposed parameter all-gather before the stage's first forward (overlap_param_gather)
    # per chunk, per micro-batch: (forward, exposed forward p2p, recompute, backward, exposed backward p2p), for
    # timelines (one entry for a one-chunk stage)
    chunk_parts: tuple[tuple[float, float, float, float, float], ...] = ()
    # per chunk, per micro-batch, where the cost model splits them (``UnitTable.comm_fwd_ms``): TP exposed (forward,
    # backward), CP exposed (forward, backward), TP hidden (forward, backward), CP hidden (forward, backward); the
    # exposed parts are inside the chunk's forward / backward times. Empty: not split (timelines keep boxes whole)
    chunk_comm: tuple[tuple[float, ...], ...] = ()
    # the software-stack features' named time terms, ms per iteration on this stage (``stack_cost.py``: what each
    # adds to the stage's busy time; negative: what it saves); their memory terms are ``memory_breakdown`` keys
    terms: dict[str, float] = field(default_factory=dict)

    @property
    def time_per_microbatch_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms + self.recompute_ms + self.p2p_ms


class Event(NamedTuple):
    """One box of a pipeline timeline: ``kind`` of ``micro_batch`` on ``chunk`` of ``stage`` (-1: not per
    micro-batch / chunk), from ``start_ms`` to ``end_ms``.

    Kinds on a stage's compute lane (they never overlap each other; their durations add up to
    ``PipelineCost.stage_busy_ms``): ``forward``, ``backward``, ``recompute`` (the re-run forward inside a backward),
    ``tp_comm`` / ``cp_comm`` (the op's exposed TP collectives / ring K/V exchange), ``p2p`` (exposed boundary send/recv), ``dp_comm`` (exposed DP gradient reduction after the last backward),
    ``param_gather`` (exposed parameter all-gather of the distributed optimizer: before the first forward when
    overlapped, else inside the step), ``optimizer`` (the step after the barrier). ``sync`` and ``step`` are the
    coarse forms of dp_comm and optimizer (+ param_gather) that ``pipeline.py`` itself emits.
    Kinds on a stage's communication lane (running under compute, not part of the busy time): ``dp_comm_hidden``,
    ``param_gather_hidden``, ``tp_comm_hidden``, ``cp_comm_hidden``.
    """

    stage: int
    chunk: int
    micro_batch: int
    kind: str
    start_ms: float
    end_ms: float


@dataclass
class PipelineCost:
    """Timing of the whole pipeline (``pipeline.py``)."""

    iteration_ms: float
    stage_total_ms: list[float]   # per stage: when it would finish (its last op + sync + step)
    bottleneck: int               # the busiest stage
    bubble_ms: float = 0.0        # iteration - the bottleneck's busy time
    num_chunks: int = 1           # model chunks per stage (interleaved 1F1B when > 1)
    stage_busy_ms: list[float] = field(default_factory=list)   # per stage: its own work (compute-lane events)


@dataclass
class PlanCost:
    """Everything a report needs about one plan."""

    iteration_ms: float
    samples_per_s: float
    stages: list[StageCost]
    pipeline: PipelineCost
    max_memory_mb: float
    memory_limit_mb: float
    fits: bool
    bottleneck_stage: int
    bottleneck_resource: str      # compute | communication | recompute | memory
    tflops_per_gpu: float = 0.0
    mfu: float = 0.0
    cost_model: str = "analytic"
    warnings: list[str] = field(default_factory=list)
    tokens_per_s_per_gpu: float = 0.0     # search.costmodel.throughput: global batch x tokens per sample / time / GPUs
