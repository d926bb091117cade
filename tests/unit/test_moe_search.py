"""The search over expert shapes (issue 22 part 4): the candidates are exactly what megatron-core's folding rules
(search/settings/moe_plan.py) admit at etp 1 or tp, SP is forced on at tp > 1, the expert moves keep each stage's GPUs and
the megatron-lm target's one folding, the evaluator hands ep/etp to a cost model that prices them, and a search on
a cost model where ep trades memory for time finds the hand-computed best ep."""

import numpy as np
import pytest

from search.spec.cluster import parse_cluster
from search.costmodel.types import ALL_FEATURES, Shape
from search.settings.moe_plan import check_expert_shape
from search.spec.plan import ChunkSpec, StageSpec
from search.planner.aceso import SearchOptions, search
from search.planner.baseline import best_uniform
from search.planner.experts import ExpertSpace
from search.planner.expert_moves import MOVES
from search.planner.primitives import APPLY, Ctx, balanced_bounds
from search.planner.space import Space
from search.planner.state import Evaluator, State, to_plan
from search.planner.synthetic import SyntheticCostModel
from search.spec.presets import load_model
from search.spec.training import TrainingSpec


def _stage(s: Shape, etp) -> StageSpec:
    return StageSpec(num_gpus=s.num_gpus, tp=s.tp, dp=s.dp, cp=s.cp, sequence_parallel=s.tp > 1, ep=s.ep, etp=etp,
                     chunks=[ChunkSpec(start_unit=0, end_unit=2, recompute=["none", "none"])])


def _rules_admit(model, s: Shape, ep: int, etp: int) -> bool:
    try:
        check_expert_shape(model, 0, _stage(s._replace(ep=ep), etp))
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("name,g,tp", [("deepseek-v3", 16, 2), ("mixtral-8x7b", 24, 4), ("qwen3-30b-a3b", 8, 1),
                                       ("qwen3-235b-a22b", 64, 8)])
def test_expert_options_are_what_the_folding_rules_admit(name, g, tp):
    """Every (ep, etp in {1, tp}) megatron-core's rules accept, and nothing else (one code per expert shape)."""
    model = load_model(name)
    ex = ExpertSpace.of(model)
    s = Shape(tp, g // tp, 1, tp > 1)
    got = {(ep, code or tp) for ep, code in ex.options(s)}
    want = {(ep, etp) for etp in {1, tp} for ep in range(1, g + 1) if _rules_admit(model, s, ep, etp)}
    assert got == want and len(got) == len(ex.options(s))


def test_deepseek_v3_expert_options_by_hand():
    ex = ExpertSpace.of(load_model("deepseek-v3"))          # 256 experts, widths 2048
    s = Shape(2, 8, 1, True)                                # 16 GPUs
    assert ex.options(s) == [(1, 0), (2, 0), (4, 0), (8, 0), (1, 1), (2, 1), (4, 1), (8, 1), (16, 1)]
    assert ex.fit(s) == s._replace(ep=16, etp=1)            # default: etp 1, the largest ep
    assert ex.fit(Shape(4, 4, 1, True), old=s._replace(ep=4, etp=1)) == Shape(4, 4, 1, True, 4, 1)
    mixtral = ExpertSpace.of(load_model("mixtral-8x7b"))    # 8 experts: ep at most 8 on 24 GPUs
    assert [ep for ep, c in mixtral.options(Shape(1, 24)) if c == 0] == [1, 2, 4, 8]


def test_biases_allow_only_etp_1():
    model = load_model("mixtral-8x7b").model_copy(update={"add_bias_linear": True})
    ex = ExpertSpace.of(model)
    assert ex.etps(2) == (1,) and ex.etps(1) == (0,)
    assert not any(_rules_admit(model, Shape(2, 4, 1, True), ep, 2) for ep in (1, 2, 4, 8))


def _space(name="qwen3-30b-a3b", cluster="2x8-h100", gbs=64, target="aceso", layers=4, **kw):
    model = load_model(name, num_layers=layers)
    cl = parse_cluster(cluster)
    tr = TrainingSpec(global_batch_size=gbs, **kw)
    return model, cl, tr, Space.of(model, cl, tr, priced=ALL_FEATURES, target=target)


def test_moe_space_forces_sp_and_carries_expert_shapes():
    model, cl, tr, space = _space()
    assert space.sps == (True,)
    shapes = space.stage_shapes(16)
    assert shapes and all(s.sp == (s.tp > 1) and space.shape_ok(s) for s in shapes)
    for s in shapes:                                        # every enumerated shape passes megatron-core's rules
        check_expert_shape(model, 0, _stage(s, None if s.etp == 0 else s.etp))
    assert not space.shape_ok(Shape(2, 8, 1, False, 16, 1))       # MoE + TP without SP
    assert not space.shape_ok(Shape(1, 16, 1, False, 3, 0))       # ep 3 does not divide 128 experts
    assert not space.shape_ok(Shape(2, 8, 1, True, 16, 2))        # etp code 2: not 1 or tp (0)
    dense = _space("gpt-1.3b")[3]
    assert dense.experts is None and not dense.shape_ok(Shape(1, 16, 1, False, 2, 0))


class ExpertCost(SyntheticCostModel):
    """The synthetic model plus an expert term: each unit's expert weights ``w / (ep etp)`` MB per GPU, and a
    dispatch time of ``a log2(ep)`` ms per unit (a wider all-to-all); records the expert shapes it was asked for."""

    def __init__(self, *a, expert_mb=400.0, a2a_ms=0.5, **kw):
        super().__init__(*a, **kw)
        self.expert_mb, self.a2a_ms, self.asked = expert_mb, a2a_ms, set()

    def stage_cost(self, stage_index, num_stages, first_rank, start_unit, end_unit, tp, dp, recompute,
                   micro_batch_size, ep=1, etp=0):
        self.asked.add((ep, etp))
        c = super().stage_cost(stage_index, num_stages, first_rank, start_unit, end_unit, tp, dp, recompute,
                               micro_batch_size)
        n = end_unit - start_unit
        c.memory_mb += n * self.expert_mb / (ep * (etp or tp))
        c.fwd_ms += n * self.a2a_ms * np.log2(ep)
        c.fits = c.memory_mb <= self.memory_limit_mb
        return c


def _ctx(target="aceso", limit=1e9, **kw):
    model, cl, tr, space = _space(target=target, **kw)
    cm = ExpertCost(model, cl, tr, memory_limit_mb=limit)
    ev = Evaluator(cm, tr.global_batch_size, None, target)
    return model, cm, space, ev, Ctx(space, ev)


def _start(space, ctx, S=2):
    shapes = [space.stage_shapes(space.num_gpus // S, every_sp=False)[-1]] * S
    m = space.legal_mbs(shapes)[0]
    return State(m, tuple(shapes), balanced_bounds(ctx, shapes, m, space.num_units), space.features[0])


@pytest.mark.parametrize("target", ["aceso", "megatron-lm"])
def test_expert_moves_keep_gpus_and_fold_alike_on_megatron_lm(target):
    model, cm, space, ev, ctx = _ctx(target, tensor_parallel_sizes=[1, 2, 4])   # (tp 8 above qwen3's 4 groups: legal)
    st = _start(space, ctx)
    e = ev.evaluate(st)
    made = {}
    for name in MOVES:
        for new in APPLY[name](ctx, e, 0):
            assert space.legal(new) and [s.num_gpus for s in new.shapes] == [s.num_gpus for s in st.shapes]
            assert new.bounds == st.bounds
            if target == "megatron-lm":
                assert len(set(new.shapes)) == 1
            else:
                assert new.shapes[1] == st.shapes[1]
            made[name] = new.shapes[0]
    s = st.shapes[0]                        # 8 GPUs at the largest tp allowed (--tp 1 2 4), etp 1, ep 8
    assert (s.tp, s.dp, s.ep, s.etp) == (4, 2, 8, 1)
    assert made["dec_ep"] == s._replace(ep=4) and "inc_ep" not in made      # ep 8 is every GPU already
    assert made["etp_tp"] == s._replace(ep=2, etp=0)        # etp 4 leaves 8 / 4 = 2 ranks for ep
    assert "tp_to_ep" not in made and "ep_to_tp" not in made    # ep 16 > 8 GPUs; tp 8 not in --tp
    low = st._replace(mbs=4, shapes=(s._replace(ep=2),) * 2)     # per-rank 2, and 1 at dp 4 (a one-stage move
    assert space.legal(low)                                         # keeps the pipeline micro-batch)
    traded = APPLY["tp_to_ep"](ctx, ev.evaluate(low), 0)
    assert [x.shapes[0] for x in traded] == [Shape(2, 4, 1, True, 4, 1)]    # tp 4 -> 2, ep 2 -> 4
    back = APPLY["ep_to_tp"](ctx, ev.evaluate(traded[0]), 0)
    assert [x.shapes[0] for x in back] == ([s._replace(ep=2)] if target == "aceso" else [s._replace(ep=2)])
    for new in (v for k, v in made.items()):
        check_expert_shape(model, 0, _stage(new, None if new.etp == 0 else new.etp))


def test_dense_models_have_no_expert_moves():
    model = load_model("gpt-1.3b", num_layers=4)
    cl, tr = parse_cluster("1x8-h100"), TrainingSpec(global_batch_size=64)
    space = Space.of(model, cl, tr, priced=ALL_FEATURES)
    cm = SyntheticCostModel(model, cl, tr)
    ev = Evaluator(cm, 64, None)
    ctx = Ctx(space, ev)
    e = ev.evaluate(_start(space, ctx))
    assert all(APPLY[name](ctx, e, 0) == [] for name in MOVES)


def test_evaluator_hands_the_expert_shape_to_the_cost_model():
    model, cm, space, ev, ctx = _ctx()
    st = _start(space, ctx)
    ev.evaluate(st)
    assert (st.shapes[0].ep, st.shapes[0].etp) in cm.asked and st.shapes[0].ep > 1
    plan = to_plan(ev.evaluate(st, exact=True), model, cm.cluster, 64, "synthetic")
    assert [(s.ep, s.etp) for s in plan.stages] == [(8, 1), (8, 1)]


def _brute_force(cm, space):
    """Every uniform 2-stage plan of 8-GPU stages at every tp and expert shape of the space (cuts balanced), the
    fastest that fits: (ms, shape)."""
    best = None
    ev = Evaluator(cm, 64, None)
    ctx = Ctx(space, ev)
    for tp in space.tps:
        for ep, code in space.experts.options(Shape(tp, 8 // tp, 1, tp > 1)):
            shapes = (Shape(tp, 8 // tp, 1, tp > 1, ep, code),) * 2
            for m in space.legal_mbs(shapes):
                st = State(m, shapes, balanced_bounds(ctx, shapes, m, space.num_units), space.features[0])
                e = ev.evaluate(st, exact=True)
                if space.legal(st) and e.fits and (best is None or e.iteration_ms < best[0]):
                    best = (e.iteration_ms, shapes[0])
    return best


def test_search_finds_the_expert_shape_that_fits_fastest():
    """Experts of 400 MB per unit against a 1200 MB limit, a dispatch that grows with ep: the search leaves the
    default folding (etp 1, ep 8) for the expert shape a brute force over every one finds fastest."""
    model, cl, tr, space = _space(cluster="1x16-h100", layers=2, micro_batch_sizes=[1])
    cm = ExpertCost(model, cl, tr, memory_limit_mb=1200.0, a2a_ms=2.0)
    res = search(cm, 64, space, SearchOptions(budget_evals=400, stage_counts=[2], polish_top=1))
    e = res.plans[0]
    hand_ms, hand_shape = _brute_force(cm, space)
    assert e.fits and e.iteration_ms <= hand_ms * (1 + 1e-9)
    assert e.state.shapes[0] == hand_shape != space.expert_fit(hand_shape._replace(ep=1, etp=0))


def test_baseline_tries_every_expert_shape_of_its_best_configurations():
    """The uniform baseline is as fast as the best expert shape of its own attention layout."""
    model, cl, tr, space = _space(cluster="1x16-h100", layers=2, micro_batch_sizes=[1], target="megatron-lm")
    cm = ExpertCost(model, cl, tr, memory_limit_mb=1200.0, a2a_ms=2.0)
    base = best_uniform(cm, 64, space, model)
    assert base is not None and base.fits and len(set(base.state.shapes)) == 1
    s = base.shape
    assert s != space.expert_fit(s._replace(ep=1, etp=0))     # not the grid's default folding
    ev = Evaluator(cm, 64, None, "megatron-lm")
    for ep, code in space.experts.options(s):
        st = base.state._replace(shapes=(s._replace(ep=ep, etp=code),) * base.pp)
        e = ev.evaluate(st, exact=True)
        assert not e.fits or e.iteration_ms >= base.iteration_ms * (1 - 1e-9)


def test_a_unit_after_the_last_layer_joins_the_last_cut():
    """An MTP block after the last decoder layer (moecost: one unit of kind "mtp") is in the last chunk: the cut
    points end at the last unit whether or not ``layer_starts`` counts it."""
    from types import SimpleNamespace

    from search.planner.space import cut_points
    assert cut_points(SimpleNamespace(layer_starts=[0, 2, 4, 6], num_units=7)) == (0, 2, 4, 7)
    assert cut_points(SimpleNamespace(layer_starts=[0, 2, 4, 7], num_units=7)) == (0, 2, 4, 7)
    model = load_model("deepseek-v3", num_layers=4)
    assert cut_points(model)[-1] == model.num_units


def test_reports_show_the_expert_shape():
    from search.planner.report import describe, stage_rows
    model, cm, space, ev, ctx = _ctx()
    e = ev.evaluate(_start(space, ctx), exact=True)
    assert "2x(tp8 dp1 sp ep8 etp1)" in describe(e)       # tp 8 above qwen3's 4 query groups: the largest
    # the pipeline micro-batch and what Megatron-LM's --micro-batch-size is (dp 1 here: the same number)
    assert f"micro-batch {e.state.mbs} ({e.state.mbs} per rank)" in describe(e)
    assert [(r["ep"], r["etp"]) for r in stage_rows(e)] == [(8, 1), (8, 1)]


def test_expert_primitives_are_the_expert_moves():
    from search.planner.bottleneck import EXPERT_PRIMITIVES, PRIMITIVES
    assert EXPERT_PRIMITIVES == set(MOVES) and EXPERT_PRIMITIVES <= set(PRIMITIVES) <= set(APPLY)


def test_moe_settings_reach_the_cost_model_and_the_plan():
    """The space's MoE settings go to a cost model whose stage_cost takes ``moe``, and into the plan written."""
    from search.settings.moe_plan import MoEPlanSettings

    class SettingsCost(ExpertCost):
        def stage_cost(self, *a, moe=None, **kw):
            self.asked.add(("moe", moe))
            return super().stage_cost(*a, **kw)
    model, cl, tr, _ = _space()
    flex = MoEPlanSettings(token_dispatcher="flex")
    space = Space.of(model, cl, tr, priced=ALL_FEATURES, moe=flex)
    cm = SettingsCost(model, cl, tr, memory_limit_mb=1e9)
    ev = Evaluator(cm, 64, None, "aceso", space.moe)
    e = ev.evaluate(_start(space, Ctx(space, ev)), exact=True)
    assert ("moe", flex) in cm.asked and ("moe", None) not in cm.asked
    assert to_plan(e, model, cl, 64, "synthetic").moe == flex
    assert Space.of(load_model("gpt-1.3b"), cl, tr, moe=flex).moe is None      # a dense model has none


@pytest.mark.parametrize("etp", [None, 1])
def test_a_plan_spelling_etp_equal_to_tp_is_inside_the_space(etp):
    """A published run's ``--expert-tensor-parallel-size 1`` at tp 1 (megatron-core: etp None means tp, so etp 1 is
    the same folding) reads back as the state the search writes (code 0), so it is a legal seed."""
    from search.spec.plan import parse_plan
    from search.planner.state import from_plan
    model, cl, tr, space = _space(cluster="1x8-h100", gbs=64)
    raw = {"model": model.model_dump(), "micro_batch_size": 8, "global_batch_size": 64,
           "stages": [{"num_gpus": 8, "tp": 1, "dp": 8, "ep": 8, "etp": etp, "start_unit": 0,
                       "end_unit": model.num_units, "recompute": ["none"] * model.num_units}]}
    st = from_plan(parse_plan(raw, world_size=8))[0]
    assert st.shapes == (Shape(1, 8, 1, False, 8, 0),) and space.legal(space.normalize(st))


def test_ep_max_ep_and_etp_narrow_every_expert_shape_the_search_and_baseline_consider():
    """Issue 32: --ep / --max-ep / --etp (TrainingSpec.expert_parallel_sizes / max_expert_parallel /
    expert_tensor_parallel_sizes). By hand on 16 GPUs at tp 2 (Qwen3-30B-A3B: 128 experts, width 768): all
    options are ep 1-8 at etp 2 and 1-16 at etp 1; --ep 2 8 --etp 1 leaves (2, 1) and (8, 1), --max-ep 4 the ep up to
    4. The search and the baseline on the expert-cost model (whose unconstrained best is another shape) keep to them."""
    s = Shape(2, 8, 1, True)
    assert _space()[3].experts.options(s) == [(e, 0) for e in (1, 2, 4, 8)] + [(e, 1) for e in (1, 2, 4, 8, 16)]
    model, cl, tr, space = _space(expert_parallel_sizes=[2, 8], expert_tensor_parallel_sizes=[1])
    assert space.experts.options(s) == [(2, 1), (8, 1)]
    assert _space(max_expert_parallel=4)[3].experts.options(s) == [(e, 0) for e in (1, 2, 4)] + \
        [(e, 1) for e in (1, 2, 4)]
    for kw, ok in (({"expert_parallel_sizes": [2]}, lambda x: x.ep == 2),
                   ({"max_expert_parallel": 2}, lambda x: x.ep <= 2),
                   ({"expert_tensor_parallel_sizes": [1], "tensor_parallel_sizes": [2]},
                    lambda x: x.tp == 2 and x.etp == 1)):
        model, cl, tr, space = _space(cluster="1x16-h100", layers=2, micro_batch_sizes=[1], **kw)
        cm = ExpertCost(model, cl, tr, memory_limit_mb=1e9, a2a_ms=2.0)
        res = search(cm, 64, space, SearchOptions(budget_evals=300, stage_counts=[1, 2], polish_top=1))
        mspace = _space(cluster="1x16-h100", layers=2, micro_batch_sizes=[1], target="megatron-lm", **kw)[3]
        base = best_uniform(cm, 64, mspace, model)
        assert res.plans and base is not None
        for shapes in (res.plans[0].state.shapes, base.state.shapes):
            assert all(ok(x) for x in shapes), (kw, shapes)
        assert all(ok(x._replace(ep=ep, etp=c)) for x in space.stage_shapes(8) for ep, c in space.experts.options(x))


def test_report_line_gives_the_per_rank_micro_batch():
    """The report's micro-batch is the pipeline micro-batch; a Megatron user reads --micro-batch-size, the per-rank
    share: 64 / dp 64 = 1 (and per stage where dp differs: 8 / 8 = 1, 8 / 2 = 4)."""
    from types import SimpleNamespace as NS
    from search.planner.report import describe
    off = NS(distributed_optimizer=False, overlap_grad_reduce=False, overlap_param_gather=False,
             tp_comm_overlap=False, fsdp=0, offload_layers=0)
    one = NS(shapes=(Shape(1, 64),), mbs=64, num_stages=1, num_chunks=1, features=off)
    assert "micro-batch 64 (1 per rank)" in describe(NS(state=one, moe=None, setting=None))
    two = NS(shapes=(Shape(1, 8), Shape(4, 2)), mbs=8, num_stages=2, num_chunks=1, features=off)
    assert "micro-batch 8 (1/4 per rank)" in describe(NS(state=two, moe=None, setting=None))
