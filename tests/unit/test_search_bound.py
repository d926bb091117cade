"""The evaluator's pipeline lower bound (``state.lower_bound``) against the cost model's exact schedules: never above
them (so pruning by it never drops an improving plan) and equal to them for identical stages."""

import random

import pytest

from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.costmodel.types import StageCost
from search.planner.state import lower_bound
from search.spec.presets import load_model
from search.spec.training import TrainingSpec


def _cm():
    return make_cost_model(load_model("gpt-1.3b"), parse_cluster("1x8-h100"), TrainingSpec(global_batch_size=64))


def _stage(rng, v, f=None, b=None):
    f = f if f is not None else rng.uniform(0.5, 2.0)
    b = b if b is not None else rng.uniform(1.0, 4.0)
    kw = {}
    if v > 1:
        kw = {"chunk_fwd_ms": tuple(f / v * rng.uniform(0.7, 1.3) for _ in range(v)),
              "chunk_bwd_ms": tuple(b / v * rng.uniform(0.7, 1.3) for _ in range(v))}
    return StageCost(fwd_ms=f, bwd_ms=b, recompute_ms=rng.uniform(0, 0.5), p2p_ms=rng.uniform(0, 0.2),
                     dp_sync_ms=rng.uniform(0, 5), optimizer_ms=rng.uniform(0, 3),
                     prologue_ms=rng.choice([0.0, rng.uniform(0, 2)]), **kw)


@pytest.mark.parametrize("seed", range(8))
def test_lower_bound_never_exceeds_the_schedule(seed):
    rng = random.Random(seed)
    cm = _cm()
    for _ in range(40):
        p = rng.randint(1, 8)
        v = rng.choice([1, 1, 2, 3]) if p > 1 else 1
        M = rng.choice([p, 2 * p, 4 * p]) if v > 1 else rng.randint(1, 40)
        costs = [_stage(rng, v) for _ in range(p)]
        assert lower_bound(costs, M)[0] <= cm.pipeline(costs, M).iteration_ms * (1 + 1e-12)


@pytest.mark.parametrize("p,M", [(1, 7), (4, 16), (8, 8), (6, 40)])
def test_lower_bound_is_exact_for_identical_stages(p, M):
    # (M + p - 1)(F + B) + sync + step: the textbook 1F1B time (SC'21 eq. 1)
    cm = _cm()
    costs = [StageCost(fwd_ms=1.0, bwd_ms=2.0, recompute_ms=0.5, p2p_ms=0.2, dp_sync_ms=3.0, optimizer_ms=1.0)
             for _ in range(p)]
    bound = lower_bound(costs, M)[0]
    assert bound == pytest.approx((M + p - 1) * 3.7 + 4.0, rel=1e-12)
    assert cm.pipeline(costs, M).iteration_ms == pytest.approx(bound, rel=1e-9)
