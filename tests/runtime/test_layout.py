"""Rank layout, activation shards and stage-to-stage messages against brute force (no process groups needed).

Every boundary between two stage shapes (tp, dp, cp, sequence parallel) is simulated: a known global
activation, each provider rank's local piece of it (``shards.holding``), the messages ``boundary_messages``
plans, packed and unpacked as the communicator does; every needing rank must end up with exactly its own
piece, each element sent once.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from aceso_megatron.parallel.layout import RankLayout, embedding_stages, sample_range
from aceso_megatron.parallel.p2p import boundary_messages, message_numel, pack, unpack
from aceso_megatron.parallel.shards import boundary_segments, cp_token_index, holding
from search.spec.model import ModelSpec
from search.spec.plan import ParallelPlan
from tests.tiny_models import T5

GPT = ModelSpec(name="g", family="gpt", num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                seq_length=16, vocab_size=128)
# (tp, dp, cp, sequence_parallel): every combination the runtime re-shards between
SHAPES = [(1, 1, 1, False), (2, 1, 1, False), (2, 1, 1, True), (1, 2, 1, False), (2, 2, 1, True),
          (1, 3, 1, False), (4, 1, 1, True), (1, 1, 2, False), (2, 1, 2, True), (2, 2, 2, False)]


def stage(tp, dp, cp, sp, lo, hi):
    return {"num_gpus": tp * dp * cp, "tp": tp, "dp": dp, "cp": cp, "sequence_parallel": sp, "start_unit": lo,
            "end_unit": hi, "recompute": ["none"] * (hi - lo)}


def make(shapes, model=GPT, mb=12, cut=None):
    n = len(shapes)
    cuts = cut or [i * model.num_units // n for i in range(n)] + [model.num_units]
    return ParallelPlan(model=model, micro_batch_size=mb, global_batch_size=mb, stages=[
        stage(*sh, cuts[i], cuts[i + 1]) for i, sh in enumerate(shapes)])


def local_piece(full: torch.Tensor, plan, rank: int, segments):
    held = holding(plan, RankLayout.of(plan, rank), segments)
    idx = [i for lo, hi in held.seq for i in range(lo, hi)]
    return full[idx][:, held.batch[0]:held.batch[1]], held


def check_boundary(plan, provider: int, needer: int, segments):
    hidden = 3
    full = torch.arange(sum(segments) * plan.micro_batch_size * hidden, dtype=torch.float64).view(
        sum(segments), plan.micro_batch_size, hidden)
    messages = boundary_messages(plan, provider, needer, segments)
    for m in messages:
        assert RankLayout.of(plan, m.src).stage == provider and RankLayout.of(plan, m.dst).stage == needer
    first = plan.first_rank(needer)
    for r in range(first, first + plan.stages[needer].num_gpus):
        want, held = local_piece(full, plan, r, segments)
        mine = [m for m in messages if m.dst == r]
        assert sum(message_numel(m, hidden) for m in mine) == want.numel()  # each element exactly once
        bufs = [pack(m, *local_piece(full, plan, m.src, segments)).reshape(-1) for m in mine]
        assert torch.equal(unpack(mine, bufs, held, hidden), want), (provider, needer, r)


def test_layout_tp_adjacent_cp_then_dp_strided():
    p = make([(2, 2, 1, False), (1, 1, 1, False)])
    got = [(l.stage, l.tp_rank, l.dp_rank) for l in (RankLayout.of(p, r) for r in range(5))]
    assert got == [(0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1), (1, 0, 0)]
    assert RankLayout.of(p, 3).tp_ranks() == [2, 3] and RankLayout.of(p, 3).dp_ranks() == [1, 3]
    q = make([(2, 2, 2, False), (1, 1, 1, False)], mb=4)  # tp-cp-dp: rank = t + 2 * (c + 2 * j)
    lay = RankLayout.of(q, 5)
    assert (lay.tp_rank, lay.cp_rank, lay.dp_rank) == (1, 0, 1)
    assert lay.cp_ranks() == [5, 7] and lay.dp_ranks() == [1, 5] and lay.dp_cp_ranks() == [1, 3, 5, 7]


def test_holdings_follow_megatron_core_splits():
    """CP: chunks c and 2cp-1-c of 2cp (load balance); SP: contiguous parts of the local sequence."""
    p = make([(2, 1, 2, True), (1, 1, 1, False)], mb=4)
    got = [holding(p, RankLayout.of(p, r), (16,)).seq for r in range(4)]
    assert got == [((0, 4),), ((12, 16),), ((4, 8),), ((8, 12),)]
    assert cp_token_index(16, 2, 1) == list(range(4, 12))
    assert cp_token_index(8, 2, 0) == [0, 1, 6, 7]
    assert holding(p, RankLayout.of(p, 4), (16,)).seq == ((0, 16),)


@pytest.mark.parametrize("a, b", list(itertools.product(SHAPES, repeat=2)))
def test_boundary_reshards_every_shape_pair(a, b):
    p = make([a, b])
    segs = boundary_segments(p, 1)
    check_boundary(p, 0, 1, segs)   # forward: activations
    check_boundary(p, 1, 0, segs)   # backward: their gradients


def test_interleaved_ring_boundary_last_to_first():
    """Interleaved plans: stage S-1 feeds stage 0 (model chunk k -> k+1 wraps around)."""
    p = ParallelPlan(model=GPT, micro_batch_size=4, global_batch_size=8, stages=[
        {"num_gpus": 2, "tp": 2, "dp": 1, "sequence_parallel": True, "chunks": [
            {"start_unit": 0, "end_unit": 3, "recompute": ["none"] * 3},
            {"start_unit": 5, "end_unit": 6, "recompute": ["none"]}]},
        {"num_gpus": 2, "tp": 1, "dp": 2, "chunks": [
            {"start_unit": 3, "end_unit": 5, "recompute": ["none"] * 2},
            {"start_unit": 6, "end_unit": 8, "recompute": ["none"] * 2}]}])
    check_boundary(p, 1, 0, (16,))
    check_boundary(p, 0, 1, (16,))


@pytest.mark.parametrize("a, b", [((2, 1, 1, True), (1, 1, 1, False)), ((1, 2, 1, False), (2, 1, 1, True)),
                                  ((2, 1, 1, True), (2, 2, 1, True))])
def test_t5_decoder_boundary_with_two_segments(a, b):
    """T5 decoder stages exchange [encoder output; decoder hidden], each part sequence-sharded on its own."""
    p = make([a, b], model=T5, mb=4, cut=[0, 7, 10])
    segs = boundary_segments(p, 1)
    assert segs == (16, 8)
    check_boundary(p, 0, 1, segs)
    check_boundary(p, 1, 0, segs)


def test_sample_ranges_cover_micro_batch():
    assert [sample_range(12, 3, j) for j in range(3)] == [(0, 4), (4, 8), (8, 12)]


def test_embedding_stages():
    assert embedding_stages(make([(1, 1, 1, False)] * 3)) == [0, 2]
    untied = GPT.model_copy(update={"tied_embeddings": False})
    p = make([(1, 1, 1, False)] * 2).model_copy(update={"model": untied})
    assert embedding_stages(p) == [0]
