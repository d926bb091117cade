"""A small, fully specified cost model with random per-unit costs, for testing the search algorithms.

It implements the same API as ``search.costmodel.CostModel`` (``unit_table``, ``stage_cost``, ``pipeline``,
``evaluate``) with simple closed-form rules, so the planner's exact pieces (recompute DP, partition DP, exhaustive
enumeration) can be checked against brute force on arbitrary, seeded cost landscapes -- not only on the shapes that
real transformer costs happen to have:

* unit u at per-rank batch b and TP t: ``fwd = base_u * b / t**eff + tp_comm``, ``bwd = 2 fwd``;
* activations per in-flight micro-batch ``act[u, c] = act_u * b / t * keep[c]``, recompute time
  ``fwd * redo[c]``, transient peak during backward ``peak[u, c]``;
* stage memory ``= 16 B * params / t + K * sum(act) + max(peak) + boundary buffers`` with ``K = S - i`` micro-batches
  in flight under 1F1B;
* pipeline ``T = max_i ((M - 1) t_i + sync_i) + sum_j t_j`` (the Aceso/1F1B formula plus a DP gradient sync).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..costmodel.types import ATTN_DROPOUT, MLA_UP_PROJ, UNAVAILABLE_MS, PipelineCost, PlanCost, StageCost, UnitTable
from search.spec.model import ModelSpec
from search.spec.plan import ParallelPlan


class SyntheticCostModel:
    """Random but deterministic (``seed``) per-unit costs over ``model.num_units`` units."""

    kind = "synthetic"

    def __init__(self, model: ModelSpec, cluster, training, seed: int = 0, memory_limit_mb: float = 1000.0):
        self.model, self.cluster, self.training = model, cluster, training
        self.memory_limit_mb = float(memory_limit_mb)
        rng = np.random.default_rng(seed)
        n = model.num_units
        self._base = rng.uniform(1.0, 4.0, n)
        self._act = rng.uniform(20.0, 80.0, n)
        self._keep = np.stack([np.ones(n), rng.uniform(0.3, 0.8, n), rng.uniform(0.02, 0.2, n)], axis=1)
        self._redo = np.stack([np.zeros(n), rng.uniform(0.1, 0.4, n), rng.uniform(0.9, 1.1, n)], axis=1)
        self._peak = np.stack([np.zeros(n), rng.uniform(0.0, 0.4, n), rng.uniform(0.6, 1.2, n)], axis=1)
        self._params = rng.uniform(2e6, 6e6, n)
        self._tp_eff = rng.uniform(0.75, 0.95)
        self._comm = rng.uniform(0.05, 0.3)
        self._sync = rng.uniform(1e-6, 4e-6)
        # attn_dropout: attention units only (MLP units: unavailable, the none row)
        attn = np.array([u.kind != "mlp" for u in model.units])
        self._keep = np.column_stack([self._keep, np.where(attn, rng.uniform(0.5, 0.9, n), 1.0)])
        self._redo = np.column_stack([self._redo, np.where(attn, rng.uniform(0.05, 0.3, n), 0.0)])
        self._peak = np.column_stack([self._peak, np.where(attn, rng.uniform(0.0, 0.4, n), 0.0)])
        self._unavailable = ~attn
        # mla_up_proj: no synthetic model has MLA (unavailable everywhere, the none row; no random draw)
        self._keep = np.column_stack([self._keep, np.ones(n)])
        self._redo = np.column_stack([self._redo, np.zeros(n)])
        self._peak = np.column_stack([self._peak, np.zeros(n)])
        self.unit_table = lru_cache(maxsize=None)(self._unit_table)

    def _unit_table(self, batch: int, tp: int) -> UnitTable:
        scale = batch / tp ** self._tp_eff
        fwd = self._base * scale + (self._comm * batch * (tp > 1))
        act = (self._act * batch / tp)[:, None] * self._keep
        rec = fwd[:, None] * self._redo
        rec[self._unavailable, ATTN_DROPOUT] = UNAVAILABLE_MS
        rec[:, MLA_UP_PROJ] = UNAVAILABLE_MS
        return UnitTable(
            batch=batch, tp=tp, fwd_ms=fwd, bwd_ms=2 * fwd, recompute_ms=rec,
            act_mb=act, peak_mb=(self._act * batch / tp)[:, None] * self._peak,
            weight_params=self._params / tp, boundary_mb=np.full(len(fwd) + 1, 2.0 * batch / tp),
            embed_fwd_ms=0.5 * batch, embed_bwd_ms=1.0 * batch, embed_params=4e6 / tp,
            head_fwd_ms=0.7 * batch, head_bwd_ms=1.4 * batch, head_params=4e6 / tp,
        )

    def stage_cost(self, stage_index, num_stages, first_rank, start_unit, end_unit, tp, dp, recompute,
                   micro_batch_size) -> StageCost:
        t = self.unit_table(micro_batch_size // dp, tp)
        span = slice(start_unit, end_unit)
        rc = np.asarray(recompute, dtype=np.int64)
        idx = np.arange(start_unit, end_unit)
        fwd, bwd = float(t.fwd_ms[span].sum()), float(t.bwd_ms[span].sum())
        params = float(t.weight_params[span].sum())
        if stage_index == 0:
            fwd, bwd, params = fwd + t.embed_fwd_ms, bwd + t.embed_bwd_ms, params + t.embed_params
        if stage_index == num_stages - 1:
            fwd, bwd, params = fwd + t.head_fwd_ms, bwd + t.head_bwd_ms, params + t.head_params
        rec = float(t.recompute_ms[idx, rc].sum())
        p2p = (stage_index > 0) * t.boundary_mb[start_unit] * 0.01 + (stage_index < num_stages - 1) * \
            t.boundary_mb[end_unit] * 0.01
        inflight = num_stages - stage_index
        acts = float(t.act_mb[idx, rc].sum()) * inflight
        peak = float(t.peak_mb[idx, rc].max()) if len(idx) else 0.0
        static = params * 16 / 2**20
        buffers = 2 * float(t.boundary_mb[start_unit])
        mem = static + acts + peak + buffers
        sync = self._sync * params * (dp > 1) * (dp - 1) / dp * 1000
        ideal = float((self._base[span] * micro_batch_size).sum()) * 3 / (tp * dp)
        return StageCost(fwd_ms=fwd, bwd_ms=bwd, recompute_ms=rec, p2p_ms=float(p2p), dp_sync_ms=sync,
                         memory_mb=mem, memory_breakdown={"static": static, "activations": acts,
                                                          "recompute_peak": peak, "p2p_buffers": buffers},
                         fits=mem <= self.memory_limit_mb, tp_comm_ms=self._comm * (tp > 1) * 3 * (end_unit -
                         start_unit), ideal_ms=ideal)

    def pipeline(self, stage_costs: list[StageCost], num_micro_batches: int) -> PipelineCost:
        t = [s.time_per_microbatch_ms for s in stage_costs]
        total = sum(t)
        per = [(num_micro_batches - 1) * ti + s.dp_sync_ms + s.optimizer_ms + total for ti, s in zip(t, stage_costs)]
        b = int(np.argmax(per))
        return PipelineCost(iteration_ms=per[b], stage_total_ms=per, bottleneck=b,
                            bubble_ms=total - t[b])

    def evaluate(self, plan: ParallelPlan) -> PlanCost:
        from ..costmodel.types import RC_CODE
        stages, rank = [], 0
        for i, st in enumerate(plan.stages):
            rc = np.array([RC_CODE[r] for r in st.recompute], dtype=np.int8)
            stages.append(self.stage_cost(i, plan.num_stages, rank, st.start_unit, st.end_unit, st.tp, st.dp, rc,
                                          plan.micro_batch_size))
            rank += st.num_gpus
        pipe = self.pipeline(stages, plan.num_micro_batches)
        mem = max(s.memory_mb for s in stages)
        return PlanCost(iteration_ms=pipe.iteration_ms, samples_per_s=plan.global_batch_size / pipe.iteration_ms
                        * 1000, stages=stages, pipeline=pipe, max_memory_mb=mem,
                        memory_limit_mb=self.memory_limit_mb, fits=all(s.fits for s in stages),
                        bottleneck_stage=pipe.bottleneck, bottleneck_resource="compute", cost_model=self.kind)


def tiny_problem(seed: int, gbs: int = 32):
    """A random tiny problem for optimality checks: (cost model, space, gbs) with <= 4 GPUs, <= 4 layers (8 units),
    2 micro-batch sizes and a random memory limit (so recompute and memory-driven moves matter)."""
    from search.spec.cluster import parse_cluster
    from search.spec.presets import load_model
    from search.spec.training import TrainingSpec
    from .space import Space
    rng = np.random.default_rng(seed)
    layers = int(rng.integers(1, 5))
    gpus = int(rng.choice([1, 2, 4]))
    mbs = sorted(int(x) for x in rng.choice([1, 2, 4, 8], 2, replace=False))
    model = load_model("gpt-1.3b", num_layers=layers)
    cluster = parse_cluster(f"1x{gpus}-h100")
    training = TrainingSpec(global_batch_size=gbs, micro_batch_sizes=mbs)
    cm = SyntheticCostModel(model, cluster, training, seed=seed, memory_limit_mb=float(rng.uniform(500, 1500)))
    return cm, Space.of(model, cluster, training), gbs
