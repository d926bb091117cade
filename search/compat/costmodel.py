"""``CompatCostModel``: the reference's cost model (formulas.py, SPEC §3) behind our cost-model API.

A stage of our plan is the op range of its units (ops.OpLayout), every op at the stage's (micro_batch/dp, tp)
and algo 0, with the op recompute flags of the units' choices. ``stage_cost`` gives the reference's per-micro-batch
time t_i (fwd, bwd, recompute, p2p in + out) and memory; ``pipeline`` the reference 1F1B formula
``(M-1) t_i + Σ_j t_j``. Like the reference, no DP all-reduce, optimizer step or tied-embedding sync
(``dp_sync_ms = optimizer_ms = 0``). The same plan exported with ``plan_to_ref`` and evaluated by
``evaluate_ref_config`` gives the same numbers (tests/unit/test_compat_costmodel.py).

Speed: per (per-GPU batch, tp) the op metrics of the whole model are read once into arrays with prefix sums;
a stage is O(ops in the stage) numpy work, and results are cached by their arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..cluster import ClusterSpec
from ..costmodel.types import RC_CODE, PipelineCost, PlanCost, StageCost
from ..errors import AcesoError
from ..model import ModelSpec
from ..plan import ParallelPlan
from ..training import TrainingSpec
from .db import IN, OUT, RB, RF, AcesoDB, A, B, F, W
from .evaluate import evaluate_ref_config
from .formulas import p2p_us, pipeline_1f1b, shared_space_factors, stage_memory
from .ops import layout_for_model
from .refconfig import RefConfig

_ZERO = np.zeros(1, dtype=np.int8)
CACHE_LIMIT = 200_000   # cached stage results (about 1 KB each) before the cache starts over
REFUSED = ("aceso-compat prices plans without context/sequence parallelism and interleaving (the reference has "
           "none); use --cost-model analytic for them")
WARNING = ("aceso-compat reproduces the Aceso reference model: no DP gradient all-reduce, optimizer step or "
           "tied-embedding sync, one p2p transfer per boundary")


@dataclass(frozen=True)
class _OpArrays:
    """Op metrics of the whole model at one (per-GPU batch, tp), algo 0, with prefix sums (µs / MB)."""

    fwd: np.ndarray
    act: np.ndarray       # A' (shared-space rule applied)
    rf: np.ndarray
    rb: np.ndarray
    inp: np.ndarray
    out: np.ndarray
    cum_fwd: np.ndarray   # (n+1,)
    cum_bwd: np.ndarray
    cum_w: np.ndarray


class CompatCostModel:
    """Cost model of kind ``aceso-compat`` over an ``AcesoDB``."""

    kind = "aceso-compat"
    features: frozenset = frozenset()    # none of types.ALL_FEATURES: the search does not explore them

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, db: AcesoDB):
        if model.aceso_db_key != db.key:
            raise AcesoError(f"model {model.name} is {model.aceso_db_key} but the database is for {db.key}; "
                             "use the matching --db")
        self.model, self.cluster, self.training, self.db = model, cluster, training, db
        self.layout = layout_for_model(model)
        self.memory_limit_mb = cluster.memory_mb
        self._factors = shared_space_factors(self.layout.names)
        self._cache: dict[tuple, StageCost] = {}     # stage_cost results (shared objects: do not mutate)
        self._op_arrays: dict[tuple[int, int], _OpArrays] = {}
        self._spans: dict[tuple[int, int], tuple] = {}
        self._flops_per_sample = model.training_flops_per_sample()

    def supports(self, batch: int, tp: int) -> bool:
        """Whether the database profiled this per-GPU batch and tp (else ``stage_cost`` raises AcesoError)."""
        return self.db.has(batch, tp, 0)

    def unit_table(self, batch: int, tp: int):
        raise NotImplementedError("aceso-compat costs are op-level and not additive per unit (recompute segments "
                                  "span units); use stage_cost")

    def _arrays(self, batch: int, tp: int) -> _OpArrays:
        hit = self._op_arrays.get((batch, tp))
        if hit is None:
            hit = self._op_arrays[(batch, tp)] = self._build_arrays(batch, tp)
        return hit

    def _build_arrays(self, batch: int, tp: int) -> _OpArrays:
        m = self.db.op_matrix(self.layout.names, batch, tp, 0)
        z = np.zeros(1)
        return _OpArrays(fwd=m[:, F], act=m[:, A] * self._factors, rf=m[:, RF], rb=m[:, RB], inp=m[:, IN],
                         out=m[:, OUT], cum_fwd=np.concatenate([z, np.cumsum(m[:, F])]),
                         cum_bwd=np.concatenate([z, np.cumsum(m[:, B])]),
                         cum_w=np.concatenate([z, np.cumsum(m[:, W])]))

    def stage_cost(self, stage_index: int, num_stages: int, first_rank: int, start_unit: int, end_unit: int,
                   tp: int, dp: int, recompute, micro_batch_size: int, prev=None, next=None,
                   num_micro_batches=None, *, cp: int = 1, sp: bool = False, spans=None, features=None) -> StageCost:
        """The reference's stage cost; ``prev``/``next``/``features`` are accepted and ignored (the reference prices
        none of the v2 features: ``self.features`` is empty), CP, SP and interleaving are refused."""
        if cp > 1 or sp or (spans is not None and len(spans) > 1):
            raise AcesoError(REFUSED)
        rc = np.asarray(recompute, dtype=np.int8)
        key = (stage_index, num_stages, first_rank, start_unit, end_unit, tp, dp, rc.tobytes(), micro_batch_size)
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) >= CACHE_LIMIT:
                self._cache.clear()
            hit = self._cache[key] = self._stage_cost(*key[:7], rc, micro_batch_size)
        return hit

    def _span(self, start_unit: int, end_unit: int) -> tuple:
        """(first op, end op, per op its unit relative to start_unit (glue: end-start), op indices), cached."""
        hit = self._spans.get((start_unit, end_unit))
        if hit is None:
            o0, o1 = self.layout.bounds[start_unit], self.layout.bounds[end_unit]
            units = self.layout.op_unit[o0:o1]
            rel = np.where(units >= 0, units - start_unit, end_unit - start_unit)
            hit = self._spans[(start_unit, end_unit)] = (o0, o1, rel, np.arange(o0, o1))
        return hit

    def _stage_cost(self, stage_index, num_stages, first_rank, start_unit, end_unit, tp, dp, rc, mbs) -> StageCost:
        if mbs % dp:
            raise AcesoError(f"dp ({dp}) must divide micro_batch_size ({mbs})")
        if len(rc) != end_unit - start_unit:
            raise AcesoError(f"recompute has {len(rc)} entries for {end_unit - start_unit} units")
        arr = self._arrays(mbs // dp, tp)
        o0, o1, unit_idx, op_idx = self._span(start_unit, end_unit)
        flags = self.layout.flag_patterns[np.concatenate((rc, _ZERO))[unit_idx], op_idx]  # glue ops: the 0
        fwd = arr.cum_fwd[o1] - arr.cum_fwd[o0]
        bwd = arr.cum_bwd[o1] - arr.cum_bwd[o0]
        rc_us = float(arr.fwd[o0:o1] @ flags)
        gpn = self.cluster.gpus_per_node
        in_cross = first_rank > 0 and first_rank % gpn == 0
        out_cross = (first_rank + tp * dp) % gpn == 0
        p2p = (p2p_us(arr.inp[o0], self.db.p2p_inter if in_cross else self.db.p2p_intra)
               + p2p_us(arr.out[o1 - 1], self.db.p2p_inter if out_cross else self.db.p2p_intra))
        w = float(arr.cum_w[o1] - arr.cum_w[o0])
        mem = stage_memory(w, float(arr.inp[o0]), arr.act[o0:o1], arr.rf[o0:o1], arr.rb[o0:o1], flags,
                           self.layout.segment_start[o0:o1], num_stages - 1 - stage_index)
        ideal = 0.0
        if self.supports(mbs, 1):
            one = self._arrays(mbs, 1)
            ideal = (one.cum_fwd[o1] - one.cum_fwd[o0] + one.cum_bwd[o1] - one.cum_bwd[o0]) / 1000 / (tp * dp)
        breakdown = {"params": 3 * w, "grads": w, "optimizer": 4 * w, "activations": mem["activations"],
                     "recompute_peak": mem["recompute_peak"], "p2p_buffers": 0.0, "reserve": mem["reserved"]}
        return StageCost(fwd_ms=fwd / 1000, bwd_ms=bwd / 1000, recompute_ms=rc_us / 1000, p2p_ms=p2p / 1000,
                         memory_mb=mem["total"], memory_breakdown=breakdown,
                         fits=mem["total"] <= self.memory_limit_mb, ideal_ms=ideal)

    def pipeline(self, stage_costs: list[StageCost], num_micro_batches: int) -> PipelineCost:
        t = [s.time_per_microbatch_ms for s in stage_costs]
        totals = pipeline_1f1b(t, num_micro_batches)
        b = int(np.argmax(totals))
        return PipelineCost(iteration_ms=totals[b], stage_total_ms=totals, bottleneck=b, bubble_ms=sum(t) - t[b])

    def evaluate(self, plan: ParallelPlan) -> PlanCost:
        if plan.model.aceso_db_key != self.model.aceso_db_key or plan.model.num_units != self.model.num_units:
            raise AcesoError(f"the plan is for {plan.model.name} ({plan.model.num_layers} layers) but the cost model "
                             f"for {self.model.name} ({self.model.num_layers} layers)")
        if plan.num_virtual_stages > 1 or any(st.cp > 1 or st.sequence_parallel for st in plan.stages):
            raise AcesoError(REFUSED)
        stages = [self.stage_cost(i, plan.num_stages, plan.first_rank(i), st.start_unit, st.end_unit, st.tp, st.dp,
                                  np.array([RC_CODE[c] for c in st.recompute], dtype=np.int8),
                                  plan.micro_batch_size)
                  for i, st in enumerate(plan.stages)]
        pipe = self.pipeline(stages, plan.num_micro_batches)
        return self._plan_cost(plan.global_batch_size, plan.world_size, stages, pipe)

    def evaluate_ref(self, cfg: RefConfig) -> PlanCost:
        """A reference op-level config evaluated exactly as the reference does, as a ``PlanCost``."""
        res = evaluate_ref_config(cfg, self.db, gpus_per_node=self.cluster.gpus_per_node)
        stages = []
        for st in res.stages:
            m = st.memory
            w = m["weights"]
            stages.append(StageCost(
                fwd_ms=st.fwd_ms, bwd_ms=st.bwd_ms, recompute_ms=st.recompute_ms, p2p_ms=st.in_ms + st.out_ms,
                memory_mb=st.memory_mb, fits=st.memory_mb <= self.memory_limit_mb,
                memory_breakdown={"params": 3 * w, "grads": w, "optimizer": 4 * w, "activations": m["activations"],
                                  "recompute_peak": m["recompute_peak"], "p2p_buffers": 0.0,
                                  "reserve": m["reserved"]}))
        pipe = self.pipeline(stages, cfg.num_micro_batches)
        return self._plan_cost(cfg.global_batch_size, sum(cfg.num_gpus), stages, pipe)

    def _plan_cost(self, global_batch_size: int, world_size: int, stages: list[StageCost],
                   pipe: PipelineCost) -> PlanCost:
        max_mem = max(s.memory_mb for s in stages)
        fits = all(s.fits for s in stages)
        seconds = pipe.iteration_ms / 1000
        tflops = self._flops_per_sample * global_batch_size / seconds / world_size / 1e12
        peak = self.cluster.gpu.peak_tflops(self.model.params_dtype)
        b = pipe.bottleneck
        if not fits:
            b = int(np.argmax([s.memory_mb for s in stages]))
            resource = "memory"
        else:
            s = stages[b]
            resource = max((s.fwd_ms + s.bwd_ms, "compute"), (s.p2p_ms, "communication"),
                           (s.recompute_ms, "recompute"))[1]
        return PlanCost(iteration_ms=pipe.iteration_ms, samples_per_s=global_batch_size / seconds,
                        stages=stages, pipeline=pipe, max_memory_mb=max_mem, memory_limit_mb=self.memory_limit_mb,
                        fits=fits, bottleneck_stage=b, bottleneck_resource=resource, tflops_per_gpu=tflops,
                        mfu=tflops / peak, cost_model=self.kind, warnings=[WARNING])


@lru_cache(maxsize=16)
def _load_db(db_dir: str, key: str) -> AcesoDB:
    return AcesoDB(db_dir, key)


def make_compat_cost_model(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                           db_dir: str | Path | None) -> CompatCostModel:
    """The ``aceso-compat`` cost model of ``model`` over the Aceso database in ``db_dir``."""
    if db_dir is None:
        raise AcesoError("--cost-model aceso-compat needs --db DIR (an Aceso database, e.g. "
                         "../shared/aceso-reference-db/miniset)")
    if not model.aceso_db_key:
        raise AcesoError(f"model {model.name} has no aceso_db_key; aceso-compat covers the Aceso presets "
                         "(gpt-350m ... gpt-13b, t5-770m ... t5-22b)")
    return CompatCostModel(model, cluster, training, _load_db(str(Path(db_dir).resolve()), model.aceso_db_key))
