"""Aceso's primitives (SPEC §4.5) over compact states, plus the modern-Megatron ones; each returns new, *legal*
states (possibly none).

Partition (units, or whole layers for ``megatron-lm``: the cut positions are ``Ctx.positions``):

* ``move_units``: move units off the bottleneck's edge towards the stage with the most spare time (or the least
  memory when over the limit): to the neighbour only, or cascaded through every stage up to that partner; the
  amount comes from the time goals ``t_b - r (t_b - t_p)``, r in {0.5, 0.25}, plus one and two steps. Interleaved:
  from each of the bottleneck's chunks to the adjacent model chunk on the less loaded neighbour stage.
* ``rebalance``: re-cut all chunks so that their compute is balanced *by cost* at their stages' shapes.

Shapes (``shapes.py``): ``inc_tp`` / ``inc_dp`` / ``dec_tp`` / ``dec_dp`` (GPUs between stages), ``tp_to_dp`` /
``dp_to_tp``, ``dp_to_cp`` / ``cp_to_dp`` (same GPUs), ``sp_on`` / ``sp_off``. Plan-wide: ``inc_mbs`` /
``dec_mbs`` (the pipeline micro-batch), ``inc_vpp`` / ``dec_vpp`` (model chunks per stage, re-cut balanced),
``features_on`` / ``features_off`` (one plan-level switch). Expert shapes (MoE, ``expert_moves.py``): ``inc_ep`` /
``dec_ep``, ``etp_1`` / ``etp_tp``, ``tp_to_ep`` / ``ep_to_tp`` (same GPUs). Recompute has no primitive: every state
is priced at its best recompute (``state.Evaluator``).
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from .recompute import has_unit_tables, table_kwargs
from .space import Space
from .state import Evaluation, Evaluator, State


class Ctx:
    """What primitives need: the space, the evaluator (for per-stage estimates), cut positions, unit costs."""

    def __init__(self, space: Space, evaluator: Evaluator):
        self.space, self.ev, self.cm = space, evaluator, evaluator.cm
        self._w: dict[tuple, np.ndarray] = {}
        U = space.num_units
        self.positions = np.array(space.layer_starts if space.target == "megatron-lm" and space.layer_starts
                                  else range(U + 1), dtype=np.int64)
        self.index = {int(x): i for i, x in enumerate(self.positions)}
        self.tables = has_unit_tables(self.cm)

    def unit_cum(self, shape, mbs: int) -> np.ndarray:
        """Prefix sums of per-unit fwd+bwd time at a shape (at the stage's per-rank batch)."""
        key = (shape, mbs)
        if key not in self._w:
            tp, dp = shape[0], shape[1]
            kw = table_kwargs(self.cm, dict(zip(("cp", "sp", "ep", "etp"), shape[2:])))
            try:
                t = self.cm.unit_table(mbs // dp, tp, **kw)
                w = t.fwd_ms + t.bwd_ms
            except NotImplementedError:  # op-level cost models: price each unit as a one-unit stage
                w = np.array([self._unit_probe(u, tp, dp, mbs) for u in range(self.space.num_units)])
            except Exception:  # noqa: BLE001 - an unprofiled shape: weight 1 keeps the cut by unit count
                w = np.ones(self.space.num_units)
            self._w[key] = np.concatenate([[0.0], np.cumsum(w)])
        return self._w[key]

    def _unit_probe(self, u: int, tp: int, dp: int, mbs: int) -> float:
        try:
            c = self.cm.stage_cost(1, 3, 0, u, u + 1, tp, dp, np.zeros(1, np.int8), mbs)
            return c.fwd_ms + c.bwd_ms
        except Exception:  # noqa: BLE001 - unprofiled shapes: weight 1 keeps the cut by unit count
            return 1.0

    def stage_time(self, st: State, i: int, shape, first_rank: int) -> float:
        """Estimated per-micro-batch time of stage i of ``st`` at another shape (inf if it does not fit): with
        additive unit tables, the time without recompute if it fits, else with full recompute (an upper bound of
        the exact best, two cheap evaluations); op-level models price the exact best (as the reference does)."""
        if self.tables:
            n = sum(b - a for a, b in st.spans(i))
            for code in (0, 2):
                c = self.ev.stage_with(st, i, first_rank, np.full(n, code, np.int8), shape=shape).cost
                if c.fits:
                    return c.time_per_microbatch_ms
            return float("inf")
        e = self.ev.stage(st, i, first_rank, shape=shape)
        return e.cost.time_per_microbatch_ms if e.cost.fits else float("inf")


def legal(ctx: Ctx, states) -> list[State]:
    out, seen = [], set()
    for s in states:
        if s is None:
            continue
        s = ctx.space.normalize(s)
        if s not in seen and ctx.space.legal(s):
            seen.add(s)
            out.append(s)
    return out


def _with_bounds(st: State, bounds) -> State:
    return st._replace(bounds=tuple(int(x) for x in bounds))


# ----- partition ----------------------------------------------------------------------------------------------------
def _goal_steps(cumP: np.ndarray, lo: int, hi: int, goal: float, from_end: bool) -> int:
    """Fewest cut steps whose units cost at least ``goal`` off the end (or start) of positions [lo, hi]."""
    if goal <= 0:
        return 1
    n = hi - lo
    if from_end:
        k = int(np.argmax(cumP[hi] - cumP[hi - np.arange(n + 1)] >= goal))
    else:
        k = int(np.argmax(cumP[lo + np.arange(n + 1)] - cumP[lo] >= goal))
    return max(k, 1)


def move_units(ctx: Ctx, ev: Evaluation, b: int) -> list[State]:
    st, S = ev.state, ev.state.num_stages
    if S == 1:
        return []
    if st.num_chunks > 1:
        return _move_chunk_units(ctx, ev, b)
    over = not ev.fits
    others = [i for i in range(S) if i != b]
    if over:
        p = min(others, key=lambda i: (ev.stages[i].cost.memory_mb, i))
    else:
        p = min(others, key=lambda i: (ev.stage_total_ms[i], i))
    d = 1 if p > b else -1
    cumP = ctx.unit_cum(st.shapes[b], st.mbs)[ctx.positions]
    idx = [ctx.index[x] for x in st.bounds]
    lo, hi = idx[b], idx[b + 1]
    n = hi - lo
    tb = ev.stages[b].cost.fwd_ms + ev.stages[b].cost.bwd_ms
    tpart = ev.stages[p].cost.fwd_ms + ev.stages[p].cost.bwd_ms
    ks = {1, 2}
    for r in (0.5, 0.25):
        ks.add(_goal_steps(cumP, lo, hi, r * max(tb - tpart, 0.0), d > 0))
    out = []
    for k in sorted(ks):
        if k >= n:
            continue
        moved = list(idx)
        edge = b + 1 if d > 0 else b
        moved[edge] -= d * k
        out.append(_with_bounds(st, ctx.positions[moved]))
        cascade = list(idx)  # shift every boundary between b and p by k (each stage passes k on)
        for e in (range(b + 1, p + 1) if d > 0 else range(p + 1, b + 1)):
            cascade[e] -= d * k
        if cascade != moved:
            out.append(_with_bounds(st, ctx.positions[cascade]))
    return legal(ctx, out)


def _move_chunk_units(ctx: Ctx, ev: Evaluation, b: int) -> list[State]:
    """Interleaved: each chunk of stage b gives units to the adjacent model chunk on the less loaded of its two
    neighbour stages (b - 1 and b + 1, ring order)."""
    st, S, v = ev.state, ev.state.num_stages, ev.state.num_chunks
    up, down = (b + 1) % S, (b - 1) % S
    key = ev.stage_total_ms if ev.fits else [s.cost.memory_mb for s in ev.stages]
    d = 1 if (key[up], up) <= (key[down], down) else -1
    p = up if d > 0 else down
    cumP = ctx.unit_cum(st.shapes[b], st.mbs)[ctx.positions]
    idx = [ctx.index[x] for x in st.bounds]
    tb = ev.stages[b].cost.fwd_ms + ev.stages[b].cost.bwd_ms
    tpart = ev.stages[p].cost.fwd_ms + ev.stages[p].cost.bwd_ms
    out = []
    for j in range(v):
        k = j * S + b
        if (d > 0 and k == S * v - 1) or (d < 0 and k == 0):
            continue
        lo, hi = idx[k], idx[k + 1]
        ks = {1, 2, _goal_steps(cumP, lo, hi, 0.5 * max(tb - tpart, 0.0) / v, d > 0)}
        for n in sorted(ks):
            if n >= hi - lo:
                continue
            moved = list(idx)
            moved[k + 1 if d > 0 else k] -= d * n
            out.append(_with_bounds(st, ctx.positions[moved]))
    return legal(ctx, out)


def balanced_bounds(ctx: Ctx, shapes, mbs: int, num_units: int, v: int = 1) -> tuple[int, ...] | None:
    """Cut the units into ``len(shapes) * v`` model chunks (chunk k on stage k % S) at ``ctx.positions`` so that
    the largest chunk's fwd+bwd at its stage's shape is minimal (greedy + bisection)."""
    S = len(shapes)
    P = ctx.positions
    cums = {s: ctx.unit_cum(s, mbs)[P].tolist() for s in set(shapes)}
    seq = [cums[shapes[k % S]] for k in range(S * v)]
    last = len(P) - 1
    if last < S * v:
        return None
    n = S * v

    def cut(theta):
        bounds, a = [0], 0
        for k, cum in enumerate(seq):
            left = n - k - 1
            if left == 0:
                end = last
                if cum[end] - cum[a] > theta:
                    return None
            else:
                end = min(bisect_right(cum, cum[a] + theta) - 1, last - left)
                if end < a + 1:
                    return None
            bounds.append(end)
            a = end
        return bounds

    lo = 0.0
    hi = max(c[-1] for c in seq)
    best = cut(hi)
    for _ in range(60):
        if hi - lo <= 1e-7 * hi:
            break
        mid = (lo + hi) / 2
        r = cut(mid)
        if r is None:
            lo = mid
        else:
            hi, best = mid, r
    return tuple(int(P[x]) for x in best) if best else None


def rebalance(ctx: Ctx, ev: Evaluation, b: int) -> list[State]:
    st = ev.state
    bounds = balanced_bounds(ctx, st.shapes, st.mbs, st.bounds[-1], st.num_chunks)
    return legal(ctx, [_with_bounds(st, bounds)] if bounds else [])


# ----- plan-wide ----------------------------------------------------------------------------------------------------
def _mbs(ctx: Ctx, ev: Evaluation, b: int, step: int) -> list[State]:
    """The next pipeline micro-batch up (down): at the same shapes (every per-rank batch scaled alike), and with
    every stage at its best shape of the same GPUs for twice (half) the micro-batch (aceso target)."""
    st, sp = ev.state, ctx.space
    out = []
    same = [m for m in sp.legal_mbs(st.shapes) if (m > st.mbs if step > 0 else m < st.mbs)]
    if same:
        out.append(st._replace(mbs=same[0] if step > 0 else same[-1]))
    m2 = st.mbs * 2 if step > 0 else st.mbs // 2
    if sp.target == "aceso" and m2 >= 1 and (step > 0 or st.mbs % 2 == 0) and (not sp.gbs or sp.gbs % m2 == 0):
        probe = st._replace(mbs=m2)
        firsts = st.first_ranks()
        cp = st.shapes[0].cp if sp.uniform_cp else None
        shapes = []
        for i, s in enumerate(st.shapes):
            opts = sp.shapes(s.num_gpus, m2, cp=cp if cp is not None else s.cp, sp=s.sp, old=s)
            if not opts:
                shapes = None
                break
            shapes.append(min(opts, key=lambda o: (ctx.stage_time(probe, i, o, firsts[i]), o)))
        if shapes:
            out.append(st._replace(mbs=m2, shapes=tuple(shapes)))
    return legal(ctx, out)


def _vpp(ctx: Ctx, ev: Evaluation, b: int, step: int) -> list[State]:
    """The next (previous) number of model chunks per stage, chunks re-cut balanced by cost; the pipeline
    micro-batch moves to the closest one whose micro-batch count the stages divide when it must."""
    st, sp = ev.state, ctx.space
    if st.num_stages < 2:
        return []
    out = []
    for v in vpp_steps(sp, st.num_stages, st.num_chunks, step):
        bounds = balanced_bounds(ctx, st.shapes, st.mbs, sp.num_units, v)
        if bounds is None:
            continue
        mbs = st.mbs
        if v > 1 and sp.gbs and (sp.gbs // mbs) % st.num_stages:
            ok = [m for m in sp.legal_mbs(st.shapes) if (sp.gbs // m) % st.num_stages == 0]
            if not ok:
                return []
            mbs = min(ok, key=lambda x: (max(x / mbs, mbs / x), x))
        out.append(st._replace(mbs=mbs, bounds=bounds))
    return legal(ctx, out)


JUMP_CHUNKS = 128    # inc_vpp jumps straight to one layer per chunk only up to this many chunks (balancing cost)


def vpp_steps(sp, S: int, v: int, step: int) -> list[int]:
    """The chunk counts ``inc_vpp`` (``dec_vpp``) tries from v on S stages: the next (previous) candidate, the one
    nearest to twice (half) v, and the most (fewest) chunks -- one layer per chunk, while the plan has at most
    ``JUMP_CHUNKS`` chunks -- so that every degree the space holds is a move or a few away however many there are
    (the uniform baseline prices every even-split degree exactly, and seeds the searches)."""
    top = (len(sp.layer_starts) - 1 if sp.target == "megatron-lm" and sp.layer_starts else sp.num_units) // S
    layer_top = (len(sp.layer_starts) - 1) // S if sp.layer_starts else top
    vs = [x for x in sp.vs if x <= top and (x > v if step > 0 else x < v)]
    if not vs:
        return []
    if step > 0:
        whole = [x for x in vs if x <= layer_top and S * x <= JUMP_CHUNKS]
        picks = [vs[0], min(vs, key=lambda x: (abs(x - 2 * v), x))] + ([whole[-1]] if whole else [])
    else:
        picks = [vs[-1], min(vs, key=lambda x: (abs(2 * x - v), -x)), vs[0]]
    return sorted(set(picks), key=picks.index)


def _features(ctx: Ctx, ev: Evaluation, b: int, on: bool) -> list[State]:
    """Turn one plan-level switch on (off): the allowed combinations nearest to the current one that add (drop)
    switches."""
    st = ev.state
    f = st.features
    cands = []
    for g in ctx.space.features:
        if g == f:
            continue
        added = [bool(x) and not y for x, y in zip(g, f)]
        dropped = [bool(y) and not x for x, y in zip(g, f)]
        if (on and any(added) and not any(dropped)) or (not on and any(dropped) and not any(added)):
            cands.append((sum(added) + sum(dropped), g))
    if not cands:
        return []
    near = min(d for d, _ in cands)
    return legal(ctx, [st._replace(features=g) for d, g in cands if d == near])


def _registry():
    from . import shapes as sh
    from .expert_moves import MOVES
    return {
        "move_units": move_units,
        "rebalance": rebalance,
        "inc_tp": lambda c, e, b: sh.grow(c, e, b, "tp"),
        "inc_dp": lambda c, e, b: sh.grow(c, e, b, "dp"),
        "dec_tp": lambda c, e, b: sh.shrink(c, e, b, "tp"),
        "dec_dp": lambda c, e, b: sh.shrink(c, e, b, "dp"),
        "tp_to_dp": lambda c, e, b: sh.exchange(c, e, b, "tp_to_dp"),
        "dp_to_tp": lambda c, e, b: sh.exchange(c, e, b, "dp_to_tp"),
        "inc_mbs": lambda c, e, b: _mbs(c, e, b, +1),
        "dec_mbs": lambda c, e, b: _mbs(c, e, b, -1),
        "sp_on": lambda c, e, b: sh.toggle_sp(c, e, b, True),
        "sp_off": lambda c, e, b: sh.toggle_sp(c, e, b, False),
        "dp_to_cp": lambda c, e, b: sh.exchange(c, e, b, "dp_to_cp"),
        "cp_to_dp": lambda c, e, b: sh.exchange(c, e, b, "cp_to_dp"),
        "inc_vpp": lambda c, e, b: _vpp(c, e, b, +1),
        "dec_vpp": lambda c, e, b: _vpp(c, e, b, -1),
        "features_on": lambda c, e, b: _features(c, e, b, True),
        "features_off": lambda c, e, b: _features(c, e, b, False),
        **MOVES,
    }


APPLY = _registry()
