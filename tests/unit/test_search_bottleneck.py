"""Bottleneck stage, its classification and the primitive order on hand-built breakdowns (SPEC §4.3-4.4)."""

from search.costmodel.types import StageCost
from search.planner.bottleneck import EFFECTS, classify, find_bottleneck, order_primitives


def sc(fwd=10.0, bwd=20.0, rec=0.0, p2p=0.0, mem=100.0, fits=True, ideal=30.0, tpc=0.0):
    return StageCost(fwd_ms=fwd, bwd_ms=bwd, recompute_ms=rec, p2p_ms=p2p, memory_mb=mem, fits=fits,
                     ideal_ms=ideal, tp_comm_ms=tpc)


def test_over_memory_stage_with_most_memory_is_the_bottleneck():
    stages = [sc(mem=900, fits=False), sc(mem=950, fits=False), sc(mem=200)]
    assert find_bottleneck(stages, [1.0, 2.0, 9.0], limit_mb=800) == 1
    assert classify(stages, 1, 800) == "memory"
    groups = order_primitives(stages, 1, 800)
    assert len(groups) == 1 and all(EFFECTS[p][1] == "-" for p in groups[0])
    assert "inc_mbs" not in groups[0] and "dec_mbs" in groups[0]


def test_slowest_stage_when_all_fit():
    stages = [sc(), sc(), sc()]
    assert find_bottleneck(stages, [5.0, 7.0, 6.0], limit_mb=800) == 1


def test_compute_bound():
    # stage 0 has most of the ideal compute and no inefficiency: compute first, time-reducing primitives first
    stages = [sc(fwd=30, bwd=60, ideal=90), sc(fwd=10, bwd=20, ideal=25, p2p=5)]
    assert classify(stages, 0, 800) == "compute"
    first = order_primitives(stages, 0, 800)[0]
    assert all(EFFECTS[p][0] == "-" for p in first)
    assert "move_units" in first


def test_communication_bound():
    # stage 1: little ideal work but a lot lost to TP collectives and p2p
    stages = [sc(fwd=30, bwd=60, ideal=88), sc(fwd=20, bwd=40, ideal=20, p2p=10)]
    assert classify(stages, 1, 800) == "communication"
    first = order_primitives(stages, 1, 800)[0]
    assert all(EFFECTS[p][2] == "-" for p in first)  # dec_tp, dec_dp, tp_to_dp: less communication


def test_recompute_bound():
    stages = [sc(rec=40, ideal=30), sc(rec=1, ideal=30), sc(rec=1, ideal=30)]
    assert classify(stages, 0, 800) == "recompute"
    first = order_primitives(stages, 0, 800)[0]
    assert all(EFFECTS[p][1] == "-" for p in first)


def test_every_primitive_listed_once():
    stages = [sc(rec=5, p2p=3), sc(fwd=40)]
    groups = order_primitives(stages, 1, 800)
    flat = [p for g in groups for p in g]
    assert sorted(flat) == sorted(EFFECTS) and len(flat) == len(set(flat))


def test_bubble_bound_plans_try_more_virtual_stages_first():
    stages = [sc(), sc(fwd=12)]
    assert classify(stages, 1, 800, bubble_share=0.25) == "bubble"
    assert classify(stages, 1, 800, bubble_share=0.05) != "bubble"
    groups = order_primitives(stages, 1, 800, bubble_share=0.25)
    assert groups[0] == ["inc_vpp"]
    flat = [p for g in groups for p in g]
    assert sorted(flat) == sorted(EFFECTS) and len(flat) == len(set(flat))
    over = [sc(mem=900, fits=False), sc()]
    assert order_primitives(over, 0, 800, bubble_share=0.25) == order_primitives(over, 0, 800)   # memory first
