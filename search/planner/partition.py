"""Exact contiguous partition of units over fixed stage shapes, minimising the 1F1B iteration time.

For S stages with fixed GPU shapes, stage i covering units ``[a, b)`` costs ``t_i(a, b)`` per micro-batch (its best
recompute included) and ``A_i(a, b) = (M - 1) t_i(a, b) + sync_i(a, b)`` for its steady state. The 1F1B iteration
time (Aceso / SPEC §3.6, plus the per-iteration DP sync) is

    T = max_i A_i + sum_i t_i.

The max makes the objective non-separable, so, as in Alpa's stage construction (Zheng et al., OSDI'22, §5.2), we
enumerate the threshold ``theta`` over the distinct ``A`` values in increasing order and, for each, solve
``min sum t_i`` subject to every ``A_i <= theta`` by a DP over boundaries; ``T* = min theta + F(theta)``. The
enumeration stops once ``theta`` alone reaches the best ``T`` found. ``best_partition`` is a pure function over the
candidate spans (sparse arrays per stage, so a caller may restrict boundaries to a window).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Spans:
    """Candidate spans of one stage: starts ``a``, ends ``b`` (exclusive), per-micro-batch ``t``, steady ``A``."""

    a: np.ndarray
    b: np.ndarray
    t: np.ndarray
    A: np.ndarray


def _dp(num_units: int, stages: list[Spans], theta: float):
    """min sum t under A <= theta; returns (value, bounds) or (inf, None)."""
    f = np.full(num_units + 1, np.inf)
    f[0] = 0.0
    back = []
    for sp in stages:
        ok = sp.A <= theta
        cand = f[sp.a[ok]] + sp.t[ok]
        g = np.full(num_units + 1, np.inf)
        arg = np.full(num_units + 1, -1)
        if len(cand):
            order = np.lexsort((sp.a[ok], cand))[::-1]  # write worst first so the best (then lowest a) wins
            g[sp.b[ok][order]] = cand[order]
            arg[sp.b[ok][order]] = sp.a[ok][order]
        back.append(arg)
        f = g
    if not np.isfinite(f[num_units]):
        return np.inf, None
    bounds = [num_units]
    for arg in reversed(back):
        bounds.append(int(arg[bounds[-1]]))
    return float(f[num_units]), tuple(reversed(bounds))


def best_partition(num_units: int, stages: list[Spans]):
    """The partition minimising ``max_i A_i + sum_i t_i``: (T, bounds) or (inf, None) if none is feasible."""
    thetas = np.unique(np.concatenate([sp.A[np.isfinite(sp.A)] for sp in stages]))
    lower = max((float(sp.A[np.isfinite(sp.A)].min()) if np.isfinite(sp.A).any() else np.inf) for sp in stages)
    best, best_bounds = np.inf, None
    for theta in thetas[thetas >= lower]:
        if theta >= best:
            break
        _val, bounds = _dp(num_units, stages, theta)
        if bounds is not None:
            true = _objective(stages, bounds)
            if true < best:
                best, best_bounds = true, bounds
    return best, best_bounds


def _objective(stages: list[Spans], bounds) -> float:
    tot, mx = 0.0, -np.inf
    for sp, a, b in zip(stages, bounds[:-1], bounds[1:]):
        k = np.flatnonzero((sp.a == a) & (sp.b == b))[0]
        tot += sp.t[k]
        mx = max(mx, sp.A[k])
    return float(mx + tot)


def brute_force_partition(num_units: int, stages: list[Spans]):
    """Every composition of the units into len(stages) non-empty spans (for tests)."""
    import itertools
    S = len(stages)
    lut = [{(int(a), int(b)): (float(t), float(A)) for a, b, t, A in zip(sp.a, sp.b, sp.t, sp.A)} for sp in stages]
    best, best_bounds = np.inf, None
    for cuts in itertools.combinations(range(1, num_units), S - 1):
        bounds = (0, *cuts, num_units)
        vals = [lut[i].get((bounds[i], bounds[i + 1])) for i in range(S)]
        if any(v is None or not np.isfinite(v[0]) for v in vals):
            continue
        T = max(v[1] for v in vals) + sum(v[0] for v in vals)
        if T < best:
            best, best_bounds = T, bounds
    return best, best_bounds
