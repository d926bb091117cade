"""The best *uniform* Megatron configuration under the same cost model (the search's reference point).

Grid (SPEC §4.10, widened): pipeline stages ``pp``, TP ``tp`` (power of two within a node), ``dp = N / (pp tp)``,
every micro-batch size that ``dp`` divides, and one recompute choice (none / selective / full) for all units.
Layers are split evenly; when ``pp`` does not divide them, megatron-core's uneven split is allowed: the middle
stages get ``m`` layers each and the first and last stages share the rest
(``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``). T5 layers are counted
encoder first, then decoder (2 and 3 units per layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..costmodel.types import RC, RC_CODE
from ..plan import ParallelPlan, PlanPrediction, StageSpec
from .state import INF, Space

UNIFORM_RECOMPUTE = ("none", "selective", "full")   # Megatron's recompute settings for all layers


@dataclass
class BaselineResult:
    iteration_ms: float
    pp: int
    tp: int
    dp: int
    mbs: int
    recompute: str
    layers: tuple[int, ...]         # layers per stage
    bounds: tuple[int, ...]         # unit boundaries
    stage_total_ms: list[float]
    stage_memory_mb: list[float]
    evaluated: int

    @property
    def fits(self) -> bool:
        return np.isfinite(self.iteration_ms)


def layer_splits(num_layers: int, pp: int) -> list[tuple[int, ...]]:
    if pp > num_layers:
        return []
    if num_layers % pp == 0:
        return [(num_layers // pp,) * pp]
    if pp < 3:
        return [] if pp == 1 else [(f, num_layers - f) for f in range(1, num_layers) if abs(2 * f - num_layers) <= 2]
    out = []
    for m in {num_layers // pp, -(-num_layers // pp)}:
        rest = num_layers - m * (pp - 2)
        for f in range(1, rest):
            if abs(f - (rest - f)) <= 1 or f == m or rest - f == m:
                split = (f, *([m] * (pp - 2)), rest - f)
                if split not in out and min(split) >= 1:
                    out.append(split)
    return out


def best_uniform(cm, gbs: int, space: Space, model) -> BaselineResult | None:
    """Best fitting uniform configuration, or the one with the least memory when none fits (iteration inf)."""
    starts = model.layer_starts
    L = len(starts) - 1
    best, best_key, least = None, None, None
    n = 0
    for pp in range(1, min(space.num_gpus, L) + 1):
        if space.num_gpus % pp:
            continue
        g = space.num_gpus // pp
        for tp in space.tps:
            if g % tp:
                continue
            dp = g // tp
            for mbs in space.mbs_list:
                if mbs % dp or not space.allows(tp, dp, mbs):
                    continue
                for split in layer_splits(L, pp):
                    cum = np.concatenate([[0], np.cumsum(split)])
                    bounds = tuple(starts[int(c)] for c in cum)
                    for code in (RC_CODE[c] for c in UNIFORM_RECOMPUTE):
                        n += 1
                        costs = [cm.stage_cost(i, pp, i * g, bounds[i], bounds[i + 1], tp, dp,
                                               np.full(bounds[i + 1] - bounds[i], code, np.int8), mbs)
                                 for i in range(pp)]
                        pipe = cm.pipeline(costs, gbs // mbs)
                        fits = all(c.fits for c in costs)
                        mem = [c.memory_mb for c in costs]
                        r = BaselineResult(pipe.iteration_ms if fits else INF, pp, tp, dp, mbs, RC[code], split,
                                           bounds, list(pipe.stage_total_ms), mem, 0)
                        key = (pipe.iteration_ms, pp, tp, mbs, code)
                        if fits and (best_key is None or key < best_key):
                            best, best_key = r, key
                        if least is None or max(mem) < max(least.stage_memory_mb):
                            least = r
    out = best or least
    if out is not None:
        out.evaluated = n
    return out


def baseline_plan(res: BaselineResult, model, cluster, gbs: int, kind: str,
                  attention: str | None = None) -> ParallelPlan:
    stages = [StageSpec(num_gpus=res.tp * res.dp, tp=res.tp, dp=res.dp, start_unit=a, end_unit=b,
                        recompute=[res.recompute] * (b - a)) for a, b in zip(res.bounds[:-1], res.bounds[1:])]
    pred = PlanPrediction(cost_model=kind, iteration_time_ms=round(res.iteration_ms, 6),
                          samples_per_s=round(gbs / res.iteration_ms * 1000, 6),
                          stage_time_ms=[round(t, 6) for t in res.stage_total_ms],
                          stage_memory_mb=[round(m, 6) for m in res.stage_memory_mb],
                          attention=attention) if res.fits else None
    return ParallelPlan(model=model, cluster=cluster, micro_batch_size=res.mbs, global_batch_size=gbs,
                        stages=stages, predicted=pred)
