"""The search again under what its final step chose, and in a wider space, each started from the plan before.

The search explores shapes, cuts and micro-batches under one plan-wide MoE setting (``Space.moe``: the dispatcher,
the EP overlap) and only its final step prices the finalists under the other settings (``dispatchers.py``). A
shape that wins only under another setting is then never reached. ``settle`` runs the search once more in the
space of the chosen setting, seeded with the best plan, while the setting changes (at most ``MAX_ROUNDS`` times).
The shared-expert overlap and the EP overlap exclude each other (megatron-core asserts it), so where the chosen
setting has the shared-expert overlap, the same rounds run again with no shared-expert overlap candidate
(``SearchOptions.shared_overlap``), and the plans of both are merged (tests/unit/test_search_settle.py).

The stack switches (``--target megatron-lm``: the CUDA-graph scope) are the same kind of choice: the search
explores without them (``Space.start_of``) and its final step prices each scope on the finalists (on the state's
own switches and on each seed's: a published plan's loss fusion can be what makes a scope's buffers fit,
tests/unit/test_settle_graphs.py), so a shape that fits only without one scope's buffers is never reached.
``settle`` then runs the search under the scopes the best plan prices best under (its own and the runner-up,
``Dispatchers.ranked_stacks``; at most ``MAX_GRAPH_ROUNDS``), each with every state carrying that stack (plus the
seed's loss fusion it kept), seeded with the best plan and each round's first ``SEED_PLANS`` plans: such a search
explores a few hundred states near them. Their last step (``_refine``) prices the best plan's stages and cuts under
every ep x micro-batch x plan-level switches x graph scope (about 200 exact evaluations on Nano, not charged to the
budget): the searches move one choice at a time and the final step polishes the switches and scopes on their own
plans only, so where the graph buffers trade against ep, the micro-batch and Megatron FSDP together the rounds can
end a few moves short (tests/unit/test_settle_refine.py).

A wider space (``wider``: e.g. the context-parallel degrees) searched from scratch spreads the same budget over
more states and can end slower than the narrow space (the hybrid bench lost two Nemotron-H 56B rows that way);
``settle`` searches it last, seeded with the narrow space's best plan, so it is never slower than that plan.

The fine-grained activation offload only makes room: the rounds above run without it (``SearchOptions.offload``
False: a best plan that offloads, and so before megatron-core 0.18 has no graphs, would offer the graph rounds no
scope), and where memory binds on their best plan one more round searches with it on every state
(``fine_offload.settle_round``).

Each round's plans are merged, best first (``Evaluation.rank``; one entry per state and MoE setting), so the result
is never slower than the first search's.
"""

from __future__ import annotations

import copy
import dataclasses

import pydantic

from . import fine_offload
from .aceso import SearchOptions, SearchResult, search
from .api import make_space as _make_space
from .dispatchers import Dispatchers, graph_candidates
from .state import Evaluation, Evaluator

MAX_ROUNDS = 2      # searches under a newly chosen MoE setting (each seeded with the one before)
MAX_GRAPH_ROUNDS = 2   # searches under the stack switches (CUDA-graph scopes) the best plan prices best under
SEED_PLANS = 5      # each round's first plans that seed the graph rounds


def settle(cm, training, target: str, opts: SearchOptions, top_k: int = 1, moe=None, wider=None,
           make_space=None, space=None) -> tuple[SearchResult, list[str]]:
    """(the merged result, one line per round: what it searched and its best time). ``training``: the spec of the
    first search; ``wider``: a training spec whose space is searched last, from the best plan (None: none);
    ``moe``: the first search's MoE settings (None: the defaults); ``make_space``: ``api.make_space``; ``space``:
    the first search's space where the caller has built it (None: built here)."""
    make_space = make_space or _make_space
    gbs = training.global_batch_size
    # the fine-grained offload only makes room: the rounds below run without it (a best plan that offloads would
    # hide the graph scopes and shapes that fit without, e.g. Nano gb200's), its own round comes last, from their
    # best plan (fine_offload.settle_round: its search's final step may choose it)
    with_offload, opts = opts, copy.copy(opts)
    opts.offload = False
    first = space if space is not None else make_space(cm, training, target, moe=moe)
    # each round's first plans (SEED_PLANS): the graph rounds' seeds, where there are graph scopes to try (else
    # None: a dense model's search without a seed's graphs runs as before, the loss fusion alone is no round)
    tops = [] if target == "megatron-lm" and (graph_candidates(cm.model, target) or any(
        s.features.stack is not None and s.features.stack.graphs for s in opts.seeds)) else None
    plans, res, log = _rounds(cm, training, target, opts, top_k, first, make_space, tops)
    best = _best(plans)
    if best is not None and best.moe is not None and best.moe.shared_expert_overlap and _ep_overlap_offered(cm, target,
                                                                                                          best.moe):
        # the two overlaps exclude each other: the same rounds without the shared-expert overlap (the EP overlap's)
        o = copy.copy(opts)
        o.shared_overlap = False
        p2, r2, log2 = _rounds(cm, training, target, o, top_k, first, make_space, tops)
        plans, res = _merge(plans, p2), _sum(res, r2)
        log += [f"without the shared-expert overlap, {line}" for line in log2]
    if tops is not None:
        plans, res = _graph_rounds(cm, training, target, opts, top_k, first.features[0].stack, make_space, plans,
                                   res, log, tops)
    plans, r, line = fine_offload.settle_round(cm, training, target, with_offload, top_k, plans, make_space, search,
                                               _seeded, _merge)
    if r is not None:
        res = _sum(res, r)
        log.append(line)
    if wider is not None:
        best = _best(plans)
        space = make_space(cm, wider, target, moe=best.moe if best is not None else moe)
        r = search(cm, gbs, space, _seeded(with_offload, best), top_k)
        plans = _merge(plans, r.plans)
        res = _sum(res, r)
        log.append(f"the wider space from the best plan: {_best_text(r)}")
    res.plans = plans[:max(top_k, 1)]
    return res, log


def _rounds(cm, training, target: str, opts: SearchOptions, top_k: int, space, make_space, tops: list | None):
    """The search, then again under its final step's choice while that changes: (plans, result, log lines)."""
    gbs = training.global_batch_size
    res = _search(cm, gbs, space, opts, top_k, tops)
    log = [f"search: {_best_text(res)}"]
    plans = list(res.plans)
    for _ in range(MAX_ROUNDS):
        best = _best(plans)
        if best is None or best.moe is None or best.moe == space.moe:
            break
        space = make_space(cm, training, target, moe=best.moe)
        r = _search(cm, gbs, space, _seeded(opts, best), top_k, tops)
        plans = _merge(plans, r.plans)
        res = _sum(res, r)
        log.append(f"again under {_moe_text(best.moe)} from the best plan: {_best_text(r)}")
    return plans, res, log


def _search(cm, gbs: int, space, opts: SearchOptions, top_k: int, tops: list | None) -> SearchResult:
    """``search``; with ``tops`` (a list), at ``SEED_PLANS`` plans at least (its final step then polishes as many),
    their fitting states added to it."""
    if tops is None:
        return search(cm, gbs, space, opts, top_k)
    r = search(cm, gbs, space, opts, max(top_k, SEED_PLANS))
    tops += [e.state for e in r.plans[:SEED_PLANS] if e.fits]
    return r


def _graph_rounds(cm, training, target: str, opts: SearchOptions, top_k: int, explored, make_space, plans, res,
                  log: list, tops: list):
    """The search again under the stack switches (CUDA-graph scopes) the best plan prices best under, its own and
    the runner-up (``Dispatchers.ranked_stacks``; at most ``MAX_GRAPH_ROUNDS``, ``explored`` left out: the stack
    the searches ran under), each in the space of that stack and the best plan's MoE setting, seeded with the best
    plan and each round's first plans (``tops``): (plans, result; only plans faster than the best before are
    merged); ``log`` gets one line per round."""
    best = _best(plans)
    if best is None:
        return plans, res
    disp = Dispatchers(cm, training.global_batch_size, target, best.moe, _accept(target),
                       stacks=[s.features.stack for s in opts.seeds if s.features.stack is not None])
    stacks = [sk for sk in disp.ranked_stacks(best) if sk != explored and sk is not None and sk.graphs]
    stacks = stacks[:MAX_GRAPH_ROUNDS]
    o = copy.copy(opts)
    o.seeds = list(dict.fromkeys([best.state] + tops + list(opts.seeds)))
    for sk in stacks:
        space = make_space(cm, training, target, moe=best.moe)
        space = dataclasses.replace(space, features=tuple(f if f.offload_layers else f._replace(stack=sk)
                                                          for f in space.features))
        r = search(cm, training.global_batch_size, space, o, top_k)
        # only what beats the plans so far: at a tie the plan keeps no switch it does not need (its own graphs)
        plans, res = _merge(plans, [e for e in r.plans if e.score < best.score]), _sum(res, r)
        log.append(f"again under graphs {' '.join(sorted(sk.graphs)) or 'none'} from the best plans: "
                   f"{_best_text(r)}")
    if stacks:
        plans, line = _refine(disp, make_space(cm, training, target, moe=_best(plans).moe), plans)
        log += [line] if line else []
    return plans, res


def _refine(disp: Dispatchers, space, plans: list[Evaluation]) -> tuple[list[Evaluation], str | None]:
    """The graph rounds' last step: the best plan's stages, stage cuts and MoE setting under every combination of
    the four plan-wide choices the CUDA-graph buffers trade against (ep, the micro-batch, the plan-level switches,
    the graph scope), each priced exactly (``_neighbours``); the fastest that fits, passes the plan's rules and
    (megatron-lm) the export's check is merged when it beats the best plan. The rounds' searches move one choice
    at a time and polish the switches on their best plans only, so a plan that is faster only with all four
    changed together is missed (tests/unit/test_settle_refine.py). (plans, a log line where it found a faster plan,
    else None)."""
    best = _best(plans)
    ev = disp.own if disp.own is not None and disp.own.moe == best.moe else \
        Evaluator(disp.cm, disp.gbs, None, disp.target, best.moe)
    found, n = best, 0
    for st in _neighbours(space, best.state, disp):
        n += 1
        try:
            c = ev.evaluate(st, charge=False, exact=True)
            ok = c.fits and c.score < best.score and c.rank < found.rank and disp.passes(ev, c)
        except (pydantic.ValidationError, ValueError):
            continue               # a combination megatron-core refuses (the plan's own rules)
        if ok:
            found = c
    if found is best:
        return plans, None
    return _merge(plans, [found]), (f"the best plan's ep x micro-batch x switches x graphs ({n} plans), from "
                                    f"{best.iteration_ms:.1f} ms: {found.iteration_ms:.1f} ms")


def _neighbours(space, st, disp: Dispatchers):
    """The legal states of ``st``'s stage shapes and cuts at every ep (one on every stage, the stages' etp kept),
    pipeline micro-batch, plan-level switch combination of ``space`` and CUDA-graph scope of ``disp`` (the state's
    own stack with each scope, ``Dispatchers.variants``), ``st`` left out."""
    ex = space.experts
    eps = [s.ep for s in st.shapes[:1]] if ex is None else \
        [e for e in ex.eps(st.shapes[0].num_gpus, st.shapes[0].expert_tp, st.shapes[0].tp)
         if all(ex.ok(s._replace(ep=e)) for s in st.shapes)]
    for ep in eps:
        shapes = tuple(s._replace(ep=ep) for s in st.shapes)
        for mbs in space.legal_mbs(shapes):
            for f in space.features:
                base = st._replace(mbs=mbs, shapes=shapes, features=f._replace(stack=st.features.stack))
                if not space.legal(space.start_of(base)):
                    continue
                for x in disp.variants(base):
                    if x != st:
                        yield x


def _ep_overlap_offered(cm, target: str, moe) -> bool:
    """Whether any candidate of the final step has the EP overlap (``dispatchers.candidates`` without the
    shared-expert overlap): what the rounds without the shared-expert overlap are for (none on a hybrid model,
    whose HybridModel runs no EP overlap, or for the aceso runtime)."""
    from .dispatchers import candidates
    base = moe.model_copy(update={"shared_expert_overlap": False})
    return any(c.overlap_ep_comm for c in candidates(cm.model, cm.cluster, base, target))


def _accept(target: str):
    """The final step's extra check of a variant (the megatron-lm target: the export's ``expressible``)."""
    from .megatron_lm import expressible
    return (lambda ev, c: expressible(ev, c)) if target == "megatron-lm" else None


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
