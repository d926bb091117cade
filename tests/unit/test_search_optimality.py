"""The search finds the exhaustive optimum on random tiny problems (same cost model, same plan space)."""

import numpy as np
import pytest

from search.spec.cluster import parse_cluster
from search.planner.aceso import SearchOptions, search
from search.planner.exhaustive import exhaustive_best
from search.planner.space import Space
from search.planner.synthetic import tiny_problem
from search.spec.presets import load_model
from search.spec.training import TrainingSpec


@pytest.mark.parametrize("seed", range(24))
def test_search_equals_exhaustive_on_tiny_synthetic_problems(seed):
    cm, space, gbs = tiny_problem(seed)
    want, want_state, _n = exhaustive_best(cm, gbs, space)
    res = search(cm, gbs, space, SearchOptions(budget_evals=400))
    got = res.plans[0]
    if not np.isfinite(want):
        assert not got.fits
        return
    assert got.fits
    assert got.iteration_ms == pytest.approx(want, rel=1e-12), (got.state, want_state)


@pytest.mark.parametrize("layers,gpus,limit", [(2, 2, 30000), (2, 4, 24000), (1, 4, 20000), (3, 2, 40000)])
def test_search_equals_exhaustive_with_analytic_model(layers, gpus, limit):
    from search.pricing import make_cost_model
    model = load_model("gpt-1.3b", num_layers=layers)
    cluster = parse_cluster(f"1x{gpus}-h100", memory_limit_mb=limit)
    training = TrainingSpec(global_batch_size=64, micro_batch_sizes=[4, 8])
    cm = make_cost_model(model, cluster, training)
    space = Space.of(model, cluster, training)
    want, _, _ = exhaustive_best(cm, 64, space)
    res = search(cm, 64, space, SearchOptions(budget_evals=600))
    assert np.isfinite(want)
    assert res.plans[0].iteration_ms == pytest.approx(want, rel=1e-12)


def test_exhaustive_optimal_recompute_equals_brute_force_recompute():
    # the enumerator's per-stage recompute optimiser agrees with trying every assignment (tiniest cases)
    for seed in (1, 6, 9, 14):  # problems with at most 4 units
        cm, space, gbs = tiny_problem(seed)
        assert space.num_units <= 4
        a, _, _ = exhaustive_best(cm, gbs, space, recompute="optimal")
        b, _, _ = exhaustive_best(cm, gbs, space, recompute="brute")
        assert np.isfinite(a) and a == pytest.approx(b, rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_a_spent_wall_clock_cap_still_returns_the_seed(seed):
    """``--budget-s`` spent before the seed's stage count runs (0 s: no stage count gets an evaluation): the seed
    (here the exhaustive optimum, as a published plan or the uniform baseline would be) is still a candidate, so
    the search is never worse than it (it was returned only on Ctrl-C)."""
    cm, space, gbs = tiny_problem(seed)
    want, best, _ = exhaustive_best(cm, gbs, space)
    if best is None:                # nothing fits this problem: nothing to seed
        return
    res = search(cm, gbs, space, SearchOptions(budget_evals=400, budget_s=0.0, seeds=[best]))
    assert res.plans and res.plans[0].fits and res.plans[0].iteration_ms <= want * (1 + 1e-12)
