"""The uniform baseline against an independent enumeration of Megatron-style plans (search.plan.uniform_plan)."""

import pytest

from search.cluster import parse_cluster
from search.costmodel import make_cost_model
from search.plan import uniform_plan
from search.planner.baseline import UNIFORM_RECOMPUTE
from search.planner.baseline import baseline_plan, best_uniform, layer_splits
from search.planner.state import Space
from search.presets import load_model
from search.training import TrainingSpec


@pytest.mark.parametrize("limit", [None, 30000])
def test_best_uniform_equals_enumeration_of_uniform_plans(limit):
    model = load_model("gpt-1.3b", num_layers=4)
    cluster = parse_cluster("1x4-h100", memory_limit_mb=limit)
    training = TrainingSpec(global_batch_size=64)
    cm = make_cost_model(model, cluster, training)
    best = float("inf")
    for pp in (1, 2, 4):
        for tp in (1, 2, 4):
            if 4 % (pp * tp):
                continue
            dp = 4 // (pp * tp)
            for mbs in (1, 2, 4, 8):
                if mbs % dp:
                    continue
                for rc in UNIFORM_RECOMPUTE:
                    cost = cm.evaluate(uniform_plan(model, pp, tp, dp, mbs, 64, rc, cluster))
                    if cost.fits:
                        best = min(best, cost.iteration_ms)
    res = best_uniform(cm, 64, Space.of(model, cluster, training), model)
    assert res.iteration_ms == pytest.approx(best, rel=1e-12)
    plan = baseline_plan(res, model, cluster, 64, "analytic")
    assert cm.evaluate(plan).iteration_ms == pytest.approx(res.iteration_ms, rel=1e-12)


def test_layer_splits_follow_megatron_first_last_adjustment():
    assert layer_splits(24, 4) == [(6, 6, 6, 6)]
    for split in layer_splits(10, 4):  # middle stages equal, first/last take the rest
        assert sum(split) == 10 and split[1] == split[2] and min(split) >= 1
    assert layer_splits(3, 4) == []
