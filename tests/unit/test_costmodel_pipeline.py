"""1F1B pipeline time: the closed form against a hand-worked schedule and an event-driven simulation."""

from __future__ import annotations

import random

import pytest

from search.costmodel.pipeline import interleaved_one_f_one_b, one_f_one_b
from tests.unit.search_helpers import simulate_1f1b


def test_two_stages_worked_by_hand():
    # F = (1, 2), B = (3, 4), M = 4: the schedule drawn out by hand ends at 28 (stage 0's last backward)
    assert one_f_one_b([1, 2], [3, 4], [0, 0], 4).iteration_ms == 28.0
    assert simulate_1f1b([1, 2], [3, 4], 4) == 28.0


@pytest.mark.parametrize("p,m", [(1, 1), (1, 8), (4, 4), (4, 16), (8, 64)])
def test_identical_stages_give_the_textbook_bubble(p, m):
    f, b = 1.5, 3.25
    cost = one_f_one_b([f] * p, [b] * p, [0.0] * p, m)
    assert cost.iteration_ms == pytest.approx((m + p - 1) * (f + b))
    assert cost.bubble_ms == pytest.approx((p - 1) * (f + b))


def test_heterogeneous_stages_against_simulation():
    """The recurrence (with its periodic jump) is exact against the independent simulation, for any stages."""
    rnd = random.Random(7)
    for trial in range(600):
        p, m = rnd.randint(1, 8), rnd.randint(1, 40)
        fwd = [rnd.uniform(0.5, 3) for _ in range(p)]
        bwd = [rnd.uniform(0.5, 6) for _ in range(p)]
        if trial % 5 == 0:           # equal and near-equal stages: the jump is taken from the first rounds
            fwd, bwd = [1.5 + 1e-4 * rnd.random() for _ in range(p)], [2.5] * p
        sim = simulate_1f1b(fwd, bwd, m)
        got = one_f_one_b(fwd, bwd, [0.0] * p, m).iteration_ms
        assert got == pytest.approx(sim, rel=1e-12)


def test_sync_adds_after_each_stage_and_bottleneck_is_the_slowest():
    cost = one_f_one_b([1, 1, 1], [2, 5, 2], [0.0, 0.0, 0.0], 10)
    assert cost.bottleneck == 1
    synced = one_f_one_b([1, 1, 1], [2, 2, 2], [7.0, 0.0, 0.0], 10)
    plain = one_f_one_b([1, 1, 1], [2, 2, 2], [0.0, 0.0, 0.0], 10)
    assert synced.iteration_ms == pytest.approx(plain.iteration_ms + 7.0)


# ----- interleaved 1F1B (virtual stages) ---------------------------------------------------------------------------
@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (8, 2, 16), (3, 3, 6), (4, 2, 12)])
def test_interleaved_identical_chunks_bubble_is_1f1b_bubble_over_v(p, v, m):
    """Narayanan et al. (SC'21, section 2.2.2): with v chunks per stage the bubble is (p-1)(F+B)/v, F = v f."""
    f, b = 1.5, 2.5
    inter = interleaved_one_f_one_b([[f] * v] * p, [[b] * v] * p, [0.0] * p, m)
    plain = one_f_one_b([f * v] * p, [b * v] * p, [0.0] * p, m)
    assert inter.iteration_ms == pytest.approx((m * v + p - 1) * (f + b))
    assert inter.bubble_ms == pytest.approx(plain.bubble_ms / v)
    assert inter.num_chunks == v


def test_interleaved_uneven_chunks_are_bounded_by_the_work():
    fwd = [[1.0, 3.0], [2.0, 1.0], [1.0, 1.0]]
    bwd = [[2.0, 6.0], [4.0, 2.0], [2.0, 2.0]]
    r = interleaved_one_f_one_b(fwd, bwd, [0.5, 0.0, 0.0], 6)
    busiest = max(6 * (sum(f) + sum(b)) + s for f, b, s in zip(fwd, bwd, [0.5, 0.0, 0.0]))
    assert r.iteration_ms >= busiest and r.bottleneck == 0
    assert r.iteration_ms == pytest.approx(max(r.stage_total_ms))


def test_in_flight_per_chunk_follows_megatron_core_warmup():
    """megatron-core 0.16 ``get_pp_rank_microbatches``: warm-up = 2 (p - r - 1) + (v - 1) p, chunk (k // p) % v."""
    from search.costmodel.memory import in_flight, in_flight_per_chunk
    assert in_flight_per_chunk(1, 4, 1, 8) == (in_flight(1, 4, 8),) == (3,)
    # rank 0 of p=4, v=2: 6 + 4 warm-up forwards + 1 -> chunks 0,0,0,0,1,1,1,1,0,0,0
    assert in_flight_per_chunk(0, 4, 2, 8) == (7, 4)
    assert in_flight_per_chunk(3, 4, 2, 8) == (4, 1)          # the last rank: (v - 1) p + 1
    assert sum(in_flight_per_chunk(0, 2, 2, 1)) == 2          # capped at M v
