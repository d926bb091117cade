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


# ----- the Megatron-LM space at bench scale (docs/search.md "The exhaustive bound") ------------------------------
def megatron_lm_states(space: Space, ctx):
    """Every state of a ``--target megatron-lm`` space (one stage shape for every pipeline rank) with its cuts
    balanced by cost (``primitives.balanced_bounds``): every pp dividing the GPUs (``--pp`` kept), every stage shape
    of the space (tp, cp, sequence parallelism) with every expert shape (ep, etp: ``ExpertSpace.options``), every
    legal micro-batch, every number of model chunks (interleaving where megatron-core runs it), every combination of
    the plan-level switches. ``ctx``: a ``primitives.Ctx`` of the space (its unit costs give the cuts)."""
    from .primitives import balanced_bounds
    N, L, U = space.num_gpus, len(space.layer_starts) - 1, space.num_units
    for S in range(1, min(N, L) + 1):
        if N % S or (space.pps is not None and S not in space.pps) or (space.max_stages and S > space.max_stages):
            continue
        for base in space.stage_shapes(N // S):
            shapes_e = [base._replace(ep=e, etp=c) for e, c in space.experts.options(base)] if space.experts \
                else [base]
            for sh in (s for s in shapes_e if space.shape_ok(s)):
                shapes = (sh,) * S
                for mbs in space.legal_mbs(shapes):
                    for v in space.vs:
                        if v > 1 and (S < 2 or (space.gbs and (space.gbs // mbs) % S) or S * v > L):
                            continue
                        bounds = balanced_bounds(ctx, shapes, mbs, U, v)
                        if bounds is None:
                            continue
                        for f in space.features:
                            st = space.normalize(State(mbs, shapes, bounds, f))
                            if space.legal(st):
                                yield st


def megatron_lm_bound(cm, gbs: int, spaces: list[Space], stacks=(None,),
                      max_spans: int = 3000) -> tuple[Evaluation | None, int]:
    """(the fastest plan of ``spaces`` that Megatron-LM runs, states priced): the reference the search's
    ``--target megatron-lm`` result is compared with on real models (``bench/hybrid_published.py --exhaustive``),
    where ``exhaustive_best``'s every-cut enumeration is out of reach.

    ``spaces``: one Megatron-LM space per MoE setting to enumerate (``dispatchers.candidates``: each dispatcher,
    with and without the EP overlap; one space for a dense model); ``stacks``: the stack switches each state is
    priced under (``StackKey``s; None: the space's own, e.g. none; ``dispatchers.graph_candidates`` and a published
    plan's CUDA graphs). Every state of ``megatron_lm_states`` at its fastest Megatron-LM recompute setting
    (``megatron_lm.best_setting``); a state whose balanced cut is below the best so far (its lower bound, as the
    search prices) then gets the search's exact cut refinements (``polish.polish``: the optimal layer cut for one
    chunk per stage; ``polish_chunks`` for interleaved plans); a plan counts only where the export's check
    (``megatron_lm.expressible``) and the plan's own rules (megatron-core's refusals) pass. Exact over every
    dimension but the cuts: those are the balanced cut and its refinements, so a plan whose best cut is far from
    balanced can be missed (tests/unit/test_search_megatron.py checks it against every cut on small models)."""
    import pydantic

    from .megatron_lm import expressible
    from .polish import polish, polish_chunks
    from .primitives import Ctx
    best, n = None, 0
    for space in spaces:
        ev = Evaluator(cm, gbs, None, space.evaluator_target, space.moe)
        ctx = Ctx(space, ev)
        ev.cutoff = best.iteration_ms if best is not None else INF
        for st0 in megatron_lm_states(space, ctx):
            for sk in stacks:
                st = st0 if sk is None else st0._replace(features=st0.features._replace(stack=sk))
                e = ev.evaluate(st, charge=False)
                n += 1
                if not (e.fits and e.exact):        # not fitting, or its lower bound not below the best so far
                    continue
                p = polish_chunks(ev, ctx, e) if st.num_chunks > 1 else polish(ev, ctx, e, max_spans)
                try:
                    ok = expressible(ev, p)
                except (pydantic.ValidationError, ValueError):
                    ok = False                     # a combination megatron-core refuses (the plan's own rules)
                if ok and (best is None or p.score < best.score):
                    best = p
                    ev.cutoff = p.iteration_ms
    return best, n
