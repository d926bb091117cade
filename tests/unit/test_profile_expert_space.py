"""A profile-model search keeps to the expert shapes its database measured (search/planner/experts.py ``measured``,
``ProfileSource.expert_shapes``): the profile cost model prices a moe unit only at a measured (tp, ep, etp,
dispatcher) and refuses any other (profiledb_moe), so a search that proposed an unmeasured shape found nothing
(every uniform and Megatron-LM configuration at the default folding, the largest ep, was refused). The reference
is the database's own rows and ``CostModel.evaluate`` of hand-written plans at them."""

from __future__ import annotations

import pytest

from search.pricing import make_cost_model
from search.spec.plan import parse_plan
from search.planner.aceso import SearchOptions
from search.planner.api import make_space, plan_all
from test_profiledb_moe import CLUSTER, MODEL, TRAIN, write_db


def _cm(tmp_path, eps):
    return make_cost_model(MODEL, CLUSTER, TRAIN, kind="profile", db=str(write_db(tmp_path / "db.json", eps=eps)))


@pytest.mark.parametrize("eps", [(1,), (1, 2), (2,)])
@pytest.mark.parametrize("target", ["aceso", "megatron-lm"])
def test_expert_options_are_the_measured_rows(tmp_path, eps, target):
    """At every stage shape the search may take, its expert options are exactly the database's (tp 1, ep, etp 1)
    rows that fold over the stage's GPUs; without the restriction ep 4 on 4 GPUs would be proposed."""
    cm = _cm(tmp_path, eps)
    assert cm.source.expert_shapes() == {(1, e, 1, "alltoall") for e in eps}
    space = make_space(cm, TRAIN, target)
    for g in (1, 2, 4):
        for s in space.stage_shapes(g):
            want = [(e, 0) for e in eps if g % e == 0]
            assert space.experts.options(s) == want
            assert space.shape_ok(s) == bool(want) and (s.ep, s.etp) in want
    free = make_space(make_cost_model(MODEL, CLUSTER, TRAIN), TRAIN, target)   # analytic: every folding
    assert (4, 0) in free.experts.options(free.stage_shapes(4)[0])


@pytest.mark.parametrize("target", ["aceso", "megatron-lm"])
def test_a_search_on_a_partial_database_finds_the_measured_plan(tmp_path, target):
    """Only ep 1 measured: the search returns a fitting plan at ep 1 on every stage (before the restriction the
    Megatron-LM target found nothing: every configuration at the default ep 4 was refused), at least as fast as
    every one-stage plan at a measured shape and per-rank batch, priced by ``CostModel.evaluate``."""
    cm = _cm(tmp_path, (1,))
    plans = plan_all(cm, TRAIN, SearchOptions(budget_evals=200), target=target)
    best = plans.main.plans[0]
    assert best.fits and all(s.ep == 1 for s in best.state.shapes)
    hand = []
    for m in (4, 8):            # dp 4, per-rank batch 1 or 2
        raw = {"model": MODEL.model_dump(), "micro_batch_size": m, "global_batch_size": 8,
               "distributed_optimizer": True, "overlap_grad_reduce": True,
               "stages": [{"num_gpus": 4, "tp": 1, "dp": 4, "ep": 1, "start_unit": 0, "end_unit": MODEL.num_units,
                           "recompute": ["none"] * MODEL.num_units}]}
        cost = cm.evaluate(parse_plan(raw, world_size=4))
        assert cost.fits
        hand.append(cost.iteration_ms)
    assert best.iteration_ms <= min(hand) * (1 + 1e-9)
