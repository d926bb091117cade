"""Rank layout and stage-to-stage routes against brute force (no process groups needed)."""

from __future__ import annotations

import itertools

import pytest

from aceso_megatron.parallel.layout import RankLayout, embedding_stages, sample_range
from aceso_megatron.parallel.p2p import boundary_routes
from search.model import ModelSpec
from search.plan import ParallelPlan

GPT = ModelSpec(name="g", family="gpt", num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                seq_length=16, vocab_size=128)


def make(stages, mb=12):
    n = GPT.num_units // len(stages)
    return ParallelPlan(model=GPT, micro_batch_size=mb, global_batch_size=mb, stages=[
        {"num_gpus": tp * dp, "tp": tp, "dp": dp, "start_unit": i * n, "end_unit": (i + 1) * n if i < len(stages) - 1
             else GPT.num_units, "recompute": ["none"] * (n if i < len(stages) - 1 else GPT.num_units - i * n)}
        for i, (tp, dp) in enumerate(stages)])


def test_layout_tp_adjacent_dp_strided():
    p = make([(2, 2), (1, 1)])
    got = [(l.stage, l.tp_rank, l.dp_rank) for l in (RankLayout.of(p, r) for r in range(5))]
    assert got == [(0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1), (1, 0, 0)]
    assert RankLayout.of(p, 3).tp_ranks() == [2, 3] and RankLayout.of(p, 3).dp_ranks() == [1, 3]


@pytest.mark.parametrize("a, b", list(itertools.product([(1, 1), (2, 1), (1, 2), (2, 2), (1, 3), (2, 3), (1, 4)],
                                                        repeat=2)))
def test_routes_cover_every_sample_once(a, b):
    """Every receiving rank gets each of its samples exactly once, from a sender that holds it."""
    p = make([a, b])
    for backward in (False, True):
        src_stage, dst_stage = (1, 0) if backward else (0, 1)
        routes = boundary_routes(p, 0, backward)
        for r in range(p.world_size):
            lay = RankLayout.of(p, r)
            if lay.stage != dst_stage:
                continue
            want = set(range(*sample_range(p.micro_batch_size, lay.dp, lay.dp_rank)))
            got = []
            for rt in (x for x in routes if x.dst == r):
                s = RankLayout.of(p, rt.src)
                assert s.stage == src_stage
                assert set(range(rt.lo, rt.hi)) <= set(range(*sample_range(p.micro_batch_size, s.dp, s.dp_rank)))
                got += range(rt.lo, rt.hi)
            assert sorted(got) == sorted(want)


def test_embedding_stages():
    assert embedding_stages(make([(1, 1), (1, 1), (1, 1)])) == [0, 2]
    untied = GPT.model_copy(update={"tied_embeddings": False})
    p = make([(1, 1), (1, 1)]).model_copy(update={"model": untied})
    assert embedding_stages(p) == [0]
