"""The best *uniform* Megatron configuration under the same cost model: what a tuned Megatron-LM user runs.

Grid: pipeline stages ``pp`` (dividing the GPUs), and on every stage the same ``tp`` (power of two within a node),
``cp`` (the candidates), ``dp = N / (pp tp cp)``, sequence parallelism on or off (where the space allows), one
per-rank ``--micro-batch-size`` (pipeline micro-batch ``b dp``), virtual stages ``v`` (layers split evenly over the
``pp v`` chunks), the plan-level switches (distributed optimizer, overlap), and Megatron-LM's recompute settings
(``megatron_lm``: none, selective, full uniform, full block N with the smallest N that fits). Layers are split
evenly; with ``v = 1`` and ``pp`` not dividing them, megatron-core's uneven split is allowed: the middle stages get
``m`` layers each and the first and last stages share the rest (``--decoder-first/last-pipeline-num-layers``).
T5 layers are counted encoder first, then decoder (2 and 3 units per layer).

MoE models: the grid runs at each shape's default expert folding (``Space.expert_fit``: etp 1, the largest ep of
the stage's GPUs, the least expert memory; SP on at tp > 1), and the best few configurations are then priced at
every other ``ep`` / ``etp`` (1 or tp) of their shape (``experts.ExpertSpace.options``) -- what an MoE user tunes
once the attention layout is chosen -- so the grid stays seconds; the recompute settings add selective
``core_attn moe_act`` (``megatron_lm.selective_settings``); the best few of those are priced under every token
dispatcher (``dispatchers``: alltoall, allgather, flex on CUDA; one per plan, as ``--moe-token-dispatcher-type``).

Branch and bound: every configuration gets a lower bound from its first and last stages without recompute
(no schedule beats a stage's own work, ``M (F + B) + sync``); they are evaluated in bound order until the bound
reaches the best time. The grid runs with the preferred switches (all on: the least memory); the best few
configurations are then evaluated under every allowed combination of switches (and, MoE, expert shapes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..costmodel.types import Shape
from .dispatchers import Dispatchers
from .megatron_lm import FULL_SETTING, NONE_SETTING, codes, expressible
from .space import Space, cut_points
from .state import INF, Evaluation, Evaluator, State, to_plan

REFINE_TOP = 6      # configurations re-evaluated under every combination of the plan-level switches


@dataclass
class BaselineResult:
    evaluation: Evaluation
    layers: tuple[int, ...]         # layers per model chunk, in model order
    evaluated: int                  # configurations priced in full

    @property
    def state(self) -> State:
        return self.evaluation.state

    @property
    def fits(self) -> bool:
        return self.evaluation.fits

    @property
    def iteration_ms(self) -> float:
        return self.evaluation.iteration_ms

    @property
    def shape(self) -> Shape:
        return self.state.shapes[0]

    @property
    def pp(self) -> int:
        return self.state.num_stages

    @property
    def tp(self) -> int:
        return self.shape.tp

    @property
    def dp(self) -> int:
        return self.shape.dp

    @property
    def cp(self) -> int:
        return self.shape.cp

    @property
    def mbs(self) -> int:
        """The pipeline micro-batch (as ``ParallelPlan.micro_batch_size``)."""
        return self.state.mbs

    @property
    def micro_batch_per_rank(self) -> int:
        """Megatron-LM's ``--micro-batch-size``."""
        return self.state.mbs // self.shape.dp

    @property
    def recompute(self) -> str:
        s = self.evaluation.setting
        return s.label if s is not None else "none"

    @property
    def bounds(self) -> tuple[int, ...]:
        return self.state.bounds

    @property
    def stage_total_ms(self) -> list[float]:
        return self.evaluation.stage_total_ms

    @property
    def stage_memory_mb(self) -> list[float]:
        return [s.cost.memory_mb for s in self.evaluation.stages]

    def describe(self) -> str:
        s, st = self.shape, self.state
        parts = [f"pp {self.pp}", f"tp {s.tp}"] + ([f"cp {s.cp}"] if s.cp > 1 else []) + \
            [f"dp {s.dp}"] + ([f"ep {s.ep}", f"etp {s.expert_tp}"] if s.ep > 1 or s.etp else []) + \
            [f"mbs {self.micro_batch_per_rank}"] + (["sp"] if s.sp else []) + \
            ([f"vpp {st.num_chunks}"] if st.num_chunks > 1 else []) + \
            (["dist-opt"] if st.features.distributed_optimizer else []) + \
            (["overlap"] if st.features.overlap_grad_reduce else []) + \
            ([f"fsdp {st.features.fsdp}"] if st.features.fsdp else []) + \
            ([f"offload {st.features.offload_layers}"] if st.features.offload_layers else []) + \
            [f"recompute {self.recompute}"]
        return " ".join(parts)


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


def uniform_states(space: Space, model, features=None):
    """Every uniform configuration of the grid as (state, layers per chunk)."""
    starts = space.layer_starts or cut_points(model)
    L = len(starts) - 1
    N = space.num_gpus
    feats = features or space.features[0]
    for pp in range(1, min(N, L) + 1):
        if N % pp or (space.pps is not None and pp not in space.pps):
            continue
        g = N // pp
        for cp in space.cps:
            for tp in space.tps:
                if g % (tp * cp):
                    continue
                dp = g // (tp * cp)
                for sp in ((False,) if tp == 1 else space.sps):
                    shape = space.expert_fit(Shape(tp, dp, cp, sp))
                    if shape is None or not space.shape_ok(shape):
                        continue
                    for b in space.batches:
                        m = b * dp
                        if space.gbs and space.gbs % m:
                            continue
                        for v in space.vs:
                            splits = layer_splits(L, pp) if v == 1 else \
                                ([(L // (pp * v),) * (pp * v)] if pp > 1 and L % (pp * v) == 0 else [])
                            for split in splits:
                                cum = np.concatenate([[0], np.cumsum(split)])
                                st = space.normalize(State(m, (shape,) * pp, tuple(starts[int(c)] for c in cum),
                                                           feats))
                                if space.legal(st):
                                    yield st, tuple(split)


def _bound(ev: Evaluator, st: State) -> tuple[float, float]:
    """(time lower bound, least memory of the first/last stage's worst case): inf bound when it cannot fit."""
    M = ev.gbs // st.mbs
    firsts = st.first_ranks()
    lb, least = 0.0, 0.0
    for i in sorted({0, st.num_stages - 1}):
        spans = st.spans(i)
        none = ev.stage_with(st, i, firsts[i], codes(NONE_SETTING, ev.cm.model, spans)).cost
        if not np.isfinite(none.time_per_microbatch_ms):
            return INF, INF
        lb = max(lb, M * none.time_per_microbatch_ms + none.dp_sync_ms + none.optimizer_ms + none.prologue_ms)
        mem = none.memory_mb
        if not none.fits:
            full = ev.stage_with(st, i, firsts[i], codes(FULL_SETTING, ev.cm.model, spans)).cost
            mem = full.memory_mb
            if not full.fits:
                lb = INF
        least = max(least, mem)
    return lb, least


def best_uniform(cm, gbs: int, space: Space, model, runs: str = "megatron-lm") -> BaselineResult | None:
    """Best fitting uniform configuration, or the one with the least memory when none fits (iteration inf).
    ``runs``: who runs it (``aceso``: the aceso runtime, whose stack choices the MoE refinement keeps to)."""
    mspace = space if space.target == "megatron-lm" else replace(space, target="megatron-lm")
    ev = Evaluator(cm, gbs, None, mspace.evaluator_target, mspace.moe)
    cands, least = [], None
    for st, layers in uniform_states(mspace, model):
        lb, mem = _bound(ev, st)
        if lb < INF:
            cands.append((lb, st, layers))
        elif least is None or mem < least[0]:
            least = (mem, st, layers)
    cands.sort(key=lambda c: (c[0], c[1]))
    best, best_layers, n, done, unexpressed = None, None, 0, [], None
    for lb, st, layers in cands:
        if (best or unexpressed) is not None and lb >= (best or unexpressed[0]).iteration_ms:
            break
        e = ev.evaluate(st, charge=False)
        n += 1
        if e.fits and e.exact and expressible(ev, e):
            done.append((e, layers))
            if best is None or e.score < best.score:
                best, best_layers = e, layers
                ev.cutoff = e.iteration_ms
        elif best is None and e.fits and e.exact and (unexpressed is None or e.score < unexpressed[0].score):
            unexpressed = (e, layers)     # Megatron-LM runs none of the model's plans (the caller refused that
    if best is None:                      # target before): the best that fits, for the aceso runtime
        if unexpressed is not None:
            return BaselineResult(ev.evaluate(unexpressed[0].state, charge=False, exact=True), unexpressed[1], n)
        if least is None and not cands:
            return None
        st, layers = (least[1], least[2]) if least is not None else (cands[0][1], cands[0][2])
        return BaselineResult(ev.evaluate(st, charge=False, exact=True), layers, n)
    done.sort(key=lambda x: (x[0].score, x[0].state))
    disp = Dispatchers(cm, gbs, runs, mspace.moe, lambda _ev, c: expressible(ev, c), offload=False)
    refined = []        # MoE: the refined configurations, for the dispatcher choice below
    for e, layers in done[:REFINE_TOP]:    # every combination of the plan-level switches on the best few
        for st in _variants(mspace, e.state):
            c = ev.evaluate(st, charge=False)
            n += 1
            if c.fits and c.exact and (disp.active or c.score < best.score) and expressible(ev, c):
                if disp.active:
                    refined.append((c, layers))
                if c.score < best.score:
                    best, best_layers = c, layers
                    ev.cutoff = c.iteration_ms
    best = ev.evaluate(best.state, charge=False, exact=True)
    if disp.active:     # MoE: the best few of all that, under every other token dispatcher
        refined.sort(key=lambda x: (x[0].score, x[0].state))
        for e, layers in [(best, best_layers)] + refined[:REFINE_TOP]:
            c = disp.best(e)
            n += len(disp.evaluators)
            if c.score < best.score:
                best, best_layers = c, layers
    return BaselineResult(best, best_layers, n)


def _variants(space: Space, st: State):
    """The legal variants of a uniform state: every other combination of the plan-level switches, and (MoE) every
    other expert shape of its stage shape under each combination."""
    s = st.shapes[0]
    experts = [s._replace(ep=ep, etp=etp) for ep, etp in space.experts.options(s)] if space.experts else [s]
    for f in space.features:
        for x in experts:
            v = space.normalize(st._replace(shapes=(x,) * st.num_stages, features=f))
            if v != st and space.legal(v):
                yield v


def baseline_plan(res: BaselineResult, model, cluster, gbs: int, kind: str, attention: str | None = None):
    return to_plan(res.evaluation, model, cluster, gbs, kind, predicted=res.fits, attention=attention)
