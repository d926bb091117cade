"""Compact plan state for the search, the cached plan evaluator, and conversion to/from ``ParallelPlan``.

A search state is a tiny immutable tuple: the pipeline micro-batch, per-stage ``Shape(tp, dp, cp, sp, ep, etp)``, the
``S v + 1`` unit boundaries of the model chunks in model order (chunk ``k`` is chunk ``k // S`` of stage ``k % S``;
``v = 1``: one span per stage) and the plan-level ``Features``. A primitive builds a new state by replacing a few
entries (O(S), no deep copies), and the state itself is the key of the visited set.

Recompute is *not* part of the state. For the ``aceso`` target every stage is priced at its exact best recompute
(``recompute.optimize_stage``) for its position, shape, chunks, neighbours and features; for ``megatron-lm`` the
plan takes the fastest recompute setting Megatron-LM can express (``megatron_lm.best_setting``). Stage results are
cached by everything they depend on, so re-evaluating a state after a primitive costs only the stages it touched.

Pipelines are priced by the cost model's schedule recurrence over the ops (up to tens of milliseconds for long
pipelines with many micro-batches). A state whose lower bound (``lower_bound``: a stage's own work plus the pipeline
fill before and the drain after it, which no schedule beats; exact for identical stages) is not below ``cutoff``
(the search's best time) can never be accepted: it gets an estimate (``exact`` False: the bound or SPEC 3.6's
closed-form 1F1B time, its bubble divided by v) and is priced exactly only if it is ever needed (a restart, the
final plans). Models that price none of the v2 features (aceso-compat) and test models always get their own
pipeline.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..costmodel.types import RC, RC_CODE, Features, Shape, StageCost
from search.io.errors import AcesoError
from search.spec.plan import ChunkSpec, ParallelPlan, PlanPrediction, StageSpec
from search.settings.plan_settings import PlanSettings
from .recompute import optimize_stage
from .space import Space  # noqa: F401 - re-exported (the space lived here before)

INF = float("inf")
_ERRORS = (AcesoError, KeyError, ValueError, ZeroDivisionError, IndexError)


class State(NamedTuple):
    """One candidate plan: ``shapes[i]`` is stage i's ``Shape``; ``bounds`` the model chunks' unit boundaries."""

    mbs: int
    shapes: tuple[Shape, ...]
    bounds: tuple[int, ...]
    features: Features = Features()

    @property
    def num_stages(self) -> int:
        return len(self.shapes)

    @property
    def num_chunks(self) -> int:
        """Model chunks per stage (``v``)."""
        return (len(self.bounds) - 1) // len(self.shapes)

    def spans(self, i: int) -> tuple[tuple[int, int], ...]:
        """Stage i's chunks ``(start, end)``, its first chunk first."""
        S, b = len(self.shapes), self.bounds
        return tuple((b[j * S + i], b[j * S + i + 1]) for j in range(self.num_chunks))

    def gpus(self, i: int) -> int:
        return self.shapes[i].num_gpus

    def first_ranks(self) -> list[int]:
        out, r = [], 0
        for s in self.shapes:
            out.append(r)
            r += s.num_gpus
        return out

    def neighbours(self, i: int) -> tuple[Shape | None, Shape | None]:
        """The shapes stage i exchanges activations with (ring neighbours when interleaved)."""
        S = len(self.shapes)
        if S == 1:
            return None, None
        if self.num_chunks > 1:
            return self.shapes[i - 1], self.shapes[(i + 1) % S]
        return (self.shapes[i - 1] if i else None), (self.shapes[i + 1] if i < S - 1 else None)


@dataclass
class StageEval:
    cost: StageCost
    rc: np.ndarray          # int8 per unit of the stage's chunks, chunk after chunk


@dataclass
class Evaluation:
    """A state's evaluation: iteration time (inf if it does not fit), stages and their pipeline totals."""

    state: State
    iteration_ms: float
    fits: bool
    stages: list[StageEval]
    stage_total_ms: list[float]
    max_memory_mb: float
    raw_iteration_ms: float = INF   # the time even when the plan does not fit (reports, infeasible hints)
    exact: bool = True              # False: an interleaved estimate above the cutoff (never accepted as is)
    bubble_ms: float = 0.0
    setting: object = None          # megatron-lm target: the plan's recompute setting (megatron_lm.Setting)
    moe: object = None              # MoE models: the MoEPlanSettings it was priced under (None: the defaults)
    release: str | None = None      # the release it was priced at where not its cost model's (bridge_release.py)

    @property
    def score(self) -> tuple[int, float]:
        """Sort key: fitting plans by time first, then non-fitting ones by memory."""
        return (0, self.iteration_ms) if self.fits else (1, self.max_memory_mb)

    @property
    def rank(self) -> tuple:
        """Deterministic total order: score, then the plan-level switches on before off, then the state (its CUDA
        graphs' scopes by their count, then their sorted names: frozensets compare by inclusion, which orders
        neither of two scope sets that do not contain one another; fewer parts first keeps inclusion's order)."""
        st = self.state
        sk = st.features.stack
        if sk is not None:
            graphs = (len(sk.graphs), tuple(sorted(sk.graphs)))
            st = st._replace(features=st.features._replace(stack=sk._replace(graphs=graphs)))
        return (self.score, tuple(not x for x in st.features), st)


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


def _failed(n: int) -> StageEval:
    return StageEval(StageCost(fwd_ms=INF, bwd_ms=INF, recompute_ms=0.0, p2p_ms=0.0, memory_mb=INF, fits=False),
                     np.zeros(n, np.int8))


class Evaluator:
    """Evaluates states with a cost model; caches stage results and plan evaluations.

    ``target``: ``aceso`` (exact recompute per stage) or ``megatron-lm`` (the fastest Megatron-LM recompute
    setting for the whole plan). ``cutoff``: see the module docstring (the search keeps it at its best time).
    """

    def __init__(self, cost_model, global_batch_size: int, budget: Budget | None = None, target: str = "aceso",
                 moe=None):
        self.cm = cost_model
        self.moe = moe      # MoE models: the plan's MoEPlanSettings, passed to a cost model that takes them
        self.gbs = global_batch_size
        self.budget = budget
        # megatron-bridge: the Megatron-LM search, its plans also passing Bridge's capability rules (runs_on)
        self.runs_on = target if target != "aceso" else "megatron-lm"
        self.target = "megatron-lm" if target == "megatron-bridge" else target
        self.limit = float(cost_model.memory_limit_mb)
        self.cutoff = INF
        self._stages: dict[tuple, StageEval] = {}
        self._plans: dict[State, Evaluation] = {}
        self.on_plan: Callable[[Evaluation], None] | None = None   # told of every new or re-priced plan, in order
        self.span_prices: dict = {}     # the cut DP's span prices (polish._best_cut), shared by the plans it polishes
        try:
            params = inspect.signature(cost_model.stage_cost).parameters
        except (TypeError, ValueError):
            params = {}
        # a model that prices none of the v2 features (aceso-compat) is called as before them: positional only
        v1 = getattr(cost_model, "features", None) == frozenset()
        self.neighbours = "prev" in params and not v1   # prices re-sharding between stages of different shapes
        self.modern = "spans" in params and not v1      # takes cp, sp, spans, features (plan contract v2)
        self.experts = "ep" in params and not v1        # takes the expert shape ep, etp (plan contract v3; MoE)
        self.takes_moe = "moe" in params and not v1     # takes the MoE settings (dispatcher, overlaps)
        # megatron-core refuses full recompute under the EP overlap (moe_plan.overlap_ep_refusal): no stage takes it
        self.no_full = bool(getattr(moe, "overlap_ep_comm", False))
        # megatron-bridge: the Evaluator at the release of Bridge v0.6.0's form, made on first use (None: not yet;
        # False: none), for the candidates only that form runs (bridge_release.py)
        self.pipes = None

    # ----- one stage ----------------------------------------------------------------------------------------------
    def stage_args(self, st: State, i: int, first_rank: int, shape: Shape | None = None,
                   spans: tuple | None = None) -> tuple[tuple, dict]:
        """(positional, keyword) arguments of ``cm.stage_cost`` for stage i of ``st`` (recompute left out)."""
        S = st.num_stages
        shape = shape or st.shapes[i]
        spans = spans or st.spans(i)
        args = (i, S, first_rank, spans[0][0], spans[-1][1], shape.tp, shape.dp)
        kw: dict = {}
        if self.neighbours:
            prev, nxt = st.neighbours(i)
            kw = {"prev": prev, "next": nxt}
        if self.modern:
            kw.update(cp=shape.cp, sp=shape.sp, features=st.features, spans=spans if len(spans) > 1 else None)
        if self.experts and (shape.ep > 1 or shape.etp):
            kw.update(ep=shape.ep, etp=shape.etp)
        if self.takes_moe and self.moe is not None:
            kw["moe"] = self.moe
        return args, kw

    def stage(self, st: State, i: int, first_rank: int, shape: Shape | None = None,
              spans: tuple | None = None) -> StageEval:
        """Stage i of ``st`` (optionally at another shape or chunks) at its exact best recompute."""
        args, kw = self.stage_args(st, i, first_rank, shape, spans)
        key = (args, st.mbs, tuple(sorted(kw.items())))
        hit = self._stages.get(key)
        if hit is None:
            n = sum(b - a for a, b in (spans or st.spans(i)))
            try:
                rc, cost = optimize_stage(self.cm, *args, st.mbs, no_full=self.full_refused(st.features), **kw)
                hit = StageEval(cost, rc) if cost is not None and not self._refused(rc, st.features) else _failed(n)
            except _ERRORS:
                hit = _failed(n)
            self._stages[key] = hit
        return hit

    def stage_with(self, st: State, i: int, first_rank: int, rc: np.ndarray, spans: tuple | None = None,
                   shape: Shape | None = None) -> StageEval:
        """Stage i of ``st`` (optionally over other chunks, at another shape) with the given recompute codes
        (cached by them)."""
        args, kw = self.stage_args(st, i, first_rank, shape, spans)
        key = (args, st.mbs, tuple(sorted(kw.items())), rc.tobytes())
        hit = self._stages.get(key)
        if hit is None:
            try:
                hit = _failed(len(rc)) if self._refused(rc, st.features) else \
                    StageEval(self.cm.stage_cost(*args, rc, st.mbs, **kw), rc)
            except _ERRORS:
                hit = _failed(len(rc))
            self._stages[key] = hit
        return hit

    def _refused(self, rc, features=None) -> bool:
        """Recompute codes megatron-core would not run with the plan's MoE settings and switches (full recompute:
        ``full_refused``)."""
        return self.full_refused(features) and bool((np.asarray(rc) == RC_CODE["full"]).any())

    def full_refused(self, features=None) -> bool:
        """Whether megatron-core refuses full recompute in a state with these switches: under the MoE EP overlap
        (``moe_plan.overlap_ep_refusal``) or CUDA graphs of any scope but ``full_iteration`` (``stack.refusal``)."""
        sk = getattr(features, "stack", None)
        return self.no_full or (sk is not None and bool(sk.graphs) and "full_iteration" not in sk.graphs)

    # ----- a plan -------------------------------------------------------------------------------------------------
    def evaluate(self, state: State, charge: bool = True, exact: bool = False) -> Evaluation:
        """The state's evaluation (cached); ``exact``: never an interleaved estimate."""
        hit = self._plans.get(state)
        if hit is not None and (hit.exact or not exact):
            return hit
        if hit is None and charge and self.budget is not None:
            self.budget.charge()
        exact = exact or hit is not None
        if self.target == "megatron-lm":
            from .megatron_lm import best_setting
            ev = best_setting(self, state, exact)
        else:
            firsts = state.first_ranks()
            ev = self.assemble(state, [self.stage(state, i, r) for i, r in enumerate(firsts)], exact)
        self._plans[state] = ev
        if self.on_plan is not None:
            self.on_plan(ev)
        return ev

    def assemble(self, state: State, stages: list[StageEval], exact: bool = False) -> Evaluation:
        """An ``Evaluation`` from priced stages: the pipeline (estimated above the cutoff when interleaved)."""
        costs = [s.cost for s in stages]
        mem = max(c.memory_mb for c in costs)
        fits = all(c.fits for c in costs)
        if not all(np.isfinite(c.time_per_microbatch_ms) for c in costs):
            totals = [INF if not np.isfinite(c.time_per_microbatch_ms) else 0.0 for c in costs]
            return Evaluation(state, INF, False, stages, totals, mem, INF, moe=self.moe)
        it, totals, bubble, is_exact = self.pipeline(costs, self.gbs // state.mbs, exact)
        return Evaluation(state, it if fits else INF, fits, stages, totals, mem, it, is_exact, bubble, moe=self.moe)

    def pipeline(self, costs: list[StageCost], M: int, exact: bool = False):
        """(iteration ms, per-stage totals, bubble ms, exact) of priced stages (see the module docstring)."""
        if exact or not self.modern or not np.isfinite(self.cutoff):
            pipe = self.cm.pipeline(costs, M)
            return pipe.iteration_ms, list(pipe.stage_total_ms), pipe.bubble_ms, True
        bound, t, tail = lower_bound(costs, M)
        if bound < self.cutoff:
            pipe = self.cm.pipeline(costs, M)
            return pipe.iteration_ms, list(pipe.stage_total_ms), pipe.bubble_ms, True
        v = max(len(costs[0].chunk_fwd_ms), 1)
        flat = max((M - 1) * x + y for x, y in zip(t, tail)) + sum(t)   # SPEC 3.6's 1F1B time
        busy = [M * x + y for x, y in zip(t, tail)]
        est = max(bound, max(busy) + max(flat - max(busy), 0.0) / v)
        return est, [b + est - max(busy) for b in busy], est - max(busy), False

    def evaluations(self) -> list[Evaluation]:
        """Every plan evaluated so far, best first (ties by state, so the order is deterministic)."""
        return sorted(self._plans.values(), key=lambda e: e.rank)

    @property
    def num_evaluated(self) -> int:
        return len(self._plans)


def lower_bound(costs: list[StageCost], M: int) -> tuple[float, list[float], list[float]]:
    """(a lower bound of the iteration time under 1F1B or interleaved 1F1B, per-stage time per micro-batch,
    per-stage per-iteration tail). Stage i cannot start before its prologue nor before micro-batch 0 has passed the
    stages before it (their first chunk's forwards), then does ``M`` micro-batches of its own work; its DP sync and
    step follow, and stage 0's last backward comes after stage i's and those of the stages between (their first
    chunk's backwards). So ``T >= start_i + M t_i + max(tail_i, sum_{j<i} b_j + tail_0)`` for every i (with an
    optimizer barrier the step only comes later). Equals ``(M + p - 1)(F + B) + tail`` for identical stages."""
    t, tail, first_f, first_b = [], [], [], []
    for c in costs:
        if c.chunk_fwd_ms:
            t.append(sum(c.chunk_fwd_ms) + sum(c.chunk_bwd_ms))
            first_f.append(c.chunk_fwd_ms[0])
            first_b.append(c.chunk_bwd_ms[0])
        else:
            t.append(c.time_per_microbatch_ms)
            first_f.append(c.fwd_ms + c.p2p_ms / 2)
            first_b.append(c.bwd_ms + c.recompute_ms + c.p2p_ms / 2)
        tail.append(c.dp_sync_ms + c.optimizer_ms)
    bound = up_f = up_b = 0.0
    for i, c in enumerate(costs):
        start = max(c.prologue_ms, up_f)
        bound = max(bound, start + M * t[i] + max(tail[i], up_b + tail[0]))
        up_f += first_f[i]
        up_b += first_b[i]
    return bound, t, [x + c.prologue_ms for x, c in zip(tail, costs)]


def to_plan(ev: Evaluation, model, cluster, gbs: int, cost_model_kind: str, predicted: bool = True,
            attention: str | None = None, settings: PlanSettings | None = None) -> ParallelPlan:
    """Build the validated ``ParallelPlan`` of an (exact) evaluation, recompute from the stage results;
    ``settings``: what the search priced under (framework, release, recipe, ...; None: the runtime's), with the
    state's switches and MoE settings."""
    st = ev.state
    stages = []
    for i, s in enumerate(st.shapes):
        rc, pos, chunks = ev.stages[i].rc, 0, []
        for a, b in st.spans(i):
            chunks.append(ChunkSpec(start_unit=a, end_unit=b, recompute=[RC[c] for c in rc[pos:pos + b - a]],
                                    holds_only=None if b > a else "embedding" if a == 0 else "loss"))
            pos += b - a
        stages.append(StageSpec(num_gpus=s.num_gpus, tp=s.tp, cp=s.cp, dp=s.dp, sequence_parallel=s.sp,
                                chunks=chunks, ep=s.ep, etp=s.etp or None))
    pred = None
    if predicted:
        it = ev.raw_iteration_ms
        pred = PlanPrediction(cost_model=cost_model_kind, iteration_time_ms=round(it, 6),
                              samples_per_s=round(gbs / it * 1000, 6),
                              stage_time_ms=[round(t, 6) for t in ev.stage_total_ms],
                              stage_memory_mb=[round(s.cost.memory_mb, 6) for s in ev.stages], attention=attention)
    base = settings if settings is not None else PlanSettings()
    if ev.release is not None:      # priced at another release than the search's (bridge_release.py)
        base = base.model_copy(update={"release": ev.release})
    return ParallelPlan(model=model, cluster=cluster, micro_batch_size=st.mbs, global_batch_size=gbs, stages=stages,
                        predicted=pred, settings=base.model_copy(update={**st.features.switches(), "moe": ev.moe}))


def from_plan(plan: ParallelPlan) -> tuple[State, list[np.ndarray]]:
    """A plan's state and its per-stage recompute codes (chunk after chunk). An expert tp equal to the stage's tp
    (``--expert-tensor-parallel-size 1`` at tp 1) is the state's code 0, as the search writes it (``experts.py``),
    so a plan that says it explicitly is the same state and inside the space."""
    shapes = tuple(_canonical(Shape.of(s)) for s in plan.stages)
    chunks = plan.chunks_in_order()
    bounds = tuple([c.start_unit for _, _, c in chunks] + [chunks[-1][2].end_unit])
    rcs = [np.array([RC_CODE[r] for r in s.all_recompute], dtype=np.int8) for s in plan.stages]
    return State(plan.micro_batch_size, shapes, bounds, Features.of_plan(plan)), rcs


def _canonical(s: Shape) -> Shape:
    """``s`` with etp code 0 where its expert tp equals its tp."""
    return s._replace(etp=0) if s.etp == s.tp else s
