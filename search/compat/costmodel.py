"""``CompatCostModel``: the reference's cost model (formulas.py, SPEC §3) behind our cost-model API.

A stage of our plan is the op range of its units (ops.OpLayout), every op at the stage's (micro_batch/dp, tp)
and algo 0, with the op recompute flags of the units' choices. ``stage_cost`` gives the reference's per-micro-batch
time t_i (fwd, bwd, recompute, p2p in + out) and memory; ``pipeline`` the reference 1F1B formula
``(M-1) t_i + Σ_j t_j``. Like the reference, no DP all-reduce, optimizer step or tied-embedding sync
(``dp_sync_ms = optimizer_ms = 0``). The same plan exported with ``plan_to_ref`` and evaluated by
``evaluate_ref_config`` gives the same numbers (tests/unit/test_compat_costmodel.py).

Speed: per (per-GPU batch, tp) the op metrics of the whole model are read once into arrays; a stage is
O(ops in the stage) numpy work. Sums run over the stage's own slice (not prefix-sum differences), so a stage's
numbers depend only on its op sequence, not on where it sits in the model: ``stage_signature`` names that
sequence, and results are cached by it (in a 1024-layer model most spans of one length are the same ops).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from search.spec.cluster import ClusterSpec
from ..costmodel.types import RC_CODE, PipelineCost, PlanCost, StageCost
from search.io.errors import AcesoError
from search.spec.model import ModelSpec
from search.spec.plan import ParallelPlan
from search.spec.training import TrainingSpec
from search.costmodel.throughput import tokens_per_sample
from .db import IN, OUT, RB, RF, AcesoDB, A, B, F, W
from .evaluate import evaluate_ref_config
from .formulas import combine_memory, memory_fixed_terms, p2p_us, pipeline_1f1b, recompute_terms, shared_space_factors
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
    """Op metrics of the whole model at one (per-GPU batch, tp), algo 0 (µs / MB), one contiguous array each."""

    fwd: np.ndarray
    bwd: np.ndarray
    w: np.ndarray
    act: np.ndarray       # A' (shared-space rule applied)
    rf: np.ndarray
    rb: np.ndarray
    inp: np.ndarray
    out: np.ndarray


@dataclass(frozen=True)
class _Fixed:
    """The recompute-independent terms of one stage span at one (per-GPU batch, tp) (µs / MB)."""

    fwd: float
    bwd: float
    w: float
    inp: float               # In(o_1)
    out: float               # Out(o_n)
    act_total: float         # Σ A'
    reserved: float
    ideal_fwd_bwd: float | None   # fwd + bwd at (micro_batch, tp 1), when profiled


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
        self._signatures: dict[tuple[int, int], bytes] = {}
        self._fixed_cache: dict[tuple, _Fixed] = {}
        # per op: its name's number, times two, plus one where a unit starts (what a stage's cost depends on)
        ids = {n: k for k, n in enumerate(dict.fromkeys(self.layout.names))}
        code = np.array([2 * ids[n] for n in self.layout.names], dtype=np.int32)
        code[list(self.layout.unit_start)] += 1
        self._op_code = code
        self._flops_per_sample = model.training_flops_per_sample()

    def supports(self, batch: int, tp: int) -> bool:
        """Whether the database profiled this per-GPU batch and tp (else ``stage_cost`` raises AcesoError)."""
        return self.db.has(batch, tp, 0)

    def available_shapes(self) -> frozenset[tuple[int, int]]:
        """The (per-GPU batch, tp) pairs ``stage_cost`` can price: the database's algo-0 files. The search keeps
        to them (``planner.state.Space.allowed``); cost models without this method cover every shape."""
        return self.db.profiled(0)

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
        col = np.ascontiguousarray
        return _OpArrays(fwd=col(m[:, F]), bwd=col(m[:, B]), w=col(m[:, W]), act=m[:, A] * self._factors,
                         rf=col(m[:, RF]), rb=col(m[:, RB]), inp=col(m[:, IN]), out=col(m[:, OUT]))

    def stage_signature(self, start_unit: int, end_unit: int) -> bytes:
        """A digest of the op sequence of units ``[start_unit, end_unit)`` (names and where units start, glue ops
        included). Spans with the same signature have the same ``stage_cost`` at every position, shape and
        per-unit recompute: the search uses it to reuse per-stage results (``planner.recompute``)."""
        key = (start_unit, end_unit)
        hit = self._signatures.get(key)
        if hit is None:
            o0, o1 = self.layout.bounds[start_unit], self.layout.bounds[end_unit]
            if len(self._signatures) >= CACHE_LIMIT:
                self._signatures.clear()
            hit = self._signatures[key] = hashlib.blake2b(self._op_code[o0:o1].tobytes(), digest_size=16).digest()
        return hit

    def stage_cost(self, stage_index: int, num_stages: int, first_rank: int, start_unit: int, end_unit: int,
                   tp: int, dp: int, recompute, micro_batch_size: int, prev=None, next=None,
                   num_micro_batches=None, *, cp: int = 1, sp: bool = False, spans=None, features=None) -> StageCost:
        """The reference's stage cost; ``prev``/``next``/``features`` are accepted and ignored (the reference prices
        none of the v2 features: ``self.features`` is empty), CP, SP and interleaving are refused."""
        if cp > 1 or sp or (spans is not None and len(spans) > 1):
            raise AcesoError(REFUSED)
        rc = np.asarray(recompute, dtype=np.int8)
        key = (stage_index, num_stages, first_rank, self.stage_signature(start_unit, end_unit), tp, dp,
               rc.tobytes(), micro_batch_size)
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) >= CACHE_LIMIT:
                self._cache.clear()
            hit = self._cache[key] = self._stage_cost(stage_index, num_stages, first_rank, start_unit, end_unit,
                                                      tp, dp, rc, micro_batch_size)
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

    def _fixed(self, start_unit: int, end_unit: int, batch: int, tp: int, mbs: int) -> _Fixed:
        """What a stage's cost owes to its op span and shape alone (not to recompute), cached by span content."""
        key = (self.stage_signature(start_unit, end_unit), batch, tp, mbs)
        hit = self._fixed_cache.get(key)
        if hit is None:
            arr = self._arrays(batch, tp)
            o0, o1, _, _ = self._span(start_unit, end_unit)
            w = float(arr.w[o0:o1].sum())
            act_total, reserved = memory_fixed_terms(w, arr.act[o0:o1], arr.rf[o0:o1], arr.rb[o0:o1])
            ideal = None
            if self.supports(mbs, 1):
                one = self._arrays(mbs, 1)
                ideal = float(one.fwd[o0:o1].sum() + one.bwd[o0:o1].sum())
            if len(self._fixed_cache) >= CACHE_LIMIT:
                self._fixed_cache.clear()
            hit = self._fixed_cache[key] = _Fixed(
                fwd=float(arr.fwd[o0:o1].sum()), bwd=float(arr.bwd[o0:o1].sum()), w=w, inp=float(arr.inp[o0]),
                out=float(arr.out[o1 - 1]), act_total=act_total, reserved=reserved, ideal_fwd_bwd=ideal)
        return hit

    def _stage_cost(self, stage_index, num_stages, first_rank, start_unit, end_unit, tp, dp, rc, mbs) -> StageCost:
        if mbs % dp:
            raise AcesoError(f"dp ({dp}) must divide micro_batch_size ({mbs})")
        if len(rc) != end_unit - start_unit:
            raise AcesoError(f"recompute has {len(rc)} entries for {end_unit - start_unit} units")
        fx = self._fixed(start_unit, end_unit, mbs // dp, tp, mbs)
        if rc.any():
            arr = self._arrays(mbs // dp, tp)
            o0, o1, unit_idx, op_idx = self._span(start_unit, end_unit)
            flags = self.layout.flag_patterns[np.concatenate((rc, _ZERO))[unit_idx], op_idx]  # glue ops: the 0
            rc_us = float(arr.fwd[o0:o1][flags.view(np.bool_)].sum())
            freed, peak = recompute_terms(arr.act[o0:o1], flags, self.layout.segment_start[o0:o1])
        else:  # no flags: what the formulas give for all-zero flags
            rc_us = freed = peak = 0.0
        gpn = self.cluster.gpus_per_node
        in_cross = first_rank > 0 and first_rank % gpn == 0
        out_cross = (first_rank + tp * dp) % gpn == 0
        p2p = (p2p_us(fx.inp, self.db.p2p_inter if in_cross else self.db.p2p_intra)
               + p2p_us(fx.out, self.db.p2p_inter if out_cross else self.db.p2p_intra))
        w = fx.w
        mem = combine_memory(w, fx.inp, fx.act_total, fx.reserved, freed, peak, num_stages - 1 - stage_index)
        ideal = 0.0 if fx.ideal_fwd_bwd is None else fx.ideal_fwd_bwd / 1000 / (tp * dp)
        breakdown = {"params": 3 * w, "grads": w, "optimizer": 4 * w, "activations": mem["activations"],
                     "recompute_peak": mem["recompute_peak"], "p2p_buffers": 0.0, "reserve": mem["reserved"]}
        return StageCost(fwd_ms=fx.fwd / 1000, bwd_ms=fx.bwd / 1000, recompute_ms=rc_us / 1000, p2p_ms=p2p / 1000,
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
                        mfu=tflops / peak, cost_model=self.kind, warnings=[WARNING],
                        tokens_per_s_per_gpu=global_batch_size / seconds * tokens_per_sample(self.model) / world_size)


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
