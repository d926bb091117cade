"""The token dispatcher is searched (issue 22 part 4): one per plan (megatron-core's ``moe_token_dispatcher_type``),
alltoall / allgather / flex (flex on CUDA clusters only), the fastest fitting kept with ties to the default; the
search's final plans and the uniform baseline both choose it, on both targets, and the plan records it.

The reference is a synthetic cost model whose dispatch time per unit is a given number per dispatcher, so the
right choice is known by hand."""

import pytest

from search.spec.cluster import parse_cluster
from search.costmodel.types import ALL_FEATURES
from search.settings.moe_plan import MoEPlanSettings, moe_settings
from search.planner.aceso import SearchOptions, search
from search.planner.baseline import best_uniform
from search.planner.dispatchers import Dispatchers, candidates
from search.planner.report import describe, units_text
from search.planner.space import Space
from search.planner.state import to_plan
from search.planner.synthetic import SyntheticCostModel
from search.spec.presets import load_model
from search.spec.training import TrainingSpec


class DispatchCost(SyntheticCostModel):
    """The synthetic model plus ``ms[dispatcher]`` per unit and micro-batch (forward), as a stage with experts."""

    def __init__(self, *a, ms=None, **kw):
        super().__init__(*a, **kw)
        self.ms, self.asked = ms or {}, set()

    def stage_cost(self, stage_index, num_stages, first_rank, start_unit, end_unit, tp, dp, recompute,
                   micro_batch_size, ep=1, etp=0, moe=None):
        d = (moe or MoEPlanSettings()).token_dispatcher
        self.asked.add(d)
        c = super().stage_cost(stage_index, num_stages, first_rank, start_unit, end_unit, tp, dp, recompute,
                               micro_batch_size)
        c.fwd_ms += (end_unit - start_unit) * self.ms.get(d, 0.0)
        return c


def _problem(ms, cluster="1x8-h100", target="aceso"):
    model = load_model("qwen3-30b-a3b", num_layers=2)
    cl = parse_cluster(cluster)
    tr = TrainingSpec(global_batch_size=32, micro_batch_sizes=[1, 2])
    cm = DispatchCost(model, cl, tr, memory_limit_mb=1e9, ms=ms)
    return model, cl, cm, Space.of(model, cl, tr, priced=ALL_FEATURES, target=target)


def test_candidates():
    qwen, h100, cpu = load_model("qwen3-30b-a3b"), parse_cluster("1x8-h100"), parse_cluster("1x4-cpu")
    names = [(s.token_dispatcher, s.flex_backend) for s in candidates(qwen, h100)]
    assert names == [("alltoall", "deepep"), ("allgather", "deepep"), ("flex", "deepep"), ("flex", "hybridep")]
    assert [s.token_dispatcher for s in candidates(qwen, cpu)] == ["alltoall", "allgather"]    # DeepEP: CUDA
    shared = MoEPlanSettings(shared_expert_overlap=True)        # megatron-core: alltoall only
    assert candidates(qwen, h100, shared) == [shared]
    ov = MoEPlanSettings(overlap_ep_comm=True, token_dispatcher="flex")    # alltoall or flex
    assert [(s.token_dispatcher, s.flex_backend) for s in candidates(qwen, h100, ov)] == [
        ("flex", "deepep"), ("alltoall", "deepep"), ("flex", "hybridep")]
    assert all(s.overlap_ep_comm for s in candidates(qwen, h100, ov))
    assert candidates(load_model("gpt-1.3b"), h100) == []
    # padded expert input: megatron-core's flex pads with HybridEP only; a HybridEP base keeps deepep off the others
    padded = qwen.model_copy(update={"moe": qwen.moe.model_copy(update={"moe_expert_capacity_factor": 1.0,
                                                                        "moe_pad_expert_input_to_capacity": True})})
    assert [(s.token_dispatcher, s.flex_backend) for s in candidates(padded, h100)] == [
        ("alltoall", "deepep"), ("allgather", "deepep"), ("flex", "hybridep")]
    hyb = MoEPlanSettings(token_dispatcher="flex", flex_backend="hybridep")
    assert [(s.token_dispatcher, s.flex_backend) for s in candidates(qwen, h100, hyb)] == [
        ("flex", "hybridep"), ("alltoall", "deepep"), ("allgather", "deepep"), ("flex", "deepep")]


@pytest.mark.parametrize("target", ["aceso", "megatron-lm"])
@pytest.mark.parametrize("ms,want", [({"alltoall": 3.0, "allgather": 1.0, "flex": 2.0}, "allgather"),
                                     ({"alltoall": 3.0, "allgather": 4.0, "flex": 1.0}, "flex"),
                                     ({"alltoall": 1.0, "allgather": 2.0, "flex": 1.0}, "alltoall")])   # a tie
def test_search_and_baseline_keep_the_fastest_dispatcher(ms, want, target):
    model, cl, cm, space = _problem(ms, target=target)
    res = search(cm, 32, space, SearchOptions(budget_evals=200, stage_counts=[1, 2], polish_top=1))
    base = best_uniform(cm, 32, space, model)
    assert cm.asked == {"alltoall", "allgather", "flex"}
    for e in (res.plans[0], base.evaluation):
        assert e.fits and (e.moe or MoEPlanSettings()).token_dispatcher == want     # None: the defaults
        # by hand: the same state under each dispatcher differs by exactly the per-unit dispatch times
        disp = Dispatchers(cm, 32, target)
        times = {ev.moe.token_dispatcher: ev.evaluate(e.state, charge=False, exact=True).iteration_ms
                 for ev in disp.evaluators}
        assert all(e.iteration_ms <= t * (1 + 1e-12) for t in times.values())
        plan = to_plan(e, model, cl, 32, "synthetic")
        assert moe_settings(plan).token_dispatcher == want and (("dispatcher " + want in describe(e)) == (want != "alltoall"))


def test_flex_is_not_chosen_on_a_cpu_cluster():
    model, cl, cm, space = _problem({"alltoall": 3.0, "allgather": 2.0, "flex": 0.0}, cluster="1x8-cpu")
    res = search(cm, 32, space, SearchOptions(budget_evals=100, stage_counts=[1], polish_top=1))
    assert res.plans[0].moe.token_dispatcher == "allgather" and "flex" not in cm.asked


def test_footer_units_follow_the_model():
    assert units_text(load_model("gpt-1.3b")) == "half layers"
    assert units_text(load_model("deepseek-v3", num_layers=4)) == "layer parts: attention / mlp / moe / mtp"
    assert units_text(load_model("qwen3-30b-a3b", num_layers=2)) == "layer parts: attention / moe"


def test_the_dispatcher_option_keeps_the_plan_to_the_named_ones():
    """Issue 32: --dispatcher (TrainingSpec.token_dispatchers). flex is the fastest by hand, yet --dispatcher
    allgather alltoall keeps DeepEP / HybridEP out: the search runs under allgather (the first named) and never
    prices flex; --dispatcher flex alone prices flex only."""
    model, cl = load_model("qwen3-30b-a3b", num_layers=2), parse_cluster("1x8-h100")
    for named, want in ((["allgather", "alltoall"], "allgather"), (["flex"], "flex")):
        tr = TrainingSpec(global_batch_size=32, micro_batch_sizes=[1, 2], token_dispatchers=named)
        cm = DispatchCost(model, cl, tr, memory_limit_mb=1e9, ms={"alltoall": 3.0, "allgather": 2.0, "flex": 0.5})
        space = Space.of(model, cl, tr, priced=ALL_FEATURES)
        assert space.moe.token_dispatcher == named[0]
        res = search(cm, 32, space, SearchOptions(budget_evals=100, stage_counts=[1], polish_top=1))
        base = best_uniform(cm, 32, Space.of(model, cl, tr, priced=ALL_FEATURES, target="megatron-lm"), model)
        assert cm.asked == set(named)
        assert res.plans[0].moe.token_dispatcher == want == base.evaluation.moe.token_dispatcher
