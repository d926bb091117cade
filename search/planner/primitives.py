"""Aceso's primitives (SPEC §4.5) over compact states; each returns new, *legal* states (possibly none).

* ``move_units``: move units off the bottleneck's edge towards the stage with the most spare time (or the least
  memory when over the limit): to the neighbour only, or cascaded through every stage up to that partner; the
  amount comes from the time goals ``t_b - r (t_b - t_p)``, r in {0.5, 0.25}, plus one unit and one layer.
* ``rebalance``: re-cut all stages so that their compute is balanced *by cost* at their current shapes.
* ``inc_tp`` / ``inc_dp``: double the bottleneck's TP or DP, taking the GPUs from the least loaded stages (each
  donor halves its TP or DP, whichever its estimated time prefers); ``dec_tp`` / ``dec_dp``: the reverse, giving
  the freed GPUs to the most loaded stage that can use them.
* ``tp_to_dp`` / ``dp_to_tp``: trade a factor two between TP and DP on the bottleneck, same GPUs.
* ``inc_mbs`` / ``dec_mbs``: next / previous micro-batch size; every stage keeps its GPUs and takes its best valid
  shape for the new size.
Recompute has no primitive: every stage of every state is evaluated at its exact best recompute.
"""

from __future__ import annotations

import numpy as np

from .state import Evaluation, Evaluator, Space, State


class Ctx:
    """What primitives need: the shape space and the evaluator (for per-stage estimates)."""

    def __init__(self, space: Space, evaluator: Evaluator):
        self.space, self.ev, self.cm = space, evaluator, evaluator.cm
        self._w: dict[tuple, np.ndarray] = {}

    def unit_cum(self, tp: int, dp: int, mbs: int) -> np.ndarray:
        """Prefix sums of per-unit fwd+bwd time at a shape."""
        key = (tp, dp, mbs)
        if key not in self._w:
            try:
                t = self.cm.unit_table(mbs // dp, tp)
                w = t.fwd_ms + t.bwd_ms
            except NotImplementedError:  # op-level cost models: price each unit as a one-unit stage
                w = np.array([self._unit_probe(u, tp, dp, mbs) for u in range(self.space.num_units)])
            self._w[key] = np.concatenate([[0.0], np.cumsum(w)])
        return self._w[key]

    def _unit_probe(self, u: int, tp: int, dp: int, mbs: int) -> float:
        try:
            c = self.cm.stage_cost(1, 3, 0, u, u + 1, tp, dp, np.zeros(1, np.int8), mbs)
            return c.fwd_ms + c.bwd_ms
        except Exception:  # noqa: BLE001 - unprofiled shapes: weight 1 keeps the cut by unit count
            return 1.0

    def stage_time(self, st: State, i: int, shape: tuple[int, int], first_rank: int) -> float:
        """Estimated per-micro-batch time of stage i of ``st`` at another shape (inf if it does not fit)."""
        S = st.num_stages
        e = self.ev.stage(i, S, first_rank, st.bounds[i], st.bounds[i + 1], shape[0], shape[1], st.mbs,
                          st.shapes[i - 1] if i > 0 else None, st.shapes[i + 1] if i < S - 1 else None)
        return e.cost.time_per_microbatch_ms if e.cost.fits else float("inf")


def _legal(ctx: Ctx, states) -> list[State]:
    out, seen = [], set()
    for s in states:
        if s is not None and s not in seen and ctx.space.legal(s):
            seen.add(s)
            out.append(s)
    return out


def _with_bounds(st: State, bounds) -> State:
    return State(st.mbs, st.shapes, tuple(int(x) for x in bounds))


def move_units(ctx: Ctx, ev: Evaluation, b: int) -> list[State]:
    st, S = ev.state, ev.state.num_stages
    if S == 1:
        return []
    over = not ev.fits
    others = [i for i in range(S) if i != b]
    if over:
        p = min(others, key=lambda i: (ev.stages[i].cost.memory_mb, i))
    else:
        p = min(others, key=lambda i: (ev.stage_total_ms[i], i))
    d = 1 if p > b else -1
    tp, dp = st.shapes[b]
    cum = ctx.unit_cum(tp, dp, st.mbs)
    lo, hi = st.bounds[b], st.bounds[b + 1]
    n = hi - lo
    tb = ev.stages[b].cost.fwd_ms + ev.stages[b].cost.bwd_ms
    tpart = ev.stages[p].cost.fwd_ms + ev.stages[p].cost.bwd_ms
    ks = {1, 2}
    for r in (0.5, 0.25):
        goal = r * max(tb - tpart, 0.0)
        if d > 0:  # move units from the end of b: smallest k with sum of the last k units >= goal
            k = int(np.argmax(cum[hi] - cum[hi - np.arange(n + 1)] >= goal)) if goal > 0 else 1
        else:
            k = int(np.argmax(cum[lo + np.arange(n + 1)] - cum[lo] >= goal)) if goal > 0 else 1
        ks.add(max(k, 1))
    out = []
    for k in sorted(ks):
        if k >= n:
            continue
        bounds = list(st.bounds)
        edge = b + 1 if d > 0 else b
        bounds[edge] -= d * k
        out.append(_with_bounds(st, bounds))
        cascade = list(st.bounds)  # shift every boundary between b and p by k (each stage passes k on)
        for e in (range(b + 1, p + 1) if d > 0 else range(p + 1, b + 1)):
            cascade[e] -= d * k
        if cascade != bounds:
            out.append(_with_bounds(st, cascade))
    return _legal(ctx, out)


def balanced_bounds(ctx: Ctx, shapes, mbs: int, num_units: int) -> tuple[int, ...] | None:
    """Cut units so that the largest per-stage fwd+bwd (at each stage's shape) is minimal (greedy + bisection)."""
    S = len(shapes)
    cums = [ctx.unit_cum(tp, dp, mbs) for tp, dp in shapes]

    def cut(theta):
        bounds, a = [0], 0
        for i, cum in enumerate(cums):
            left = S - i - 1
            if left == 0:
                end = num_units
                if cum[end] - cum[a] > theta:
                    return None
            else:
                end = min(int(np.searchsorted(cum, cum[a] + theta, side="right")) - 1, num_units - left)
                if end < a + 1:
                    return None
            bounds.append(end)
            a = end
        return bounds

    lo = 0.0
    hi = max(c[-1] for c in cums)
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
    return tuple(best) if best else None


def rebalance(ctx: Ctx, ev: Evaluation, b: int) -> list[State]:
    st = ev.state
    bounds = balanced_bounds(ctx, st.shapes, st.mbs, st.bounds[-1])
    return _legal(ctx, [_with_bounds(st, bounds)] if bounds else [])


def _shrink_options(ctx: Ctx, st: State, i: int, first: int):
    tp, dp = st.shapes[i]
    opts = [(tp // 2, dp)] if tp > 1 else []
    opts += [(tp, dp // 2)] if dp > 1 else []
    opts = [o for o in opts if o[0] in ctx.space.tps and st.mbs % o[1] == 0]
    return sorted(opts, key=lambda o: (ctx.stage_time(st, i, o, first), o))


def _grow(ctx: Ctx, ev: Evaluation, b: int, kind: str) -> list[State]:
    st = ev.state
    tp, dp = st.shapes[b]
    new = (tp * 2, dp) if kind == "tp" else (tp, dp * 2)
    if new[0] not in ctx.space.tps or st.mbs % new[1]:
        return []
    need = tp * dp
    shapes = list(st.shapes)
    shapes[b] = new
    firsts = st.first_ranks()
    freed = 0
    for d in sorted((i for i in range(st.num_stages) if i != b), key=lambda i: (ev.stage_total_ms[i], i)):
        half = st.gpus(d) // 2
        if half == 0 or freed + half > need:
            continue
        opts = _shrink_options(ctx, st, d, firsts[d])
        if not opts:
            continue
        shapes[d] = opts[0]
        freed += half
        if freed == need:
            s2 = State(st.mbs, tuple(shapes), st.bounds)
            bal = balanced_bounds(ctx, s2.shapes, st.mbs, st.bounds[-1])
            return _legal(ctx, [s2] + ([_with_bounds(s2, bal)] if bal else []))
    return []


def _shrink(ctx: Ctx, ev: Evaluation, b: int, kind: str) -> list[State]:
    st = ev.state
    tp, dp = st.shapes[b]
    new = (tp // 2, dp) if kind == "tp" else (tp, dp // 2)
    if new[0] * new[1] * 2 != tp * dp or new[0] < 1 or new[1] < 1:
        return []
    freed = tp * dp // 2
    out = []
    for c in sorted((i for i in range(st.num_stages) if i != b), key=lambda i: (-ev.stage_total_ms[i], i)):
        g = st.gpus(c) + freed
        shapes = list(st.shapes)
        shapes[b] = new
        for shape in ctx.space.shapes(g, st.mbs):
            shapes[c] = shape
            s2 = State(st.mbs, tuple(shapes), st.bounds)
            if ctx.space.legal(s2):
                out.append(s2)
        if out:
            break
    return _legal(ctx, out)


def _exchange(ctx: Ctx, ev: Evaluation, b: int, to: str) -> list[State]:
    st = ev.state
    tp, dp = st.shapes[b]
    new = (tp // 2, dp * 2) if to == "dp" else (tp * 2, dp // 2)
    if new[0] < 1 or new[1] < 1 or new[0] not in ctx.space.tps or st.mbs % new[1]:
        return []
    shapes = list(st.shapes)
    shapes[b] = new
    return _legal(ctx, [State(st.mbs, tuple(shapes), st.bounds)])


def _mbs(ctx: Ctx, ev: Evaluation, b: int, step: int) -> list[State]:
    st = ev.state
    lst = ctx.space.mbs_list
    k = lst.index(st.mbs) + step
    if not 0 <= k < len(lst):
        return []
    mbs = lst[k]
    probe = State(mbs, st.shapes, st.bounds)
    firsts = st.first_ranks()
    shapes = []
    for i in range(st.num_stages):
        opts = ctx.space.shapes(st.gpus(i), mbs)
        if not opts:
            return []
        shapes.append(min(opts, key=lambda o: (ctx.stage_time(probe, i, o, firsts[i]), o)))
    out = [State(mbs, tuple(shapes), st.bounds)]
    if all(mbs % dp == 0 for _, dp in st.shapes):
        out.append(probe)
    return _legal(ctx, out)


APPLY = {
    "move_units": move_units,
    "rebalance": rebalance,
    "inc_tp": lambda c, e, b: _grow(c, e, b, "tp"),
    "inc_dp": lambda c, e, b: _grow(c, e, b, "dp"),
    "dec_tp": lambda c, e, b: _shrink(c, e, b, "tp"),
    "dec_dp": lambda c, e, b: _shrink(c, e, b, "dp"),
    "tp_to_dp": lambda c, e, b: _exchange(c, e, b, "dp"),
    "dp_to_tp": lambda c, e, b: _exchange(c, e, b, "tp"),
    "inc_mbs": lambda c, e, b: _mbs(c, e, b, +1),
    "dec_mbs": lambda c, e, b: _mbs(c, e, b, -1),
}
