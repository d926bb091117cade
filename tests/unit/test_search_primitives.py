"""Every primitive keeps plans valid: legal shapes, GPUs summing to the cluster, TP groups inside a node; the
megatron-lm target's primitives only produce plans Megatron-LM can run."""

import itertools
from collections import Counter

import numpy as np
import pytest

from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.costmodel.types import Features, Shape
from search.planner import megatron_lm
from search.planner.aceso import initial_states
from search.planner.api import make_space
from search.planner.bottleneck import PRIMITIVES
from search.planner.primitives import APPLY, Ctx, balanced_bounds
from search.planner.state import Evaluator, State, to_plan
from search.spec.presets import load_model
from search.spec.training import TrainingSpec

GBS = 64


def _setup(cluster="2x4-h100", layers=6, limit=None, target="aceso", **training):
    model = load_model("gpt-1.3b", num_layers=layers)
    cl = parse_cluster(cluster, memory_limit_mb=limit)
    tr = TrainingSpec(global_batch_size=GBS, **training)
    cm = make_cost_model(model, cl, tr)
    space = make_space(cm, tr, target)
    ev = Evaluator(cm, GBS, None, target)
    return model, cl, cm, space, ev, Ctx(space, ev)


def _walk(space, ev, ctx, states, depth=2):
    """Apply every primitive to every stage of the states and of their children, ``depth`` levels deep."""
    produced, frontier, seen = [], list(states), set(states)
    for _ in range(depth):
        nxt = []
        for st in frontier:
            e = ev.evaluate(st, charge=False)
            for b, name in itertools.product(range(st.num_stages), PRIMITIVES):
                for new in APPLY[name](ctx, e, b):
                    produced.append((name, st, new))
                    if new not in seen and len(nxt) < 60:
                        seen.add(new)
                        nxt.append(new)
        frontier = nxt
    return produced


@pytest.mark.parametrize("limit", [None, 20000])
def test_every_primitive_keeps_plans_valid(limit):
    model, cl, _cm, space, ev, ctx = _setup(limit=limit, context_parallel_sizes=[1, 2], virtual_stages=[1, 2])
    states = [s for S in (1, 2, 3, 4, 5) for s in initial_states(ctx, S)]
    assert len(states) > 10
    produced = _walk(space, ev, ctx, states)
    for name, st, new in produced:
        assert space.legal(new), (name, st, new)
        plan = to_plan(ev.evaluate(new, charge=False, exact=True), model, cl, GBS, "analytic")  # validates
        assert plan.world_size == cl.num_gpus
        assert plan.micro_batch_size == new.mbs and all(plan.micro_batch_per_rank(i) in space.batches
                                                        for i in range(plan.num_stages))
    by_name = Counter(name for name, _, _ in produced)
    for name in ("move_units", "inc_dp", "tp_to_dp", "inc_mbs", "sp_off", "dp_to_cp", "inc_vpp", "features_off"):
        assert by_name[name] > 0, name   # the modern primitives do produce plans here


def test_megatron_lm_primitives_stay_expressible():
    model, cl, _cm, space, ev, ctx = _setup(target="megatron-lm", limit=30000, virtual_stages=[1, 2],
                                            context_parallel_sizes=[1, 2])
    states = [s for S in (1, 2, 4) for s in initial_states(ctx, S)]
    assert states
    produced = _walk(space, ev, ctx, states)
    assert len({new for _, _, new in produced}) > 20
    for name, st, new in produced:
        e = ev.evaluate(new, charge=False, exact=True)
        if not e.fits:
            continue
        plan = to_plan(e, model, cl, GBS, "analytic")
        assert megatron_lm.problem(plan) is None, (name, new)


def test_gpu_moves_respect_node_boundaries():
    # 2 nodes of 4: a stage of tp 4 must start at a multiple of 4; shapes that would straddle are never produced
    _model, _cl, _cm, space, _ev, _ctx = _setup()
    st = State(8, (Shape(1, 2), Shape(4, 1), Shape(2, 1)), (0, 4, 8, 12))
    assert not space.legal(st)  # TP group of ranks 2..5 straddles the node boundary
    ok = State(8, (Shape(2, 2), Shape(4, 1)), (0, 6, 12))
    assert space.legal(ok)


def test_balanced_bounds_balances_cost_not_count():
    model, _cl, _cm, _space, _ev, ctx = _setup(cluster="1x4-h100", layers=8)
    shapes = (Shape(1, 1), Shape(1, 1), Shape(2, 1))  # the last stage has twice the GPUs: it gets more units
    b = balanced_bounds(ctx, shapes, 4, model.num_units)
    sizes = np.diff(b)
    assert sizes[2] > sizes[0] and sizes.sum() == model.num_units


def test_balanced_bounds_interleaved_and_on_layers():
    # 2 stages x 2 chunks of equal shapes over 8 layers: 4 chunks of 2 layers; megatron-lm cuts on layer starts
    model, _cl, _cm, _space, _ev, ctx = _setup(cluster="1x4-h100", layers=8, target="megatron-lm")
    b = balanced_bounds(ctx, (Shape(2, 1),) * 2, 4, model.num_units, v=2)
    assert b == (0, 4, 8, 12, 16)
    b3 = balanced_bounds(ctx, (Shape(2, 1),) * 3, 4, model.num_units)
    assert set(b3) <= set(model.layer_starts) and len(b3) == 4


def test_features_primitives_flip_one_switch():
    _model, _cl, _cm, space, ev, ctx = _setup(cluster="1x4-h100")
    st = initial_states(ctx, 2)[0]
    assert st.features == Features(True, True, True)          # the preferred combination: everything on
    e = ev.evaluate(st, charge=False)
    off = APPLY["features_off"](ctx, e, 0)
    assert {s.features for s in off} == {Features(True, True, False), Features(True, False, True)}
    assert not APPLY["features_on"](ctx, e, 0)


SHAPE_MOVES = ("inc_tp", "inc_dp", "dec_tp", "dec_dp", "tp_to_dp", "dp_to_tp", "dp_to_cp", "cp_to_dp", "sp_on",
               "sp_off")


def test_one_stage_shape_moves_keep_the_micro_batch():
    """A shape move of one stage keeps the plan-wide micro-batch (none where the new shapes cannot run it): the
    micro-batch is inc_mbs/dec_mbs's to change; a stage move that retargeted it sent the aceso-compat GPT-13B
    search astray (docs/search.md)."""
    _model, _cl, _cm, space, ev, ctx = _setup(context_parallel_sizes=[1, 2])
    states = [s for S in (2, 3, 4) for s in initial_states(ctx, S)]
    moves = [(n, st, new) for n, st, new in _walk(space, ev, ctx, states) if n in SHAPE_MOVES
             and any(a == b for a, b in zip(st.shapes, new.shapes))]   # moves of every stage may retarget it
    assert len(moves) > 50
    for name, st, new in moves:
        assert new.mbs == st.mbs, (name, st, new)
    # and where the micro-batch does not suit the new shape there is no move: stage 0 at tp 2 dp 1, micro-batch 1
    st = next(s for s in states if s.mbs == 1 and s.shapes[0].tp == 2 and s.shapes[0].dp == 1)
    assert APPLY["tp_to_dp"](ctx, ev.evaluate(st, charge=False), 0) == []
