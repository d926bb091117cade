"""settle's last graph-round step (search/planner/settle.py ``_refine``): the best plan's stages and cuts under every
ep x micro-batch x plan-level switches x CUDA-graph scope. Its neighbourhood of a one-stage plan is the brute force
of tests/unit/test_settle_graphs.py (every legal tp-1 dp-8 plan over ep, per-rank batch, switches and scope), written
out independently here; and it returns the fastest of them that fits when that beats the plan."""

from __future__ import annotations

import pytest

from bench_modules import load
from search.costmodel.types import Shape
from search.planner.api import make_space
from search.planner.dispatchers import Dispatchers, graph_candidates
from search.planner.settle import _accept, _neighbours, _refine
from search.planner.state import Evaluator, State, from_plan

hp = load("hybrid_published")


@pytest.fixture(scope="module")
def nano():
    x = hp.price_row(next(r for r in hp.load() if r["id"].startswith("26.04.01/pretrain/nemotron-3-nano/gb200x8")))
    plan, cm, tr = x["_plan"], x["_cm"], x["_training"]
    return cm, tr, from_plan(plan)[0], plan.moe   # flex / HybridEP (no EP overlap on HybridModel)


def test_neighbourhood_is_the_one_stage_brute_force(nano):
    cm, tr, seed, moe = nano
    space = make_space(cm, tr, "megatron-lm", moe=moe)
    disp = Dispatchers(cm, tr.global_batch_size, "megatron-lm", moe, _accept("megatron-lm"))
    st = State(16, (Shape(1, 8, 1, False, 4, 0),), (0, space.num_units), space.features[0]._replace(
        stack=seed.features.stack))
    want = set()
    for ep in (1, 2, 4, 8):
        for b in space.batches:
            for f in space.features:
                for g in graph_candidates(cm.model, "megatron-lm"):
                    x = State(8 * b, (Shape(1, 8, 1, False, ep, 0),), st.bounds,
                              f._replace(stack=seed.features.stack._replace(graphs=g.graphs)))
                    if space.legal(space.start_of(x)):
                        want.add(x)
    got = list(_neighbours(space, st, disp))
    assert len(got) == len(set(got))
    assert set(got) == want - {st}


def test_refine_returns_the_fastest_neighbour_that_fits(nano):
    cm, tr, seed, moe = nano
    space = make_space(cm, tr, "megatron-lm", moe=moe)
    disp = Dispatchers(cm, tr.global_batch_size, "megatron-lm", moe, _accept("megatron-lm"))
    ev = Evaluator(cm, tr.global_batch_size, None, "megatron-lm", moe)
    st = State(16, (Shape(1, 8, 1, False, 4, 0),), (0, space.num_units), space.features[0]._replace(
        stack=seed.features.stack))
    start = ev.evaluate(st, charge=False, exact=True)
    plans, line = _refine(disp, space, [start])
    fitting = [e for e in (ev.evaluate(x, charge=False, exact=True) for x in _neighbours(space, st, disp))
               if e.fits and disp.passes(ev, e)]
    fastest = min(e.iteration_ms for e in fitting)
    assert fastest < start.iteration_ms
    assert plans[0].iteration_ms == pytest.approx(fastest, rel=1e-12) and plans[1] is start
    assert line.endswith(f"{fastest:.1f} ms")
    # from the fastest plan there is nothing to add
    again, none = _refine(disp, space, plans[:1])
    assert again == plans[:1] and none is None
