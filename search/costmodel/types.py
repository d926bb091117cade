"""Result types shared by every cost model (analytic, profile database, aceso-compat) and the search.

Times are milliseconds, memory is MB (2^20 bytes). Recompute choices are coded as ints in arrays:
0 = none, 1 = selective, 2 = full, 3 = attn_dropout (``RC[code]`` gives the plan's string; the plan's
``RECOMPUTE_CHOICES`` order). A choice a unit cannot take (``attn_dropout`` on an MLP unit, or where it frees
nothing: flash attention, no attention dropout) has recompute time ``UNAVAILABLE_MS`` and the ``none`` activations,
so no search picks it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..plan import RECOMPUTE_CHOICES

RC: tuple[str, ...] = RECOMPUTE_CHOICES
RC_CODE = {name: i for i, name in enumerate(RC)}
N_RC = len(RC)
ATTN_DROPOUT = RC_CODE["attn_dropout"]
UNAVAILABLE_MS = 1e9     # recompute time of a choice a unit cannot take: never chosen, never inf arithmetic


# What a cost model can price beyond a v1 plan (``CostModel.features``); the search explores only these.
ALL_FEATURES = frozenset({"sequence_parallel", "context_parallel", "interleaved", "distributed_optimizer",
                          "overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap"})


class Shape(NamedTuple):
    """A stage's parallel shape: ``tp * cp * dp`` GPUs, sequence parallelism on or off."""

    tp: int
    dp: int
    cp: int = 1
    sp: bool = False

    @property
    def num_gpus(self) -> int:
        return self.tp * self.cp * self.dp

    @classmethod
    def of(cls, shape) -> "Shape":
        """A ``Shape`` from a ``(tp, dp)`` / ``(tp, dp, cp, sp)`` tuple or a plan's ``StageSpec``."""
        if shape is None or isinstance(shape, Shape):
            return shape
        if hasattr(shape, "tp"):
            return cls(shape.tp, shape.dp, shape.cp, shape.sequence_parallel)
        return cls(*shape)


class Features(NamedTuple):
    """Plan-wide switches that change costs (the ``ParallelPlan`` fields of the same names)."""

    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    tp_comm_overlap: bool = False

    @classmethod
    def of_plan(cls, plan) -> "Features":
        return cls(plan.distributed_optimizer, plan.overlap_grad_reduce, plan.overlap_param_gather,
                   plan.tp_comm_overlap)


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
    ideal_ms: float = 0.0         # fwd+bwd of the same units on one GPU at the full micro-batch, / num_gpus
    # interleaved plans: per model chunk of the stage, per micro-batch, forward (+ its p2p share) and backward
    # (+ recompute + its p2p share); empty = one chunk (then fwd_ms + p2p_ms / 2 and the rest)
    chunk_fwd_ms: tuple[float, ...] = ()
    chunk_bwd_ms: tuple[float, ...] = ()
    # communication per iteration by kind (tp, cp, p2p, dp, ...): (exposed ms, hidden ms behind compute)
    comm: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def time_per_microbatch_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms + self.recompute_ms + self.p2p_ms


class Event(NamedTuple):
    """One box of a pipeline timeline: ``kind`` (forward | backward | sync, and whatever finer kinds a cost model
    emits, e.g. recompute, p2p, dp_comm) of ``micro_batch`` on ``chunk`` of ``stage`` (-1: not per micro-batch)."""

    stage: int
    chunk: int
    micro_batch: int
    kind: str
    start_ms: float
    end_ms: float


@dataclass
class PipelineCost:
    """1F1B timing of the whole pipeline."""

    iteration_ms: float
    stage_total_ms: list[float]
    bottleneck: int
    bubble_ms: float = 0.0
    num_chunks: int = 1           # model chunks per stage (interleaved 1F1B when > 1)


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
