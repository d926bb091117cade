"""Exhaustive enumeration of every plan of a tiny problem: the reference the search is tested against.

Every number of stages, every split of the GPUs into stage sizes, every valid shape per stage, every legal pipeline
micro-batch (every stage's per-rank batch a candidate), every number of chunks and contiguous cut of the units
into them, every allowed combination of the plan-level switches; recompute per stage is either the exact optimiser
(``"optimal"``) or, for the tiniest cases, every per-unit assignment (``"brute"``). Cost grows exponentially: keep
it to a few GPUs/units.
"""

from __future__ import annotations

import itertools

import numpy as np

from .recompute import allowed_codes
from .space import Space
from .state import INF, Evaluation, Evaluator, State


def _compositions(n: int, k: int):
    for cuts in itertools.combinations(range(1, n), k - 1):
        parts = (0, *cuts, n)
        yield tuple(parts[i + 1] - parts[i] for i in range(k))


def enumerate_states(space: Space):
    U, N = space.num_units, space.num_gpus
    for S in range(1, min(N, U) + 1):
        for counts in _compositions(N, S):
            shape_opts = [space.stage_shapes(g) for g in counts]
            if any(not o for o in shape_opts):
                continue
            for shapes in itertools.product(*shape_opts):
                for mbs in space.legal_mbs(shapes):
                    for v in space.vs:
                        for feats in space.features:
                            for cuts in itertools.combinations(range(1, U), S * v - 1):
                                st = space.normalize(State(mbs, tuple(shapes), (0, *cuts, U), feats))
                                if space.legal(st):
                                    yield st


def _brute_stage(cm, i, S, first, a, b, tp, dp, mbs):
    best_cost, best_rc = None, None
    for rc in itertools.product(*allowed_codes(cm.model, a, b)):
        rc = np.array(rc, np.int8)
        c = cm.stage_cost(i, S, first, a, b, tp, dp, rc, mbs)
        if c.fits and (best_cost is None or c.time_per_microbatch_ms < best_cost.time_per_microbatch_ms - 1e-12):
            best_cost, best_rc = c, rc
    return best_cost, best_rc


def exhaustive_best(cm, gbs: int, space: Space, recompute: str = "optimal") -> tuple[float, State | None, int]:
    """(best iteration time, its state, number of plans enumerated); inf/None if nothing fits."""
    ev = Evaluator(cm, gbs, None, space.target, space.moe)
    best, best_state, n = INF, None, 0
    for st in enumerate_states(space):
        n += 1
        if recompute == "optimal":
            e: Evaluation = ev.evaluate(st, charge=False, exact=True)
            t = e.iteration_ms if e.fits else INF
        else:
            costs = []
            for i, r in enumerate(st.first_ranks()):
                tp, dp = st.shapes[i].tp, st.shapes[i].dp
                c, _ = _brute_stage(cm, i, st.num_stages, r, st.bounds[i], st.bounds[i + 1], tp, dp, st.mbs)
                if c is None:
                    break
                costs.append(c)
            t = cm.pipeline(costs, gbs // st.mbs).iteration_ms if len(costs) == st.num_stages else INF
        if t < best - 1e-12:
            best, best_state = t, st
    return best, best_state, n
