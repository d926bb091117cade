"""Per-stage recompute: choose none / selective / full for every unit to minimise time under the memory limit.

The reference (Aceso, SPEC §3.8) switches recompute on greedily by op name until a stage fits; here it is solved.
With ``K = S - i`` micro-batches in flight on stage ``i`` under 1F1B, a stage's memory is

    mem(c) = base + K * sum_u act[u, c_u] + max_u peak[u, c_u]

(``base`` = everything recompute does not change, read off the cost model's all-``none`` evaluation), and its time
grows by ``sum_u rt[u, c_u]``. ``solve`` minimises the time exactly: for each candidate peak level P (a distinct
``peak`` value) the choices with ``peak <= P`` are allowed and the rest is a multiple-choice knapsack
``min sum rt  s.t.  sum act <= (limit - base - P) / K``. Units with identical rows (every layer of a stack) form one
*type*; a type's Pareto frontier of (activation, time) over its per-choice counts is built once per count and
cached, and two or more types are combined by a Minkowski sum plus a prefix-minimum query on the last type.
Frontiers longer than ``CAP`` points are thinned (only beyond ~100 identical units), which can cost at most the
time difference between two neighbouring frontier points; below that the result is exact (tests: brute force).
The choice is then checked with the cost model's own ``stage_cost`` and the budget tightened if they disagree.
"""

from __future__ import annotations

import weakref

import numpy as np

CAP = 256
_FRONTIERS: dict[tuple, list] = {}
# op-level models: cost model -> stage position/shape -> (unit stack and kind, choice) -> (dt, dmem)
_PROBES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _pareto(act: np.ndarray, t: np.ndarray, counts: np.ndarray, cap: int = CAP):
    order = np.lexsort((t, act))
    act, t, counts = act[order], t[order], counts[order]
    keep = np.ones(len(t), bool)
    if len(t) > 1:
        keep[1:] = t[1:] < np.minimum.accumulate(t)[:-1]
    act, t, counts = act[keep], t[keep], counts[keep]
    if len(t) > cap:  # thin: keep the cheapest point of each activation bucket (and both ends)
        edges = np.linspace(act[0], act[-1], cap)
        bucket = np.searchsorted(edges, act, side="right")
        last = np.ones(len(t), bool)
        last[:-1] = bucket[1:] != bucket[:-1]
        last[0] = True
        act, t, counts = act[last], t[last], counts[last]
    return act, t, counts


def _type_frontier(rt: np.ndarray, act: np.ndarray, allowed: tuple[bool, ...], n: int, cap: int = CAP):
    """Pareto frontier of n identical units: arrays (act, time, counts[m, 3]) sorted by act, time decreasing."""
    key = (rt.tobytes(), act.tobytes(), allowed, cap)
    lst = _FRONTIERS.get(key)
    if lst is None:
        if len(_FRONTIERS) > 4096:  # bounded: tables of many (batch, tp) pairs
            _FRONTIERS.clear()
        lst = _FRONTIERS[key] = [(np.zeros(1), np.zeros(1), np.zeros((1, 3), np.int64))]
    choices = [c for c in range(3) if allowed[c]]
    eye = np.eye(3, dtype=np.int64)
    while len(lst) <= n:
        a0, t0, c0 = lst[-1]
        a = np.concatenate([a0 + act[c] for c in choices])
        t = np.concatenate([t0 + rt[c] for c in choices])
        cnt = np.concatenate([c0 + eye[c] for c in choices])
        lst.append(_pareto(a, t, cnt, cap))
    return lst[n]


def solve(rt: np.ndarray, act: np.ndarray, peak: np.ndarray, inflight: int, budget: float, groups=None,
          cap: int = CAP):
    """Min ``sum rt[u, c_u]`` s.t. ``inflight * sum act[u, c_u] + max peak[u, c_u] <= budget``.

    Arrays are (n, 3). ``groups`` (optional, int per unit) says which units have identical rows (found by
    ``np.unique`` otherwise). Returns the int8 choice per unit, or None when nothing fits.
    """
    n = rt.shape[0]
    if n == 0:
        return np.zeros(0, np.int8) if budget >= 0 else None
    rows = np.concatenate([rt, act, peak], axis=1)
    if groups is None:
        types, inverse = np.unique(rows, axis=0, return_inverse=True)
    else:
        _, first, inverse = np.unique(groups, return_index=True, return_inverse=True)
        types = rows[first]
    inverse = inverse.ravel()
    counts = np.bincount(inverse, minlength=len(types))
    best_t, best = np.inf, None
    for P in np.unique(peak):
        allowed = types[:, 6:9] <= P
        if not allowed.any(axis=1).all():
            continue
        room = (budget - P) / inflight
        res = _solve_types(types, counts, allowed, room, cap)
        if res is not None and res[0] < best_t - 1e-12:
            best_t, best = res
    if best is None:
        return None
    out = np.zeros(n, np.int8)
    for ty, cnt in enumerate(best):  # deterministic: within a type, full first, then selective, then none
        idx = np.flatnonzero(inverse == ty)
        nf, ns = int(cnt[2]), int(cnt[1])
        out[idx[:nf]] = 2
        out[idx[nf:nf + ns]] = 1
    return out


def _solve_types(types, counts, allowed, room, cap):
    """Min time over per-type choice counts with total activation <= room: (time, counts[type, 3]) or None."""
    fronts = [_type_frontier(types[k, 0:3], types[k, 3:6], tuple(bool(x) for x in allowed[k]), int(counts[k]), cap)
              for k in range(len(types))]
    a, t, c = fronts[0][0], fronts[0][1], fronts[0][2][:, None, :]
    for fa, ft, fc in fronts[1:-1]:  # Minkowski sum of the frontiers of all types but the last
        ii, jj = np.meshgrid(np.arange(len(a)), np.arange(len(fa)), indexing="ij")
        ii, jj = ii.ravel(), jj.ravel()
        keep = a[ii] + fa[jj] <= room + 1e-9
        ii, jj = ii[keep], jj[keep]
        if not len(ii):
            return None
        a, t, c = _pareto(a[ii] + fa[jj], t[ii] + ft[jj], np.concatenate([c[ii], fc[jj][:, None, :]], axis=1), cap)
    if len(fronts) == 1:
        ok = np.flatnonzero(a <= room + 1e-9)
        return None if not len(ok) else (float(t[ok[-1]]), c[ok[-1]])
    la, lt, lc = fronts[-1]  # the last type: best partner for each point by binary search (lt decreases in la)
    j = np.searchsorted(la, room + 1e-9 - a, side="right") - 1
    ok = np.flatnonzero(j >= 0)
    if not len(ok):
        return None
    tot = t[ok] + lt[j[ok]]
    k = int(np.argmin(tot))
    i = ok[k]
    return float(tot[k]), np.concatenate([c[i], lc[j[i]][None]], axis=0)


def optimize_stage(cm, i, num_stages, first_rank, start, end, tp, dp, mbs, **kw):
    """Best recompute for one stage under ``cm.memory_limit_mb``: (codes, StageCost). If nothing fits, the codes
    of least memory (with ``fits`` False). ``kw`` (neighbour shapes) is passed to ``cm.stage_cost``."""
    n = end - start

    def cost(rc):
        return cm.stage_cost(i, num_stages, first_rank, start, end, tp, dp, rc, mbs, **kw)
    zero = np.zeros(n, np.int8)
    c0 = cost(zero)
    if c0.fits or not np.isfinite(c0.memory_mb):
        return zero, c0
    try:
        table = cm.unit_table(mbs // dp, tp)
    except NotImplementedError:
        kinds = [(u.stack, u.kind) for u in cm.model.units[start:end]]
        try:
            per_model = _PROBES.setdefault(cm, {})
        except TypeError:  # not weak-referenceable: no probe cache
            per_model = None
        key = (i, num_stages, first_rank, tp, dp, mbs, tuple(sorted(kw.items())))
        probes = per_model.setdefault(key, {}) if per_model is not None else None
        return _optimize_by_probing(cost, n, kinds, c0, cm.memory_limit_mb, probes)
    span = slice(start, end)
    rt, act, peak = table.recompute_ms[span], table.act_mb[span], table.peak_mb[span]
    full = np.full(n, 2, np.int8)
    c2 = cost(full)
    # calibrate the in-flight multiplier (K = S - i micro-batches, times any allocator slack) from two evaluations
    d_act = float(act[:, 0].sum() - act[:, 2].sum())
    k = ((c0.memory_mb - peak[:, 0].max()) - (c2.memory_mb - peak[:, 2].max())) / d_act if d_act > 0 else 0.0
    if not k > 0:
        k = float(num_stages - i)
    base = c0.memory_mb - k * float(act[:, 0].sum()) - float(peak[:, 0].max())
    budget = cm.memory_limit_mb - base
    for _ in range(4):
        rc = solve(rt, act, peak, k, budget)
        if rc is None:
            break
        c = cost(rc)
        if c.fits:
            return rc, c
        budget -= max(c.memory_mb - cm.memory_limit_mb, 1e-6)  # the surrogate was optimistic: tighten
    return full, c2 if c2.memory_mb <= c0.memory_mb else c0


def _optimize_by_probing(cost, n, kinds, c0, limit, probes=None):
    """For cost models without additive per-unit tables (aceso-compat: op-level recompute segments).

    Two candidate sources, the fastest fitting result wins:
    * a surrogate from probes: for each unit kind and choice, the time and memory change of switching one unit of
      that kind (``probes`` caches them for stages at the same position and shape), assumed additive, solved by
      ``solve`` with the savings re-scaled until the real model agrees, each result checked with ``cost``;
    * prefix families: the first k units at ``selective`` or ``full``, or all selective with the first k full;
      memory falls and time rises with k, so the smallest fitting k of each is found by bisection.
    """
    cands = []
    first = {}
    for u, k in enumerate(kinds):
        first.setdefault(k, u)
    d_t, d_m = {}, {}
    for k, u in first.items():
        for c in (1, 2):
            hit = probes.get((k, c)) if probes is not None else None
            if hit is None:
                rc = np.zeros(n, np.int8)
                rc[u] = c
                p = cost(rc)
                hit = (p.time_per_microbatch_ms - c0.time_per_microbatch_ms, p.memory_mb - c0.memory_mb)
                if probes is not None:
                    probes[k, c] = hit
            d_t[k, c], d_m[k, c] = hit
    rt = np.array([[0.0, d_t[k, 1], d_t[k, 2]] for k in kinds])
    act = np.array([[0.0, d_m[k, 1], d_m[k, 2]] for k in kinds])
    groups = np.array([list(first).index(k) for k in kinds])
    budget, scale, tried = limit - c0.memory_mb, 1.0, set()
    pred_full = float(act[:, 2].sum())
    if pred_full < 0:  # savings are not additive (recompute segments merge): calibrate on all-full
        scale = max((cost(np.full(n, 2, np.int8)).memory_mb - c0.memory_mb) / pred_full, 1.0)
    for _ in range(6):  # re-scale the probed savings by what the real model gives, keep every fitting result
        rc = solve(rt, act, np.zeros_like(act), 1, budget / scale, groups, cap=64)  # savings x scale
        if rc is None or rc.tobytes() in tried:
            break
        tried.add(rc.tobytes())
        c = cost(rc)
        if c.fits:
            cands.append((rc, c))
        predicted = float(act[np.arange(n), rc].sum())
        actual = c.memory_mb - c0.memory_mb
        if predicted < 0 and actual < 0:
            scale = scale * actual / (predicted * scale) if c.fits else scale * 0.97 * actual / (predicted * scale)
        else:
            break

    def make(k, kind):
        rc = np.full(n, 1 if kind == "sel+full" else 0, np.int8)
        rc[:k] = 1 if kind == "sel" else 2
        return rc
    for kind in (() if cands else ("sel", "full", "sel+full")):  # fallback when the surrogate found nothing
        top = cost(make(n, kind))
        if not top.fits:
            continue
        lo, hi, hit = 0, n, (make(n, kind), top)
        while lo < hi:  # smallest k that fits
            mid = (lo + hi) // 2
            c = cost(make(mid, kind))
            if c.fits:
                hi, hit = mid, (make(mid, kind), c)
            else:
                lo = mid + 1
        cands.append(hit)
    if not cands:
        rc = np.full(n, 2, np.int8)
        return rc, cost(rc)
    return min(cands, key=lambda x: x[1].time_per_microbatch_ms)


def refine_by_local_search(cost, rc: np.ndarray, current, max_passes: int = 20):
    """Best-improvement hill climbing over single-unit recompute changes, keeping the stage within its limit.

    Used on the final plans of op-level cost models, where ``solve`` works on a probed surrogate and is not exact.
    Returns (codes, StageCost), never worse than the input.
    """
    best_rc, best = rc.copy(), current
    for _ in range(max_passes):
        step = None
        for u in range(len(best_rc)):
            for v in range(3):
                if v == best_rc[u]:
                    continue
                trial = best_rc.copy()
                trial[u] = v
                c = cost(trial)
                if c.fits and c.time_per_microbatch_ms < (step or (None, best))[1].time_per_microbatch_ms - 1e-9:
                    step = (trial, c)
        if step is None:
            break
        best_rc, best = step
    return best_rc, best


def has_unit_tables(cm) -> bool:
    """Whether the cost model exposes additive per-unit tables (then ``optimize_stage`` is exact)."""
    try:
        cm.unit_table(1, 1)
        return True
    except NotImplementedError:
        return False
    except Exception:  # noqa: BLE001 - e.g. an unprofiled (batch, tp): tables exist for others
        return True
