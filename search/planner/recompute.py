"""Per-stage recompute: choose none / selective / full / attn_dropout / mla_up_proj for every unit to minimise time under the
memory limit (a choice a unit cannot take has ``UNAVAILABLE_MS`` recompute time and is never considered).

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

import functools
import inspect
import itertools
import math
import weakref
from collections.abc import Iterator

import numpy as np

from ..costmodel.types import ATTN_DROPOUT, MLA_UP_PROJ, N_RC, RC, RC_CODE, UNAVAILABLE_MS
from search.spec.plan import recompute_allowed

CAP = 256
COUNT_CAP = 4000      # most assignments ``refine_by_counts`` evaluates for one stage
PEAK_QUANTUM = 0.02   # probed transient peaks are rounded up to this share of the memory limit
_EYE = np.eye(N_RC, dtype=np.int64)
FILL_ORDER = (2, 1, ATTN_DROPOUT, MLA_UP_PROJ)   # within a type of identical units: full first, then the rest
_FRONTIERS: dict[tuple, list] = {}
# op-level models: cost model -> stage position/shape -> ((stack, kind), choice, probed on two units) ->
# (dt, dmem per unit, transient peak); and the results of op-level stages: cost model -> (position/shape, stage
# signature) -> (codes, StageCost), bounded by MEMO_LIMIT (an exact memo: clearing it changes nothing)
_PROBES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
MEMO_LIMIT = 50_000
_KINDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # cost model -> its units' kind numbers


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


def _thin_edges(lo: float, hi: float, cap: int) -> np.ndarray:
    """``np.linspace(lo, hi, cap)``, bit for bit, without its per-call overhead (it runs once per frontier step)."""
    div = cap - 1
    delta = hi - lo
    step = delta / div
    y = np.arange(cap, dtype=float)
    y = y / div * delta if step == 0 else y * step
    y += lo
    y[-1] = hi
    return y


def _frontier_step(z: np.ndarray, counts: np.ndarray, moves_z: np.ndarray, moves_counts: np.ndarray, cap: int):
    """One more identical unit. A frontier is ``z`` = act + i time (complex: numpy sorts it by act, then time,
    as ``_pareto``'s lexsort) sorted with time decreasing, and ``counts`` per point; ``moves_z`` / ``moves_counts``
    hold one row per allowed choice. The same points, order and thinning as ``_pareto`` over the concatenated
    candidates, in a handful of numpy calls."""
    cand = (moves_z[:, None] + z[None, :]).ravel()
    src = np.argsort(cand, kind="stable")
    cand = cand[src]
    if len(cand) > 1:
        t = cand.imag
        keep = np.empty(len(cand), bool)
        keep[0] = True
        keep[1:] = t[1:] < np.minimum.accumulate(t)[:-1]
        cand, src = cand[keep], src[keep]
    if len(cand) > cap:  # thin: keep the cheapest point of each activation bucket (and both ends)
        act = cand.real
        bucket = np.searchsorted(_thin_edges(float(act[0]), float(act[-1]), cap), act, side="right")
        last = np.empty(len(act), bool)
        last[:-1] = bucket[1:] != bucket[:-1]
        last[-1] = True
        last[0] = True
        cand, src = cand[last], src[last]
    choice, parent = np.divmod(src, len(z))
    return cand, counts[parent] + moves_counts[choice]


def _complex(act, t) -> np.ndarray:
    z = np.empty(len(act), complex)
    z.real, z.imag = act, t
    return z


def _type_frontier(rt: np.ndarray, act: np.ndarray, allowed: tuple[bool, ...], n: int, cap: int = CAP,
                   row_key: bytes | None = None):
    """Pareto frontier of n identical units: arrays (act, time, counts[m, N_RC]) sorted by act, time decreasing.

    Built once per unit count and cached (``_FRONTIERS``): each count extends the previous one by one unit
    (``_frontier_step``); the arrays handed out are made on the first request of a count."""
    key = (row_key or rt.tobytes() + act.tobytes(), allowed, cap)
    lst = _FRONTIERS.get(key)
    if lst is None:
        if len(_FRONTIERS) > 4096:  # bounded: tables of many (batch, tp) pairs
            _FRONTIERS.clear()
        lst = _FRONTIERS[key] = [[np.zeros(1, complex), np.zeros((1, N_RC), np.int32), None]]
    if len(lst) <= n:
        choices = [c for c in range(N_RC) if allowed[c]]
        moves_z, moves_counts = _complex(act[choices], rt[choices]), _EYE[choices].astype(np.int32)
        z, counts = lst[-1][:2]
        while len(lst) <= n:
            z, counts = _frontier_step(z, counts, moves_z, moves_counts, cap)
            lst.append([z, counts, None])
    entry = lst[n]
    if entry[2] is None:
        z = entry[0]
        entry[2] = (z.real.copy(), z.imag.copy(), entry[1].astype(np.int64))
    return entry[2]


def solve(rt: np.ndarray, act: np.ndarray, peak: np.ndarray, inflight: int, budget: float, groups=None,
          cap: int = CAP):
    """Min ``sum rt[u, c_u]`` s.t. ``inflight * sum act[u, c_u] + max peak[u, c_u] <= budget``.

    Arrays are (n, N_RC). ``groups`` (optional, int per unit) says which units have identical rows (found by
    ``np.unique`` otherwise). Returns the int8 choice per unit, or None when nothing fits. Pure: results are
    memoised by the inputs (stages at different positions often pose the same problem).
    """
    key = (rt.tobytes(), act.tobytes(), peak.tobytes(), rt.shape, float(inflight), float(budget),
           None if groups is None else groups.tobytes(), cap)
    hit = _SOLVED.get(key, _MISS)
    if hit is _MISS:
        if len(_SOLVED) > 50_000:
            _SOLVED.clear()
        hit = _SOLVED[key] = _solve(rt, act, peak, inflight, budget, groups, cap)
    return None if hit is None else hit.copy()


_SOLVED: dict[tuple, np.ndarray | None] = {}
_MISS = object()


def _solve(rt, act, peak, inflight, budget, groups, cap):
    n = rt.shape[0]
    if n == 0:
        return np.zeros(0, np.int8) if budget >= 0 else None
    rows = np.concatenate([rt, act, peak], axis=1)
    if groups is None:
        types, inverse = np.unique(rows, axis=0, return_inverse=True)
        inverse = inverse.ravel()
        counts = np.bincount(inverse, minlength=len(types))
    else:
        first, inverse, counts = _grouping(groups)
        types = rows[first]
    best_t, best = np.inf, None
    available = types[:, :N_RC] < UNAVAILABLE_MS
    row_keys = [r.tobytes() for r in types[:, :2 * N_RC]]
    t_act = types[:, N_RC:2 * N_RC]
    for P in np.unique(np.where(available, types[:, 2 * N_RC:], 0.0)):
        allowed = (types[:, 2 * N_RC:] <= P) & available
        if not allowed.any(axis=1).all():
            continue
        room = (budget - P) / inflight
        if float((np.where(allowed, t_act, np.inf).min(axis=1) * counts).sum()) > room + 1e-9:
            continue   # even the least activation of every type does not fit
        res = _solve_types(types, counts, allowed, room, cap, row_keys)
        if res is not None and res[0] < best_t - 1e-12:
            best_t, best = res
    if best is None:
        return None
    out = np.zeros(n, np.int8)
    for ty, cnt in enumerate(best):  # deterministic: within a type, in FILL_ORDER, the rest none
        idx = np.flatnonzero(inverse == ty)
        k = 0
        for c in FILL_ORDER:
            out[idx[k:k + int(cnt[c])]] = c
            k += int(cnt[c])
    return out


def _solve_types(types, counts, allowed, room, cap, row_keys):
    """Min time over per-type choice counts with total activation <= room: (time, counts[type, N_RC]) or None."""
    fronts = [_type_frontier(types[k, :N_RC], types[k, N_RC:2 * N_RC], allow, int(counts[k]), cap, key)
              for k, (allow, key) in enumerate(zip(map(tuple, allowed.tolist()), row_keys))]
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


def optimize_stage(cm, i, num_stages, first_rank, start, end, tp, dp, mbs, no_full: bool = False, **kw):
    """Best recompute for one stage under ``cm.memory_limit_mb``: (codes, StageCost). If nothing fits, the codes
    of least memory (with ``fits`` False). ``kw`` (neighbour shapes, ``cp``, ``sp``, ``spans``, ``features``) is
    passed to ``cm.stage_cost``. ``no_full``: full recompute is not a choice (megatron-core refuses it under the
    MoE EP overlap, ``moe_plan.overlap_ep_refusal``); the knapsack then picks among the others.

    An interleaved stage (``spans``: its chunks) keeps ``n_j`` micro-batches of chunk j in flight
    (``memory.in_flight_per_chunk``): each unit's activations are weighed by its chunk's count, so identical units
    of different chunks are different types of the knapsack.
    """
    spans = kw.get("spans") or ((start, end),)
    idx = np.concatenate([np.arange(a, b) for a, b in spans])
    n = len(idx)

    def cost(rc):
        return cm.stage_cost(i, num_stages, first_rank, start, end, tp, dp, rc, mbs, **kw)
    zero = np.zeros(n, np.int8)
    c0 = cost(zero)
    if c0.fits or not np.isfinite(c0.memory_mb):
        return zero, c0
    tkw = table_kwargs(cm, kw)
    try:
        table = cm.unit_table(mbs // dp, tp, **tkw)
    except NotImplementedError:
        return _optimize_op_level(cm, cost, c0, i, num_stages, first_rank, start, end, tp, dp, mbs, kw)
    rt, act, peak = table.recompute_ms[idx], table.act_mb[idx], table.peak_mb[idx]
    if no_full:
        rt = rt.copy()
        rt[:, 2] = UNAVAILABLE_MS
    groups = _unit_types(table)[idx]
    full = np.full(n, 2, np.int8)
    c2 = cost(full)
    if len(spans) > 1:  # per-unit weights: the in-flight count of the unit's chunk
        from ..costmodel.memory import in_flight_per_chunk
        M = kw.get("num_micro_batches") or cm.training.global_batch_size // mbs
        counts = in_flight_per_chunk(i, num_stages, len(spans), M)
        w = np.concatenate([np.full(b - a, float(c)) for (a, b), c in zip(spans, counts)])
        act = act * w[:, None]
        groups = groups * (max(counts) + 1) + w.astype(np.int64)   # a type per (unit type, in-flight count)
    # calibrate the in-flight multiplier (K = S - i micro-batches, times any allocator slack) from two evaluations
    d_act = float(act[:, 0].sum() - act[:, 2].sum())
    k = ((c0.memory_mb - peak[:, 0].max()) - (c2.memory_mb - peak[:, 2].max())) / d_act if d_act > 0 else 0.0
    if not k > 0:
        k = float(num_stages - i) if len(spans) == 1 else 1.0
    base = c0.memory_mb - k * float(act[:, 0].sum()) - float(peak[:, 0].max())
    budget = cm.memory_limit_mb - base
    for _ in range(4):
        rc = solve(rt, act, peak, k, budget, groups)
        if rc is None:
            break
        c = cost(rc)
        if c.fits:
            return rc, c
        budget -= max(c.memory_mb - cm.memory_limit_mb, 1e-6)  # the surrogate was optimistic: tighten
    if no_full:     # nothing fits: the least-memory codes without full (each unit's smallest available choice)
        keep = np.where(rt < UNAVAILABLE_MS / 2, act, np.inf)
        least = keep.argmin(axis=1).astype(np.int8)
        c = cost(least)
        return (least, c) if c.memory_mb <= c0.memory_mb else (zero, c0)
    return full, c2 if c2.memory_mb <= c0.memory_mb else c0


_TYPES: dict[int, tuple] = {}
_GROUPINGS: dict[bytes, tuple] = {}


def _grouping(groups: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first unit of each type, type of each unit, units per type) of integer group labels, cached."""
    key = groups.tobytes()
    hit = _GROUPINGS.get(key)
    if hit is None:
        if len(_GROUPINGS) > 4096:
            _GROUPINGS.clear()
        _, first, inverse = np.unique(groups, return_index=True, return_inverse=True)
        inverse = inverse.ravel()
        hit = _GROUPINGS[key] = (first, inverse, np.bincount(inverse, minlength=len(first)))
    return hit


def _unit_types(table) -> np.ndarray:
    """Per unit of a ``UnitTable``: the id of its (recompute ms, activations, peak) row, in the rows' sorted order
    (so a span's types come out as ``np.unique`` over its rows would give them), cached per table."""
    hit = _TYPES.get(id(table))
    if hit is None or hit[0] is not table:
        if len(_TYPES) > 4096:
            _TYPES.clear()
        rows = np.concatenate([table.recompute_ms, table.act_mb, table.peak_mb], axis=1)
        _, inverse = np.unique(rows, axis=0, return_inverse=True)
        hit = _TYPES[id(table)] = (table, inverse.ravel().astype(np.int64))
    return hit[1]


def _optimize_op_level(cm, cost, c0, i, num_stages, first_rank, start, end, tp, dp, mbs, kw):
    """``_optimize_by_probing`` with the probe cache of the stage's position and shape, and a memo of results.

    The memo is exact: a cost model with ``stage_signature(start, end)`` says which spans have the same content
    (aceso-compat: the same op sequence), and such spans at one position and shape get the same result, because
    ``stage_cost`` and the probes they read are the same (probes are only added, never changed)."""
    try:
        per_model, memo = _PROBES.setdefault(cm, {}), _MEMO.setdefault(cm, {})
    except TypeError:  # not weak-referenceable: no probe cache, no memo
        per_model = memo = None
    key = (i, num_stages, first_rank, tp, dp, mbs, tuple(sorted(kw.items())))
    memo_key = None
    if memo is not None and hasattr(cm, "stage_signature"):
        memo_key = (key, cm.stage_signature(start, end))
        hit = memo.get(memo_key)
        if hit is not None:
            return hit
    probes = per_model.setdefault(key, {}) if per_model is not None else None
    out = _optimize_by_probing(cost, end - start, _span_kinds(cm, start, end), c0, cm.memory_limit_mb, probes)
    if memo_key is not None:
        if len(memo) >= MEMO_LIMIT:
            memo.clear()
        out[0].setflags(write=False)  # shared by every span with this content
        memo[memo_key] = out
    return out


def _span_kinds(cm, start: int, end: int) -> tuple[np.ndarray, list]:
    """The units ``[start, end)`` of ``cm.model`` by kind ``(stack, kind)``: (the kind number of each unit, kinds
    numbered in order of first appearance; those kinds). The model's numbering is made once per cost model."""
    hit = _KINDS.get(cm) if _weakrefable(cm) else None
    if hit is None:
        kinds = list(dict.fromkeys((u.stack, u.kind) for u in cm.model.units))
        number = {k: j for j, k in enumerate(kinds)}
        hit = (kinds, np.array([number[u.stack, u.kind] for u in cm.model.units], np.int64))
        if _weakrefable(cm):
            _KINDS[cm] = hit
    kinds, ids = hit
    ids = ids[start:end]
    present, first = np.unique(ids, return_index=True)
    order = present[np.argsort(first)]
    renumber = np.zeros(len(kinds), np.int64)
    renumber[order] = np.arange(len(order))
    return renumber[ids], [kinds[j] for j in order]


def _weakrefable(obj) -> bool:
    try:
        weakref.ref(obj)
        return True
    except TypeError:
        return False


def _optimize_by_probing(cost, n, span_kinds, c0, limit, probes=None):
    """For cost models without additive per-unit tables (aceso-compat: op-level recompute segments).

    Two candidate sources, the fastest fitting result wins:
    * a surrogate from probes: for each unit kind and choice, the time and memory change of switching one and two
      units of that kind (``probes`` caches them for stages at the same position and shape). The difference of the
      two is the per-unit saving, the rest the choice's transient peak (a max, not a sum); solved by ``solve`` with
      the savings re-scaled until the real model agrees, each result checked with ``cost``;
    * prefix families: the first k units at ``selective`` or ``full``, or all selective with the first k full;
      memory falls and time rises with k, so the smallest fitting k of each is found by bisection.

    ``span_kinds`` = (kind number per unit, numbered in order of first appearance; the kinds): ``_span_kinds``.
    """
    cands = []
    groups, names = span_kinds
    num_units = np.bincount(groups, minlength=len(names))
    # per kind and choice (columns: none = 0, then choices 1..): time and memory per unit, transient peak
    k_t, k_m, k_p = (np.zeros((len(names), N_RC)) for _ in range(3))
    for g, k in enumerate(names):
        first_two = None
        for c in range(1, N_RC):
            if RC[c] not in recompute_allowed(k[1]):
                k_t[g, c] = UNAVAILABLE_MS
                continue
            two = bool(num_units[g] > 1)
            hit = probes.get((k, c, two)) if probes is not None else None
            if hit is None:
                if first_two is None:
                    first_two = np.flatnonzero(groups == g)[:2]
                hit = _probe(cost, n, first_two, c, c0)
                if probes is not None:
                    probes[k, c, two] = hit
            k_t[g, c], k_m[g, c], k_p[g, c] = hit
    quantum = limit * PEAK_QUANTUM   # rounded up to a few levels: ``solve`` tries each distinct peak
    rt, act, peak = k_t[groups], k_m[groups], (np.ceil(k_p / quantum) * quantum)[groups]
    budget, scale, tried = limit - c0.memory_mb, 1.0, set()
    for _ in range(6):  # re-scale the probed savings by what the real model gives, keep every fitting result
        rc = solve(rt, act * scale, peak, 1, budget, groups, cap=64)
        if rc is None or rc.tobytes() in tried:
            break
        tried.add(rc.tobytes())
        c = cost(rc)
        if c.fits:
            cands.append((rc, c))
        idx = np.arange(n)
        predicted = float(act[idx, rc].sum())
        actual = c.memory_mb - c0.memory_mb - float(peak[idx, rc].max())
        if c.fits or predicted >= 0 or actual >= 0:
            break
        scale *= 0.97 * actual / (predicted * scale)   # the surrogate was optimistic: trust savings less

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


def _probe(cost, n, units, c, c0) -> tuple[float, float, float]:
    """(time per unit, memory per unit, transient peak) of choice c from switching one, then two, units."""
    rc = np.zeros(n, np.int8)
    rc[units[0]] = c
    one = cost(rc)
    dt, dm1 = one.time_per_microbatch_ms - c0.time_per_microbatch_ms, one.memory_mb - c0.memory_mb
    if len(units) < 2:
        return dt, dm1, 0.0
    rc[units[1]] = c
    dm2 = cost(rc).memory_mb - c0.memory_mb
    per_unit = dm2 - dm1
    return dt, per_unit, max(dm1 - per_unit, 0.0)


def refine_by_local_search(cost, rc: np.ndarray, current, allowed, max_passes: int = 20):
    """Best-improvement hill climbing over single-unit recompute changes, keeping the stage within its limit;
    ``allowed[u]`` = the codes unit u can take.

    Used on the final plans of op-level cost models, where ``solve`` works on a probed surrogate and is not exact.
    Returns (codes, StageCost), never worse than the input.
    """
    best_rc, best = rc.copy(), current
    for _ in range(max_passes):
        step = None
        for u in range(len(best_rc)):
            for v in allowed[u]:
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


def refine_by_counts(cost, rc: np.ndarray, current, kinds, allowed, cap: int = COUNT_CAP):
    """Exact over how many units of each kind take each choice (op-level models, final plans).

    Units of one kind (``kinds[u]``, e.g. (stack, kind)) cost the same, so an assignment is mostly fixed by its
    per-kind choice counts; within a kind the choices go to units in ``FILL_ORDER`` (placement only matters where
    recompute segments of neighbouring units merge). Enumerates every count vector when there are at most ``cap``
    of them, else returns the input. Returns (codes, StageCost), never worse than the input.
    """
    number, assignments = count_assignments(kinds, allowed)
    if number > cap:
        return rc, current
    best_rc, best = rc, current
    for trial in assignments:
        c = cost(trial)
        if c.fits and c.time_per_microbatch_ms < best.time_per_microbatch_ms - 1e-9:
            best_rc, best = trial, c
    return best_rc, best


def count_assignments(kinds, allowed) -> tuple[int, Iterator[np.ndarray]]:
    """(how many, an iterator over) the codes of every per-kind choice count: units of one kind (``kinds[u]``)
    take the chosen choices in ``FILL_ORDER``, the rest none; ``allowed[u]`` = the codes unit u can take.

    The number is counted, not enumerated (``C(n + c - 1, c - 1)`` multisets per kind of n units and c codes), so
    asking for it costs nothing even when there are millions of assignments; the iterator builds them lazily."""
    groups: dict = {}
    for u, k in enumerate(kinds):
        groups.setdefault(k, []).append(u)
    kinds_codes = [(units, [c for c in (*FILL_ORDER, 0) if c in allowed[units[0]]]) for units in groups.values()]
    number = math.prod(math.comb(len(units) + len(codes) - 1, len(codes) - 1) for units, codes in kinds_codes)

    def each() -> Iterator[np.ndarray]:
        options = [[(units, combo) for combo in itertools.combinations_with_replacement(codes, len(units))]
                   for units, codes in kinds_codes]
        for pick in itertools.product(*options):
            trial = np.zeros(len(kinds), np.int8)
            for units, combo in pick:
                trial[units] = combo
            yield trial
    return number, each()


def table_kwargs(cm, kw: dict) -> dict:
    """The keywords of ``cm.unit_table`` for a stage's ``kw`` (``Evaluator.stage_args``), so the table is the one
    ``stage_cost`` prices the stage with: cp and sp where not the default, transformer-engine TP overlap (the plan's
    switch, on SP stages), the expert shape (ep, etp) and the MoE settings; each only where the cost model's
    ``unit_table`` takes it (the synthetic models take batch and tp only)."""
    want: dict = {}
    if kw.get("cp") not in (None, 1):
        want["cp"] = kw["cp"]
    if kw.get("sp") is True:            # a bool: ``True in (1,)`` holds, so no membership test
        want["sp"] = True
        f = kw.get("features")
        if f is not None and f.tp_comm_overlap:
            want["tp_overlap"] = True
    if kw.get("ep", 1) > 1 or kw.get("etp"):
        want.update(ep=kw.get("ep", 1), etp=kw.get("etp", 0))
    if kw.get("moe") is not None:
        want["moe"] = kw["moe"]
    if not want:
        return want
    takes = _unit_table_params(cm)
    return {k: v for k, v in want.items() if k in takes}


def _unit_table_params(cm) -> frozenset[str]:
    """The keywords ``cm.unit_table`` takes (its class's method: asked once per class, not once per stage)."""
    method = getattr(type(cm), "unit_table", None)
    if method is None or "unit_table" in getattr(cm, "__dict__", {}):
        return _signature_params(getattr(cm, "unit_table", None))
    return _class_params(type(cm))


@functools.lru_cache(maxsize=None)
def _class_params(cls) -> frozenset[str]:
    return _signature_params(cls.unit_table) - {"self"}


def _signature_params(fn) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (AttributeError, TypeError, ValueError):
        return frozenset()


def has_unit_tables(cm) -> bool:
    """Whether the cost model exposes additive per-unit tables (then ``optimize_stage`` is exact)."""
    try:
        cm.unit_table(1, 1)
        return True
    except NotImplementedError:
        return False
    except Exception:  # noqa: BLE001 - e.g. an unprofiled (batch, tp): tables exist for others
        return True


def allowed_codes(model, start: int, end: int, no_full: bool = False) -> list[tuple[int, ...]]:
    """Per unit of ``[start, end)``: the recompute codes it can take (``search.spec.plan.recompute_allowed``; ``no_full``:
    without full, as under the MoE EP overlap)."""
    return [tuple(RC_CODE[c] for c in recompute_allowed(u.kind, model) if not (no_full and c == "full"))
            for u in model.units[start:end]]
