"""The search on a hybrid model keeps the best plan it sees (issue 32 item 3, issue 36): seeded with a published
plan it never returns a slower one, at any budget, and more budget never returns a slower plan. The reference is
independent of the search: ``search.pricing.price`` of the seed's plan and of the returned plan.

The row: Nemotron-3 Nano on 8 GB200 (Megatron-Bridge 26.04.01, MXFP8, tp1 ep8 mbs2, CUDA graphs of attn /
moe_router / moe_preprocess), read by bench/hybrid_published.py. Before, the Megatron-LM search of this model priced
one-stage plans with CPU activation offload, which the hybrid-pattern form refuses, so the final check dropped every
one-stage plan, the uniform seed among them, and returned a two-stage plan 0.1% slower than the published one."""

from __future__ import annotations

import pytest

from bench_modules import load
from search.megatron import check_expressible
from search.planner.aceso import SearchOptions, search
from search.planner.api import make_space
from search.planner.state import Evaluator, from_plan, to_plan
from search.pricing import price

hp = load("hybrid_published")
BUDGETS = (150, 500, 1500)


@pytest.fixture(scope="module")
def row():
    r = next(r for r in hp.load() if r["id"].startswith("26.04.01/pretrain/nemotron-3-nano/gb200x8/mxfp8"))
    x = hp.price_row(r)
    assert x["status"] == "priced"
    plan, cm, tr = x["_plan"], x["_cm"], x["_training"]
    return plan, cm, tr, make_space(cm, tr, "megatron-lm", moe=plan.moe)


def _plan_of(e, plan, cm, tr):
    return to_plan(e, cm.model, cm.cluster, tr.global_batch_size, "analytic", settings=plan.settings)


def test_seeded_search_is_never_slower_than_the_seed_and_more_budget_never_slower(row):
    plan, cm, tr, space = row
    seed = from_plan(plan)[0]
    assert space.refusal(space.start_of(seed)) is None     # the published plan is in the space
    reference = price(plan).iteration_ms                    # the published plan as priced on its own
    times = []
    for b in BUDGETS:
        res = search(cm, tr.global_batch_size, space, SearchOptions(budget_evals=b, seeds=[seed]))
        best = res.plans[0]
        got = _plan_of(best, plan, cm, tr)
        assert check_expressible(got) is None, b
        t = price(got).iteration_ms                          # the returned plan, priced on its own
        assert t == pytest.approx(best.iteration_ms, rel=1e-9)
        assert t <= reference + 1e-6, f"{b} evaluations: {t:.1f} ms, the seed {reference:.1f} ms"
        times.append(t)
    assert all(b <= a + 1e-9 for a, b in zip(times, times[1:])), times


def test_megatron_lm_plans_of_a_mamba_model_never_offload(row):
    """A one-stage plan that does not fit without recompute: megatron-core's CPU offload is no Megatron-LM plan of a
    Mamba model (it runs only as a hybrid pattern, whose export refuses offload), so the evaluator recomputes."""
    plan, cm, tr, space = row
    seed = space.start_of(from_plan(plan)[0])
    st = seed._replace(mbs=32, shapes=(seed.shapes[0]._replace(ep=2),))
    assert space.legal(st)
    ev = Evaluator(cm, tr.global_batch_size, None, "megatron-lm", space.moe)
    e = ev.evaluate(st, exact=True)
    assert e.fits and e.state.features.offload_layers == 0
    assert check_expressible(_plan_of(e, plan, cm, tr)) is None


def test_a_state_outside_the_space_says_why(row):
    plan, cm, tr, space = row
    seed = space.start_of(from_plan(plan)[0])
    two = seed._replace(shapes=(seed.shapes[0]._replace(dp=4, ep=4), seed.shapes[0]._replace(dp=2, ep=2, tp=2,
                                                                                              sp=True)),
                        bounds=(0, 26, 52))
    assert space.refusal(two) == "different stage shapes (Megatron-LM runs one)"
    assert space.refusal(seed._replace(bounds=(0, 51))) == "its unit bounds"
    assert space.refusal(seed) is None and space.legal(seed)
