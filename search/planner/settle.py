"""The search again under what its final step chose, and in a wider space, each started from the plan before.

The search explores shapes, cuts and micro-batches under one plan-wide MoE setting (``Space.moe``: the dispatcher,
the EP overlap) and only its final step prices the finalists under the other settings (``dispatchers.py``). A
shape that wins only under another setting is then never reached: on Nemotron-3 Nano (gb300x8, MXFP8) the search
under the published flex / HybridEP dispatcher picks ep 4, the final step turns the EP overlap on, and under the
overlap ep 2 is 4% faster again (1.085x -> 1.127x over the published plan), a shape the search never priced with
it. ``settle`` runs the search once more in the space of the chosen setting, seeded with the best plan, while the
setting changes (at most ``MAX_ROUNDS`` times). The shared-expert overlap and the EP overlap exclude each other
(megatron-core asserts it), so where the chosen setting has the shared-expert overlap, the same rounds run again
with no shared-expert overlap candidate (``SearchOptions.shared_overlap``), and the plans of both are merged: on the
same Nano row alltoall with the shared-expert overlap wins the first final step at ep 8 by 0.1%, and only the
rounds without it reach the EP overlap's ep 2.

A wider space (``wider``: e.g. the context-parallel degrees) searched from scratch spreads the same budget over
more states and can end slower than the narrow space (the hybrid bench lost two Nemotron-H 56B rows that way);
``settle`` searches it last, seeded with the narrow space's best plan, so it is never slower than that plan.

Where memory binds on the best plan, one more round searches with the fine-grained activation offload on every
state (``fine_offload.settle_round``).

Each round's plans are merged, best first (``Evaluation.rank``; one entry per state and MoE setting), so the result
is never slower than the first search's.
"""

from __future__ import annotations

import copy

from . import fine_offload
from .aceso import SearchOptions, SearchResult, search
from .api import make_space as _make_space
from .state import Evaluation

MAX_ROUNDS = 2      # searches under a newly chosen MoE setting (each seeded with the one before)


def settle(cm, training, target: str, opts: SearchOptions, top_k: int = 1, moe=None, wider=None,
           make_space=None, space=None) -> tuple[SearchResult, list[str]]:
    """(the merged result, one line per round: what it searched and its best time). ``training``: the spec of the
    first search; ``wider``: a training spec whose space is searched last, from the best plan (None: none);
    ``moe``: the first search's MoE settings (None: the defaults); ``make_space``: ``api.make_space``; ``space``:
    the first search's space where the caller has built it (None: built here)."""
    make_space = make_space or _make_space
    gbs = training.global_batch_size
    first = space if space is not None else make_space(cm, training, target, moe=moe)
    plans, res, log = _rounds(cm, training, target, opts, top_k, first, make_space)
    best = _best(plans)
    if best is not None and best.moe is not None and best.moe.shared_expert_overlap:
        # the two overlaps exclude each other: the same rounds without the shared-expert overlap (the EP overlap's)
        o = copy.copy(opts)
        o.shared_overlap = False
        p2, r2, log2 = _rounds(cm, training, target, o, top_k, first, make_space)
        plans, res = _merge(plans, p2), _sum(res, r2)
        log += [f"without the shared-expert overlap, {line}" for line in log2]
    plans, r, line = fine_offload.settle_round(cm, training, target, opts, top_k, plans, make_space, search,
                                               _seeded, _merge)
    if r is not None:
        res = _sum(res, r)
        log.append(line)
    if wider is not None:
        best = _best(plans)
        space = make_space(cm, wider, target, moe=best.moe if best is not None else moe)
        r = search(cm, gbs, space, _seeded(opts, best), top_k)
        plans = _merge(plans, r.plans)
        res = _sum(res, r)
        log.append(f"the wider space from the best plan: {_best_text(r)}")
    res.plans = plans[:max(top_k, 1)]
    return res, log


def _rounds(cm, training, target: str, opts: SearchOptions, top_k: int, space, make_space):
    """The search, then again under its final step's choice while that changes: (plans, result, log lines)."""
    gbs = training.global_batch_size
    res = search(cm, gbs, space, opts, top_k)
    log = [f"search: {_best_text(res)}"]
    plans = list(res.plans)
    for _ in range(MAX_ROUNDS):
        best = _best(plans)
        if best is None or best.moe is None or best.moe == space.moe:
            break
        space = make_space(cm, training, target, moe=best.moe)
        r = search(cm, gbs, space, _seeded(opts, best), top_k)
        plans = _merge(plans, r.plans)
        res = _sum(res, r)
        log.append(f"again under {_moe_text(best.moe)} from the best plan: {_best_text(r)}")
    return plans, res, log


def _best(plans: list[Evaluation]) -> Evaluation | None:
    return next((e for e in plans if e.fits), None)


def _seeded(opts: SearchOptions, best: Evaluation | None) -> SearchOptions:
    o = copy.copy(opts)
    o.seeds = ([best.state] if best is not None else []) + list(opts.seeds)
    return o


def _merge(a: list[Evaluation], b: list[Evaluation]) -> list[Evaluation]:
    seen, out = set(), []
    for e in sorted(a + b, key=lambda e: e.rank):
        key = (e.state, e.moe)
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


def _sum(a: SearchResult, b: SearchResult) -> SearchResult:
    return SearchResult(a.plans, a.moves + b.moves, a.evals + b.evals, a.seconds + b.seconds,
                        a.interrupted or b.interrupted, {**a.per_count, **{k: min(v, a.per_count.get(k, v))
                                                                         for k, v in b.per_count.items()}},
                        a.polished + b.polished)


def _moe_text(m) -> str:
    d = m.token_dispatcher + (f" ({m.flex_backend})" if m.token_dispatcher == "flex" else "")
    return d + (", EP overlap" if m.overlap_ep_comm else "") + (", shared-expert overlap" if m.shared_expert_overlap
                                                                 else "")


def _best_text(r: SearchResult) -> str:
    e = _best(r.plans)
    return "nothing fits" if e is None else f"{e.iteration_ms:.1f} ms"
