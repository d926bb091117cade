"""Exact refinements of the search's best plans (no budget: a few final plans only).

* ``polish``: for a plan's stage shapes and micro-batch, the optimal contiguous cut (``partition.best_partition``,
  each span at its best recompute; ``megatron-lm``: layer cuts at the plan's recompute setting and at the lighter
  ones), within a window around the current boundaries. One chunk per stage only (the interleaved objective is not a
  max plus a sum).
* ``polish_chunks``: interleaved plans: hill-climbing over single-step moves of every model-chunk boundary.
* ``polish_features``: every allowed combination of the plan-level switches at the same state.
* ``refine_recompute``: op-level cost models (aceso-compat), whose per-stage recompute is solved on a probed
  surrogate: exact over per-kind choice counts where they are few, then hill-climbing over single-unit changes.

Each returns the better of its input and its result, exactly evaluated.
"""

from __future__ import annotations

import numpy as np

from .megatron_lm import NONE_SETTING, SELECTIVE_SETTING, block, chunk_layers, codes
from .partition import Spans, best_partition
from .recompute import allowed_codes, refine_by_counts, refine_by_local_search
from .state import INF, Evaluation, Evaluator, StageEval

LIGHTER = 4          # megatron-lm: block counts below the plan's tried by the partition DP


def refine_recompute(ev: Evaluator, e: Evaluation) -> Evaluation:
    """Refine every stage's recompute with the cost model itself (op-level models, one chunk per stage)."""
    st = e.state
    stages = []
    for i, r in enumerate(st.first_ranks()):
        args, kw = ev.stage_args(st, i, r)
        a, b = st.bounds[i], st.bounds[i + 1]

        def cost(rc, args=args, kw=kw):
            return ev.cm.stage_cost(*args, rc, st.mbs, **kw)
        allowed = allowed_codes(ev.cm.model, a, b, no_full=ev.no_full)
        kinds = [(u.stack, u.kind) for u in ev.cm.model.units[a:b]]
        rc, c = refine_by_counts(cost, e.stages[i].rc, e.stages[i].cost, kinds, allowed)
        rc, c = refine_by_local_search(cost, rc, c, allowed)
        stages.append(StageEval(c, rc))
    new = ev.assemble(st, stages, exact=True)
    return new if new.fits and new.iteration_ms < e.iteration_ms else e


def polish(ev: Evaluator, ctx, e: Evaluation, max_spans: int) -> Evaluation:
    """Exact partition DP over the cut positions for e's stage shapes and micro-batch (boundaries in a window).

    ``megatron-lm``: the recompute setting is one for the plan, so the DP runs at the plan's setting and at each
    lighter one (less recompute: an uneven cut may let the stages with the most micro-batches in flight fit with it);
    each result is priced at its own best setting."""
    st = e.state
    if st.num_stages == 1 or st.num_chunks > 1:
        return e
    settings = [None] if ev.target != "megatron-lm" else _lighter(ev.cm.model, st, e.setting)
    best = e
    for setting in settings:
        bounds = _best_cut(ev, ctx, st, setting, max_spans)
        if bounds is not None:
            cand = ev.evaluate(st._replace(bounds=bounds), charge=False, exact=True)
            if cand.score < best.score:
                best = cand
    return best


def _lighter(model, st, setting) -> list:
    """The plan's Megatron-LM setting, then every one with less recompute (fewer block layers, selective, none)."""
    out = [setting]
    if setting is None or setting.granularity is None:
        return out
    if setting.granularity == "full":
        top = setting.num_layers if setting.method == "block" else max(
            max(chunk_layers(model, st.spans(i))) for i in range(st.num_stages))
        out += [block(n) for n in range(top - 1, 0, -1)][:LIGHTER] + [SELECTIVE_SETTING]
    return out + [NONE_SETTING]


def _best_cut(ev: Evaluator, ctx, st, setting, max_spans: int):
    """The DP's cut for st's shapes (``setting``: the megatron-lm recompute setting; None: exact per span)."""
    S = st.num_stages
    P = ctx.positions
    U = len(P) - 1
    M = ev.gbs // st.mbs
    firsts = st.first_ranks()
    idx = [ctx.index[x] for x in st.bounds]
    w = U
    while w > 1 and S * (2 * w + 1) ** 2 > max_spans:
        w //= 2
    lo = [max(0, x - w) for x in idx]
    hi = [min(U, x + w) for x in idx]
    # a span's price depends on the stage's place and shape, its neighbours', the switches, the micro-batch and the
    # recompute setting, not on the other cuts: kept on the evaluator for every plan the final step polishes
    memo = ev.span_prices
    stages = []
    for i in range(S):
        A, B, T, AA = [], [], [], []
        here = (S, i, firsts[i], st.shapes[i], st.neighbours(i), st.features, st.mbs, setting)
        for a in range(lo[i], hi[i] + 1):
            if i == 0 and a != 0:
                continue
            for b in range(max(a + 1, lo[i + 1]), hi[i + 1] + 1):
                if i == S - 1 and b != U:
                    continue
                ta = memo.get((here, a, b))
                if ta is None:
                    span = ((int(P[a]), int(P[b])),)
                    if setting is None:
                        c = ev.stage(st, i, firsts[i], spans=span).cost
                    else:
                        c = ev.stage_with(st, i, firsts[i], codes(setting, ev.cm.model, span), spans=span).cost
                    t = c.time_per_microbatch_ms if c.fits else INF
                    ta = memo[(here, a, b)] = (t, (M - 1) * t + c.dp_sync_ms + c.optimizer_ms + c.prologue_ms
                                                if np.isfinite(t) else INF)
                A.append(a), B.append(b), T.append(ta[0]), AA.append(ta[1])
        stages.append(Spans(np.array(A, int), np.array(B, int), np.array(T), np.array(AA)))
    _val, bounds = best_partition(U, stages)
    return None if bounds is None else tuple(int(P[x]) for x in bounds)


def polish_chunks(ev: Evaluator, ctx, e: Evaluation, max_evals: int = 200) -> Evaluation:
    """Interleaved plans: best-improvement hill climbing over one-step moves of every chunk boundary."""
    if e.state.num_chunks == 1 or not e.fits:
        return e
    best, used = e, 0
    while used < max_evals:
        idx = [ctx.index[x] for x in best.state.bounds]
        step = None
        for k in range(1, len(idx) - 1):
            for d in (-1, 1):
                moved = list(idx)
                moved[k] += d
                if not moved[k - 1] < moved[k] < moved[k + 1]:
                    continue
                cand = best.state._replace(bounds=tuple(int(ctx.positions[x]) for x in moved))
                if not ctx.space.legal(cand):
                    continue
                c = ev.evaluate(cand, charge=False, exact=True)
                used += 1
                if c.score < (step or best).score:
                    step = c
        if step is None:
            break
        best = step
    return best


def polish_features(ev: Evaluator, ctx, e: Evaluation) -> Evaluation:
    """The same state under every allowed combination of the plan-level switches; the best one."""
    best = e
    for f in ctx.space.features:
        cand = ctx.space.normalize(e.state._replace(features=f))
        if cand != e.state and ctx.space.legal(cand):
            c = ev.evaluate(cand, charge=False, exact=True)
            if c.score < best.score:
                best = c
    return best
