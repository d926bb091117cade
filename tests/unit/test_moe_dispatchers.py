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


# ----- the shared-expert overlap (megatron-core's moe_shared_expert_overlap) ------------------------------------------
def test_shared_expert_overlap_candidates():
    """Offered beside each dispatcher the release runs it with (``moe_plan.shared_overlap_dispatchers``: alltoall;
    flex too from megatron-core 0.18), on a model with a shared expert, never with the EP overlap."""
    qwen2, h100 = load_model("qwen2-57b-a14b"), parse_cluster("1x8-h100")

    def offered(base=None, shared=()):
        return [(s.token_dispatcher, s.flex_backend) for s in candidates(qwen2, h100, base, "megatron-lm",
                                                                         shared_overlap=shared)
                if s.shared_expert_overlap]

    assert offered() == []
    assert offered(shared=("alltoall",)) == [("alltoall", "deepep")]
    assert offered(shared=("alltoall", "flex")) == [("alltoall", "deepep"), ("flex", "deepep"), ("flex", "hybridep")]
    assert offered(MoEPlanSettings(overlap_ep_comm=True), ("alltoall", "flex")) == []
    no_shared = load_model("qwen3-30b-a3b")
    assert not any(s.shared_expert_overlap for s in candidates(no_shared, h100, shared_overlap=("alltoall", "flex")))


@pytest.mark.parametrize("release, dispatcher", [(None, "alltoall"), ("0.19", "flex")])
def test_the_search_chooses_the_shared_expert_overlap_where_it_is_faster(release, dispatcher, tmp_path, capsys):
    """Qwen2-57B-A14B (a 20480-wide shared expert) at ep 8: the analytic model prices the shared expert beside the
    dispatch (``moe_cost``: the pair costs max(dispatch, shared expert) each way), so the search keeps the overlap,
    with alltoall on the newest container (megatron-core 0.17 runs it with alltoall only) and with flex on 0.19.
    The plan it writes is the fastest of the four variants the one price gives, and its export writes the flag.
    Before, the overlap was only kept from a seed, never searched."""
    import json

    from search.cli import main
    from search.pricing import price
    from search.spec.plan import parse_plan
    out = tmp_path / "plan.json"
    argv = ["search", "--model", "qwen2-57b-a14b", "--num-layers", "4", "--cluster", "1x8-h100", "--global-batch-size",
            "64", "--ep", "8", "--budget-evals", "30", "-o", str(out)] + (["--release", release] if release else [])
    assert main(argv) == 0, capsys.readouterr().err
    raw = json.loads(out.read_text())
    moe = raw["settings"]["moe"]
    assert (moe["token_dispatcher"], moe["shared_expert_overlap"]) == (dispatcher, True)
    ms = {}
    for d in ("alltoall", "flex"):
        for on in (False, True):
            if on and d == "flex" and release is None:
                continue            # megatron-core 0.17: refused (test_moe_plan)
            q = json.loads(out.read_text())
            q["settings"]["moe"].update(token_dispatcher=d, shared_expert_overlap=on)
            ms[d, on] = price(parse_plan(q)).iteration_ms
    assert min(ms, key=ms.get) == (dispatcher, True)
    assert ms[dispatcher, True] == pytest.approx(raw["predicted"]["iteration_time_ms"], rel=1e-6)
    assert main(["export", str(out), "--to", "megatron-lm", "-o", str(tmp_path / "run.sh")]) == 0
    assert "--moe-shared-expert-overlap" in (tmp_path / "run.sh").read_text().split()
