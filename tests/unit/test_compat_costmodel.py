"""CompatCostModel: our plans scored with the reference's model give the numbers of their exported configs.

Independent reference: ``evaluate_ref_config`` (validated against the golden values in test_compat_golden.py)
applied to ``plan_to_ref(plan)``; and the 1F1B formula written out by hand.
"""

from __future__ import annotations

import numpy as np
import pytest

from search.spec.cluster import parse_cluster
from search.compat import AcesoDB, evaluate_ref_config
from search.compat.costmodel import make_compat_cost_model
from search.compat.mapping import plan_to_ref
from search.costmodel.types import PlanCost, StageCost
from search.io.errors import AcesoError
from search.spec.plan import ParallelPlan, StageSpec, recompute_allowed
from search.spec.presets import load_model
from search.spec.training import TrainingSpec

TRAINING = TrainingSpec(global_batch_size=64)


def _plan(model, stages, mbs, gbs=64):
    return ParallelPlan(model=model, micro_batch_size=mbs, global_batch_size=gbs,
                        stages=[StageSpec(num_gpus=t * d, tp=t, dp=d, start_unit=a, end_unit=b, recompute=rc)
                                for (a, b, t, d, rc) in stages])


def _random_plans(model, rng, n):
    for _ in range(n):
        num_stages = int(rng.integers(1, 5))
        cuts = sorted(rng.choice(np.arange(1, model.num_units), num_stages - 1, replace=False).tolist())
        bounds = [0] + cuts + [model.num_units]
        mbs = int(rng.choice([2, 4, 8]))
        stages = []
        for a, b in zip(bounds, bounds[1:]):
            tp, dp = [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2)][rng.integers(5)]
            stages.append((a, b, tp, dp, [rng.choice(recompute_allowed(u.kind)) for u in model.units[a:b]]))
        yield _plan(model, stages, mbs)


@pytest.mark.parametrize("preset", ["gpt-1.3b", "t5-770m"])
def test_same_number_from_our_format_and_the_exported_reference_format(preset, reference_db):
    model = load_model(preset)
    cluster = parse_cluster("2x4-v100", memory_limit_mb=12000)
    cm = make_compat_cost_model(model, cluster, TRAINING, reference_db / "miniset")
    db = AcesoDB(reference_db / "miniset", model.aceso_db_key)
    for plan in _random_plans(model, np.random.default_rng(7), 12):
        cost = cm.evaluate(plan)
        ref = evaluate_ref_config(plan_to_ref(plan), db, gpus_per_node=cluster.gpus_per_node)
        assert isinstance(cost, PlanCost) and all(isinstance(s, StageCost) for s in cost.stages)
        assert cost.iteration_ms == pytest.approx(ref.iteration_ms, rel=1e-9)
        for ours, theirs in zip(cost.stages, ref.stages):
            assert ours.time_per_microbatch_ms == pytest.approx(theirs.t_ms, rel=1e-9)
            assert ours.memory_mb == pytest.approx(theirs.memory_mb, rel=1e-9)
            assert ours.fits == (theirs.memory_mb <= 12000)
        assert cost.pipeline.stage_total_ms == pytest.approx([s.time_ms for s in ref.stages], rel=1e-9)


def test_pipeline_is_the_reference_1f1b_formula(reference_db):
    model = load_model("gpt-1.3b", num_layers=4)
    cm = make_compat_cost_model(model, parse_cluster("1x4-v100"), TRAINING, reference_db / "miniset")
    plan = _plan(model, [(0, 3, 1, 1, ["none"] * 3), (3, 8, 2, 1, ["full"] * 5)], 2)
    cost = cm.evaluate(plan)
    t = [s.fwd_ms + s.bwd_ms + s.recompute_ms + s.p2p_ms for s in cost.stages]
    m = plan.num_micro_batches
    want = [(m - 1) * ti + sum(t) for ti in t]
    assert cost.pipeline.stage_total_ms == pytest.approx(want)
    assert cost.iteration_ms == pytest.approx(max(want))
    assert cost.samples_per_s == pytest.approx(64 / (max(want) / 1000))
    assert all(s.dp_sync_ms == 0 and s.optimizer_ms == 0 for s in cost.stages)   # reference gap, kept


def test_stage_cost_is_cached_and_more_recompute_costs_time_saves_memory(reference_db):
    model = load_model("gpt-1.3b")
    cm = make_compat_cost_model(model, parse_cluster("1x4-v100"), TRAINING, reference_db / "miniset")
    args = (0, 2, 0, 0, 24)
    costs = [cm.stage_cost(*args, 1, 1, np.full(24, c, dtype=np.int8), 4) for c in (0, 1, 2)]
    assert cm.stage_cost(*args, 1, 1, np.full(24, 2, dtype=np.int8), 4) is costs[2]
    assert costs[0].recompute_ms == 0 < costs[1].recompute_ms < costs[2].recompute_ms
    assert costs[2].memory_mb < costs[0].memory_mb


def test_unprofiled_sizes_and_wrong_models_are_errors(reference_db):
    model = load_model("gpt-1.3b")
    cm = make_compat_cost_model(model, parse_cluster("1x8-v100"), TRAINING, reference_db / "miniset")
    assert cm.supports(8, 4) and not cm.supports(16, 1) and not cm.supports(1, 8)
    with pytest.raises(AcesoError, match="no profile gpt_1_3B_mbs1_tp8_algo0.csv"):
        cm.stage_cost(0, 1, 0, 0, 48, 8, 1, np.zeros(48, dtype=np.int8), 1)
    with pytest.raises(NotImplementedError):
        cm.unit_table(1, 1)
    with pytest.raises(AcesoError, match="no aceso_db_key"):
        make_compat_cost_model(load_model("llama3-8b"), parse_cluster("1x8-v100"), TRAINING, reference_db)
    with pytest.raises(AcesoError, match="needs --db"):
        make_compat_cost_model(model, parse_cluster("1x8-v100"), TRAINING, None)


def test_evaluate_ref_gives_the_golden_iteration_as_a_plan_cost(reference_db):
    from search.compat import load_ref_config

    cfg = load_ref_config(reference_db / "configs" / "het_dp_3stages.json")
    model = load_model("gpt-1.3b")
    cm = make_compat_cost_model(model, parse_cluster("1x4-v100", memory_limit_mb=12000), TRAINING,
                                reference_db / "miniset")
    cost = cm.evaluate_ref(cfg)
    assert cost.iteration_ms == pytest.approx(67732.52, rel=1e-6)          # README golden value
    assert [s.memory_mb for s in cost.stages] == pytest.approx([11640.11, 11848.03, 11552.14], rel=1e-6)
    assert cost.fits and cost.samples_per_s == pytest.approx(512 / 67.73252, rel=1e-6)


@pytest.mark.parametrize("preset", ["gpt-1.3b", "t5-770m"])
def test_spans_with_the_same_ops_have_one_signature_and_bit_identical_costs(preset, reference_db):
    """A stage's numbers depend on its op sequence only, not on its offset in the model (sums over the stage's
    own slice), so the search may reuse results across spans with one ``stage_signature``."""
    model = load_model(preset)
    cm = make_compat_cost_model(model, parse_cluster("1x4-v100", memory_limit_mb=12000), TRAINING,
                                reference_db / "miniset")
    U = model.num_units
    period = 2 if model.family == "gpt" else 3           # GPT: attention + MLP; T5 decoder layer: 3 units
    a = 6 if model.family == "gpt" else 2 * model.num_layers + 3
    rng = np.random.default_rng(3)
    for n in (1, 2, 5, 7):
        rc = np.array([rng.choice([0, 1, 2]) for _ in range(n)], np.int8)
        same = [(a + period * k, a + period * k + n) for k in range(3)]
        assert len({cm.stage_signature(*s) for s in same}) == 1
        costs = [cm.stage_cost(1, 3, 1, *s, 1, 1, rc, 2) for s in same]
        fresh = make_compat_cost_model(model, parse_cluster("1x4-v100", memory_limit_mb=12000), TRAINING,
                                       reference_db / "miniset")
        assert costs[0] is costs[1] is costs[2]                          # one cache entry
        assert fresh._stage_cost(1, 3, 1, *same[2], 1, 1, rc, 2) == costs[0]   # computed afresh: the same bits
    assert cm.stage_signature(a, a + 2) != cm.stage_signature(a + 1, a + 3)   # other ops
    assert cm.stage_signature(0, 2) != cm.stage_signature(period, period + 2)  # the embedding is in the first
    assert cm.stage_signature(U - 2, U) != cm.stage_signature(U - 2 - period, U - period)  # the head in the last


def test_op_level_stage_optimum_is_the_same_with_and_without_the_memo(reference_db):
    from search.planner.recompute import optimize_stage
    model = load_model("gpt-1.3b")
    cluster = parse_cluster("1x4-v100", memory_limit_mb=16000)   # between the all-full (7916) and none (27345)

    def fresh():
        return make_compat_cost_model(model, cluster, TRAINING, reference_db / "miniset")
    cm = fresh()
    first = optimize_stage(cm, 1, 4, 1, 10, 24, 1, 1, 1)
    again = optimize_stage(cm, 1, 4, 1, 12, 26, 1, 1, 1)     # same ops two units on: the memo answers
    alone = optimize_stage(fresh(), 1, 4, 1, 12, 26, 1, 1, 1)
    assert again[1] is first[1]
    assert np.array_equal(again[0], alone[0]) and again[1] == alone[1]
    assert alone[1].fits and alone[0].any()   # it recomputes: the probing path ran
