"""A stage's expert groups (``RankLayout``'s etp/ep/edp/etp x ep ranks) against megatron-core's own expert
``RankGenerator`` (``parallel_state.initialize_model_parallel``'s order ``tp-cp-ep-dp-pp``, cp 1 for experts) for
a uniform run of that stage's shape, offset to the stage's first rank; and the worked table of docs/runtime.md."""

from __future__ import annotations

import pytest
from megatron.core.parallel_state import RankGenerator

from aceso_megatron.parallel.layout import RankLayout
from search.layers.moe_spec import MoESpec
from search.spec.plan import ParallelPlan
from tests.tiny_models import LLAMA

MOE = LLAMA.model_copy(update={"name": "m", "num_layers": 4, "num_query_groups": 4, "moe": MoESpec(num_experts=8, moe_router_topk=2,
                                                                          moe_ffn_hidden_size=32)})
# (tp, dp, ep, etp) of the second stage (the first is tp1 dp2 ep2: its ranks offset the second)
SHAPES = [(1, 2, 2, 1), (2, 1, 2, 1), (2, 2, 2, 1), (2, 2, 4, 1), (2, 2, 2, 2), (2, 2, 1, 2), (4, 2, 2, 2),
          (2, 4, 8, 1), (4, 1, 1, 1), (2, 4, 2, 4)]


def _plan(tp, dp, ep, etp):
    st = [{"num_gpus": 2, "tp": 1, "dp": 2, "ep": 2, "start_unit": 0, "end_unit": 3, "recompute": ["none"] * 3},
          {"num_gpus": tp * dp, "tp": tp, "dp": dp, "ep": ep, "etp": etp, "sequence_parallel": tp > 1,
           "start_unit": 3, "end_unit": 8, "recompute": ["none"] * 5}]
    return ParallelPlan(model=MOE, micro_batch_size=8, global_batch_size=8, stages=st)


def _group_of(groups, rank):
    return next(g for g in groups if rank in g)


@pytest.mark.parametrize("shape", SHAPES)
def test_expert_groups_are_megatron_cores(shape):
    tp, dp, ep, etp = shape
    plan = _plan(*shape)
    first, n = plan.first_rank(1), tp * dp
    gen = RankGenerator(tp=etp, ep=ep, dp=n // (etp * ep), pp=1, cp=1, order="tp-cp-ep-dp-pp", rank_offset=first)
    for r in range(first, first + n):
        lay = RankLayout.of(plan, r)
        assert lay.etp_ranks() == _group_of(gen.get_ranks("tp"), r)
        assert lay.ep_ranks() == _group_of(gen.get_ranks("ep"), r)
        assert lay.edp_ranks() == _group_of(gen.get_ranks("dp"), r)
        assert lay.etp_ep_ranks() == _group_of(gen.get_ranks("tp-ep"), r)
        assert lay.edp == n // (etp * ep)


def test_worked_table_of_the_docs():
    """docs/runtime.md's folding table: stage 1 = tp2 x dp2 (SP) with experts etp1 x ep4, ranks 2-5."""
    plan = _plan(2, 2, 4, 1)
    rows = [(r, *(lambda lay: (lay.tp_rank, lay.dp_rank, lay.ep_rank, lay.etp_rank, lay.edp_rank))(
        RankLayout.of(plan, r))) for r in range(2, 6)]
    assert rows == [(2, 0, 0, 0, 0, 0), (3, 1, 0, 1, 0, 0), (4, 0, 1, 2, 0, 0), (5, 1, 1, 3, 0, 0)]
    assert RankLayout.of(plan, 2).ep_ranks() == [2, 3, 4, 5]
    assert RankLayout.of(plan, 2).tp_ranks() == [2, 3] and RankLayout.of(plan, 2).dp_ranks() == [2, 4]
