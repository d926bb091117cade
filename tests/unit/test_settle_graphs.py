"""The search settled under the CUDA-graph scopes its best plan prices best under (search/planner/settle.py,
dispatchers.Dispatchers: each scope on the state's own switches and on the seed's).

The search explores without the stack switches (``Space.start_of``) and only its final step prices CUDA-graph
scopes. The row: Nemotron-3 Nano on 8 GB200 (186 GiB; Megatron-Bridge 26.04.01, MXFP8, flex / HybridEP, graphs attn
mamba moe_router moe_preprocess, transformer-engine's cross-entropy fusion). Under the MoE setting the search
chooses (alltoall with the shared-expert overlap: HybridModel runs no EP overlap, hybrid_pattern.EP_OVERLAP_REFUSAL)
the fastest one-stage plan is mbs 4 per rank at ep 8 with graphs without ``mamba`` and the published plan's loss
fusion: without that fusion its graphs' buffers do not fit, so a final step that tried each scope only on the
state's own switches (none) ended at a plan that offloads instead (13960.4 ms against 13820.5 ms). The reference is
independent of the search: every one-stage tp-1 dp-8 plan (ep, per-rank micro-batch, plan-level switches, graph
scope with and without the published plan's switches) priced by brute force.
"""

from __future__ import annotations

import pytest

from bench_modules import load
from search.costmodel.types import Shape
from search.planner.aceso import SearchOptions
from search.planner.api import make_space
from search.planner.dispatchers import graph_candidates
from search.planner.settle import settle
from search.planner.state import Evaluator, State, from_plan, to_plan

hp = load("hybrid_published")
BUDGET = 300
GIB = 1024


@pytest.fixture(scope="module")
def row():
    x = hp.price_row(next(r for r in hp.load() if r["id"].startswith("26.04.01/pretrain/nemotron-3-nano/gb200x8")))
    assert x["status"] == "priced"
    return x["_plan"], x["_cm"], x["_training"], x["limit_gib"]


def _one_stage(space, mbs: int, ep: int, features) -> State:
    return State(mbs, (Shape(1, 8, 1, False, ep, 0),), (0, space.num_units), features)


def test_the_search_reaches_the_brute_force_best_graphs_and_loss_fusion(row):
    plan, cm, tr, limit_gib = row
    seed = from_plan(plan)[0]
    opts = SearchOptions(budget_evals=BUDGET, seeds=[seed])
    res, log = settle(cm, tr, "megatron-lm", opts, moe=plan.moe)
    best = res.plans[0]

    # brute force under the found plan's MoE setting: every ep, per-rank batch, switch combination and graph scope
    moe = best.moe
    assert not moe.overlap_ep_comm and moe.token_dispatcher == "alltoall" and moe.shared_expert_overlap
    space = make_space(cm, tr, "megatron-lm", moe=moe)
    ev = Evaluator(cm, tr.global_batch_size, None, "megatron-lm", moe)
    own = seed.features.stack
    scopes = [base._replace(graphs=g.graphs, graph_impl=g.graph_impl) for base in (own, own._replace(ce_fusion=""))
              for g in graph_candidates(cm.model, "megatron-lm")] + [None]
    ref = float("inf")
    for ep in (1, 2, 4, 8):
        for b in space.batches:
            for f in space.features:
                for sk in scopes:
                    st = _one_stage(space, 8 * b, ep, f._replace(stack=sk))
                    if space.legal(space.start_of(st)):
                        e = ev.evaluate(st, charge=False, exact=True)
                        ref = min(ref, e.iteration_ms if e.fits else ref)
    assert best.iteration_ms <= ref * (1 + 1e-9)          # at least the brute-force best

    # the plan by hand: mbs 4 per rank, ep 8, graphs without mamba and the published loss fusion; without the
    # fusion, or with the Mamba layers' graphs, the same state does not fit
    s = best.state
    sk = s.features.stack
    assert (s.mbs, s.shapes[0].ep) == (32, 8) and "mamba" not in sk.graphs and sk.ce_fusion == own.ce_fusion == "te"
    for other in (sk._replace(ce_fusion=""), own):
        c = ev.evaluate(s._replace(features=s.features._replace(stack=other)), charge=False, exact=True)
        assert not c.fits and c.max_memory_mb > limit_gib * GIB > best.max_memory_mb
    # the published plan under the same cost model is slower
    published = ev.evaluate(seed, charge=False, exact=True)
    assert published.iteration_ms > best.iteration_ms
    to_plan(best, cm.model, cm.cluster, tr.global_batch_size, "analytic", predicted=False)   # the plan's rules


def test_no_full_recompute_under_cuda_graphs(row):
    """megatron-core runs full recompute only under a full_iteration graph (stack.refusal): the evaluator never
    chooses it in a state with other graphs, where it does without them (dispatcher alltoall, no EP overlap)."""
    plan, cm, tr, _ = row
    seed = from_plan(plan)[0]
    moe = plan.moe.model_copy(update={"token_dispatcher": "alltoall", "flex_backend": "deepep",
                                     "overlap_ep_comm": False})
    space = make_space(cm, tr, "megatron-lm", moe=moe)
    ev = Evaluator(cm, tr.global_batch_size, None, "megatron-lm", moe)
    f = space.features[0]
    bare = ev.evaluate(_one_stage(space, 64, 8, f), charge=False, exact=True)
    graphs = ev.evaluate(_one_stage(space, 64, 8, f._replace(stack=seed.features.stack)), charge=False, exact=True)
    assert bare.fits and any("full" in st.all_recompute for st in to_plan(
        bare, cm.model, cm.cluster, tr.global_batch_size, "analytic", predicted=False).stages)
    if graphs.fits:      # the plan passes megatron-core's rules: no full recompute
        p = to_plan(graphs, cm.model, cm.cluster, tr.global_batch_size, "analytic", predicted=False)
        assert not any("full" in st.all_recompute for st in p.stages)
