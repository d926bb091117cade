"""Compact plan state for the search, conversion to/from ``ParallelPlan``, and the cached plan evaluator.

A search state is a tiny immutable tuple: micro-batch size, per-stage ``(tp, dp)`` shapes and the ``S + 1`` unit
boundaries. A primitive builds a new state by replacing a few tuple entries (O(S), no deep copies), and the state
itself is the key of the visited set. Recompute is *not* part of the state: for each stage it is derived exactly
(``recompute.optimize_stage``) from the stage's position, GPUs, span and micro-batch, so every state is evaluated
at its best recompute. Stage costs are cached by ``(index, num_stages, first_rank, start, end, tp, dp, mbs)``,
which makes re-evaluating a state after a primitive cost only the stages it touched.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..costmodel.types import RC, RC_CODE, StageCost
from ..errors import AcesoError
from ..plan import ParallelPlan, PlanPrediction, StageSpec
from .recompute import optimize_stage

INF = float("inf")


class State(NamedTuple):
    """One candidate plan: ``shapes[i] = (tp, dp)``, stage i covers units ``[bounds[i], bounds[i+1])``."""

    mbs: int
    shapes: tuple[tuple[int, int], ...]
    bounds: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.shapes)

    def gpus(self, i: int) -> int:
        return self.shapes[i][0] * self.shapes[i][1]

    def first_ranks(self) -> list[int]:
        out, r = [], 0
        for tp, dp in self.shapes:
            out.append(r)
            r += tp * dp
        return out


@dataclass
class StageEval:
    cost: StageCost
    rc: np.ndarray          # int8 per unit of the span
    total_ms: float = 0.0   # filled by the plan evaluation: the stage's 1F1B total


@dataclass
class Evaluation:
    """A state's evaluation: iteration time (inf if it does not fit), stages and their 1F1B totals."""

    state: State
    iteration_ms: float
    fits: bool
    stages: list[StageEval]
    stage_total_ms: list[float]
    max_memory_mb: float
    raw_iteration_ms: float = INF   # the time even when the plan does not fit (reports, infeasible hints)

    @property
    def score(self) -> tuple[int, float]:
        """Sort key: fitting plans by time first, then non-fitting ones by memory."""
        return (0, self.iteration_ms) if self.fits else (1, self.max_memory_mb)


class BudgetExhausted(Exception):
    """The evaluation or wall-clock budget is spent."""


@dataclass
class Budget:
    """Deterministic budget in plan evaluations, with an optional wall-clock cap and a progress callback."""

    max_evals: int
    max_seconds: float | None = None
    callback: Callable[[int], None] | None = None
    used: int = 0
    started: float = field(default_factory=time.monotonic)

    def charge(self) -> None:
        if self.used >= self.max_evals:
            raise BudgetExhausted
        if self.max_seconds is not None and self.used % 16 == 0 and \
                time.monotonic() - self.started > self.max_seconds:
            raise BudgetExhausted
        self.used += 1
        if self.callback is not None:
            self.callback(self.used)


class Evaluator:
    """Evaluates states with a cost model; caches stage costs and plan evaluations."""

    def __init__(self, cost_model, global_batch_size: int, budget: Budget | None = None):
        self.cm = cost_model
        self.gbs = global_batch_size
        self.budget = budget
        self.limit = float(cost_model.memory_limit_mb)
        self._stages: dict[tuple, StageEval] = {}
        self._plans: dict[State, Evaluation] = {}
        try:  # cost models that price re-sharding between stages of different shapes take the neighbours
            self.neighbours = "prev" in inspect.signature(cost_model.stage_cost).parameters
        except (TypeError, ValueError):
            self.neighbours = False

    def stage(self, i: int, num_stages: int, first_rank: int, start: int, end: int, tp: int, dp: int,
              mbs: int, prev: tuple[int, int] | None = None, next: tuple[int, int] | None = None) -> StageEval:
        if not self.neighbours:
            prev = next = None
        key = (i, num_stages, first_rank, start, end, tp, dp, mbs, prev, next)
        hit = self._stages.get(key)
        if hit is None:
            kw = {"prev": prev, "next": next} if self.neighbours else {}
            try:
                rc, cost = optimize_stage(self.cm, i, num_stages, first_rank, start, end, tp, dp, mbs, **kw)
            except (AcesoError, KeyError, ValueError, ZeroDivisionError):
                rc, cost = np.zeros(end - start, np.int8), None
            if cost is None:
                cost = StageCost(fwd_ms=INF, bwd_ms=INF, recompute_ms=0.0, p2p_ms=0.0, memory_mb=INF, fits=False)
            hit = self._stages[key] = StageEval(cost, rc)
        return hit

    def evaluate(self, state: State, charge: bool = True) -> Evaluation:
        hit = self._plans.get(state)
        if hit is not None:
            return hit
        if charge and self.budget is not None:
            self.budget.charge()
        S = state.num_stages
        stages = []
        for i, r in enumerate(state.first_ranks()):
            tp, dp = state.shapes[i]
            prev = state.shapes[i - 1] if i > 0 else None
            nxt = state.shapes[i + 1] if i < S - 1 else None
            stages.append(self.stage(i, S, r, state.bounds[i], state.bounds[i + 1], tp, dp, state.mbs, prev, nxt))
        costs = [s.cost for s in stages]
        mem = max(c.memory_mb for c in costs)
        fits = all(c.fits for c in costs)
        if all(np.isfinite(c.time_per_microbatch_ms) for c in costs):
            pipe = self.cm.pipeline(costs, self.gbs // state.mbs)
            totals, it = list(pipe.stage_total_ms), pipe.iteration_ms
        else:
            totals, it = [INF if not np.isfinite(c.time_per_microbatch_ms) else 0.0 for c in costs], INF
        ev = Evaluation(state, it if fits else INF, fits, stages, totals, mem, it)
        self._plans[state] = ev
        return ev

    def evaluations(self) -> list[Evaluation]:
        """Every plan evaluated so far, best first (ties by state, so the order is deterministic)."""
        return sorted(self._plans.values(), key=lambda e: (e.score, e.state))

    @property
    def num_evaluated(self) -> int:
        return len(self._plans)


def to_plan(ev: Evaluation, model, cluster, gbs: int, cost_model_kind: str, distributed_optimizer: bool = False,
            predicted: bool = True, attention: str | None = None) -> ParallelPlan:
    """Build the validated ``ParallelPlan`` of an evaluation (recompute from the stage optimisations)."""
    st = ev.state
    stages = [StageSpec(num_gpus=tp * dp, tp=tp, dp=dp, start_unit=st.bounds[i], end_unit=st.bounds[i + 1],
                        recompute=[RC[c] for c in ev.stages[i].rc])
              for i, (tp, dp) in enumerate(st.shapes)]
    pred = None
    if predicted:
        it = ev.raw_iteration_ms
        pred = PlanPrediction(cost_model=cost_model_kind, iteration_time_ms=round(it, 6),
                              samples_per_s=round(gbs / it * 1000, 6),
                              stage_time_ms=[round(t, 6) for t in ev.stage_total_ms],
                              stage_memory_mb=[round(s.cost.memory_mb, 6) for s in ev.stages], attention=attention)
    return ParallelPlan(model=model, cluster=cluster, micro_batch_size=st.mbs, global_batch_size=gbs,
                        distributed_optimizer=distributed_optimizer, stages=stages, predicted=pred)


def from_plan(plan: ParallelPlan) -> tuple[State, list[np.ndarray]]:
    """A plan's state and its per-stage recompute codes."""
    shapes = tuple((s.tp, s.dp) for s in plan.stages)
    bounds = tuple([s.start_unit for s in plan.stages] + [plan.stages[-1].end_unit])
    rcs = [np.array([RC_CODE[r] for r in s.recompute], dtype=np.int8) for s in plan.stages]
    return State(plan.micro_batch_size, shapes, bounds), rcs


@dataclass(frozen=True)
class Space:
    """What shapes the cluster and model allow: TP a power of two dividing heads, query groups and FFN, at most
    ``gpus_per_node``; DP dividing the micro-batch; TP groups (adjacent ranks) never straddle a node; and, when the
    cost model covers only some shapes (``allowed``), a stage's (per-rank batch ``mbs // dp``, tp) among them."""

    num_gpus: int
    gpus_per_node: int
    tps: tuple[int, ...]
    mbs_list: tuple[int, ...]
    num_units: int
    allowed: frozenset[tuple[int, int]] | None = None   # (per-rank batch, tp) a stage may use; None: any

    @classmethod
    def of(cls, model, cluster, training, micro_batch_sizes=None, allowed=None) -> Space:
        tps, t = [], 1
        while t <= cluster.gpus_per_node:
            if all(v % t == 0 for v in (model.num_attention_heads, model.groups, model.ffn_hidden_size)):
                tps.append(t)
            t *= 2
        mbs = sorted({m for m in (micro_batch_sizes or training.micro_batch_sizes)
                      if training.global_batch_size % m == 0})
        return cls(cluster.num_gpus, cluster.gpus_per_node, tuple(tps), tuple(mbs), model.num_units,
                   None if allowed is None else frozenset(allowed))

    def allows(self, tp: int, dp: int, mbs: int) -> bool:
        """Whether a stage of this (tp, dp) at pipeline micro-batch ``mbs`` is in the cost model's coverage."""
        return self.allowed is None or (mbs // dp, tp) in self.allowed

    def shapes(self, g: int, mbs: int) -> list[tuple[int, int]]:
        return [(tp, g // tp) for tp in self.tps
                if g % tp == 0 and mbs % (g // tp) == 0 and self.allows(tp, g // tp, mbs)]

    def valid_counts(self) -> list[int]:
        """GPU counts a stage can have under some micro-batch size."""
        return sorted({tp * dp for tp in self.tps for m in self.mbs_list for dp in range(1, m + 1)
                       if m % dp == 0 and tp * dp <= self.num_gpus and self.allows(tp, dp, m)})

    def candidate_shapes(self) -> set[tuple[int, int]]:
        """Every (per-rank batch, tp) a stage could use before ``allowed`` filters: what a report of the
        dropped ones compares against."""
        return {(m // dp, tp) for tp in self.tps for m in self.mbs_list for dp in range(1, m + 1)
                if m % dp == 0 and tp * dp <= self.num_gpus}

    def legal(self, state: State) -> bool:
        if sum(tp * dp for tp, dp in state.shapes) != self.num_gpus:
            return False
        if any(b <= a for a, b in zip(state.bounds[:-1], state.bounds[1:])):
            return False
        if state.bounds[0] != 0 or state.bounds[-1] != self.num_units:
            return False
        gpn = self.gpus_per_node
        for first, (tp, dp) in zip(state.first_ranks(), state.shapes):
            if tp not in self.tps or state.mbs % dp or not self.allows(tp, dp, state.mbs):
                return False
            for j in range(dp):
                lo = first + j * tp
                if lo // gpn != (lo + tp - 1) // gpn:
                    return False
        return True
