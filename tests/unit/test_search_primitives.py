"""Every primitive keeps plans valid: legal shapes, GPUs summing to the cluster, TP groups inside a node."""

import itertools

import numpy as np
import pytest

from search.cluster import parse_cluster
from search.costmodel import make_cost_model
from search.planner.aceso import initial_states
from search.planner.bottleneck import PRIMITIVES
from search.planner.primitives import APPLY, Ctx, balanced_bounds
from search.planner.state import Evaluator, Space, State, to_plan
from search.presets import load_model
from search.training import TrainingSpec


def _setup(cluster="2x4-h100", layers=6, limit=None):
    model = load_model("gpt-1.3b", num_layers=layers)
    cl = parse_cluster(cluster, memory_limit_mb=limit)
    tr = TrainingSpec(global_batch_size=64)
    cm = make_cost_model(model, cl, tr)
    space = Space.of(model, cl, tr)
    ev = Evaluator(cm, 64)
    return model, cl, cm, space, ev, Ctx(space, ev)


@pytest.mark.parametrize("limit", [None, 20000])
def test_every_primitive_keeps_plans_valid(limit):
    model, cl, _cm, space, ev, ctx = _setup(limit=limit)
    states = [s for S in (1, 2, 3, 4, 5) for s in initial_states(ctx, S)]
    assert len(states) > 10
    produced = 0
    for st in states:
        e = ev.evaluate(st, charge=False)
        for b, name in itertools.product(range(st.num_stages), PRIMITIVES):
            for new in APPLY[name](ctx, e, b):
                produced += 1
                assert space.legal(new), (name, st, new)
                plan = to_plan(ev.evaluate(new, charge=False), model, cl, 64, "analytic")  # validates
                assert plan.world_size == cl.num_gpus
    assert produced > 200


def test_gpu_moves_respect_node_boundaries():
    # 2 nodes of 4: a stage of tp 4 must start at a multiple of 4; shapes that would straddle are never produced
    _model, _cl, _cm, space, _ev, _ctx = _setup()
    st = State(8, ((1, 2), (4, 1), (2, 1)), (0, 4, 8, 12))
    assert not space.legal(st)  # TP group of ranks 2..5 straddles the node boundary
    ok = State(8, ((2, 2), (4, 1)), (0, 6, 12))
    assert space.legal(ok)


def test_balanced_bounds_balances_cost_not_count():
    model, _cl, _cm, _space, _ev, ctx = _setup(cluster="1x4-h100", layers=8)
    shapes = ((1, 1), (1, 1), (2, 1))  # the last stage has twice the GPUs: it should get more units
    b = balanced_bounds(ctx, shapes, 4, model.num_units)
    sizes = np.diff(b)
    assert sizes[2] > sizes[0] and sizes.sum() == model.num_units
