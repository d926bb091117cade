"""Rank layout and process groups of a ``ParallelPlan``.

Stage ``s`` owns ranks ``[first_rank(s), first_rank(s) + num_gpus)``. Inside it, rank ``first + j*tp + t`` has
TP index ``t`` and DP index ``j``: TP groups are ``tp`` adjacent ranks, DP groups are strided by ``tp`` (as in
Megatron and Aceso). ``RankLayout`` is pure arithmetic (testable without torch.distributed); ``build_groups``
creates every group on every rank in the same order (``torch.distributed.new_group`` is collective) and returns
this rank's ``ProcessGroupCollection`` for megatron-core.

megatron-core's schedules only ask the pipeline group for ``rank()``/``size()`` (first/last stage, warm-up
length); stages of different widths have no common pipeline group, so ``StagePosition`` stands in for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from search.plan import ParallelPlan


@dataclass(frozen=True)
class RankLayout:
    """Where one rank sits in a plan."""

    rank: int
    stage: int
    tp: int
    dp: int
    tp_rank: int
    dp_rank: int
    first_rank: int

    @classmethod
    def of(cls, plan: ParallelPlan, rank: int) -> RankLayout:
        s = plan.stage_of_rank(rank)
        st = plan.stages[s]
        first = plan.first_rank(s)
        local = rank - first
        return cls(rank, s, st.tp, st.dp, local % st.tp, local // st.tp, first)

    def tp_ranks(self) -> list[int]:
        lo = self.first_rank + self.dp_rank * self.tp
        return list(range(lo, lo + self.tp))

    def dp_ranks(self) -> list[int]:
        return [self.first_rank + j * self.tp + self.tp_rank for j in range(self.dp)]


def stage_rank(plan: ParallelPlan, stage: int, dp_rank: int, tp_rank: int) -> int:
    return plan.first_rank(stage) + dp_rank * plan.stages[stage].tp + tp_rank


def sample_range(micro_batch_size: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """Samples ``[lo, hi)`` of the pipeline micro-batch that DP replica ``dp_rank`` of a stage with ``dp`` runs."""
    n = micro_batch_size // dp
    return dp_rank * n, (dp_rank + 1) * n


def stage_of_unit(plan: ParallelPlan, unit: int) -> int:
    return next(i for i, st in enumerate(plan.stages) if st.start_unit <= unit < st.end_unit)


def embedding_stages(plan: ParallelPlan) -> list[int]:
    """Stages holding a copy of the word embedding: the first, the one of the first T5 decoder unit (decoder
    input embedding), and the last when input and output embeddings are tied."""
    m = plan.model
    stages = {0}
    if m.is_t5:
        stages.add(stage_of_unit(plan, m.num_encoder_units))
    if m.tied_embeddings:
        stages.add(plan.num_stages - 1)
    return sorted(stages)


class StagePosition:
    """A stand-in for the pipeline group: ``rank()`` is the stage index, ``size()`` the number of stages."""

    def __init__(self, stage: int, num_stages: int):
        self._stage, self._num = stage, num_stages

    def rank(self) -> int:
        return self._stage

    def size(self) -> int:
        return self._num


@dataclass
class Groups:
    """This rank's process groups."""

    layout: RankLayout
    tp: dist.ProcessGroup
    dp: dist.ProcessGroup
    single: dist.ProcessGroup  # just this rank (context parallel of size 1)
    embedding: dist.ProcessGroup | None  # stages holding a word-embedding copy (if > 1 stage), see below
    world: dist.ProcessGroup
    pg_collection: ProcessGroupCollection
    embedding_sharded: bool = False  # holders share one TP: one group per TP index, shards reduced directly


def build_groups(plan: ParallelPlan, rank: int) -> Groups:
    """Create all groups of the plan (every rank, same order) and return this rank's."""
    me = RankLayout.of(plan, rank)
    tp_group = dp_group = single = embedding = None
    for s, st in enumerate(plan.stages):
        for j in range(st.dp):
            ranks = [stage_rank(plan, s, j, t) for t in range(st.tp)]
            g = dist.new_group(ranks)
            if rank in ranks:
                tp_group = g
        for t in range(st.tp):
            ranks = [stage_rank(plan, s, j, t) for j in range(st.dp)]
            g = dist.new_group(ranks)
            if rank in ranks:
                dp_group = g
    for r in range(plan.world_size):
        g = dist.new_group([r])
        if r == rank:
            single = g
    emb = embedding_stages(plan)
    sharded = len({plan.stages[s].tp for s in emb}) == 1
    if len(emb) > 1:
        ranks = [r for s in emb for r in range(plan.first_rank(s), plan.first_rank(s) + plan.stages[s].num_gpus)]
        lists = [[r for r in ranks if RankLayout.of(plan, r).tp_rank == t] for t in range(plan.stages[emb[0]].tp)]
        for members in (lists if sharded else [ranks]):
            g = dist.new_group(members)
            if rank in members:
                embedding = g
    world = dist.group.WORLD

    pgc = ProcessGroupCollection()
    pgc.tp = tp_group
    pgc.cp = single
    pgc.tp_cp = tp_group
    pgc.dp = dp_group
    pgc.dp_cp = dp_group
    pgc.intra_dp_cp = dp_group
    pgc.intra_dist_opt = dist.group.WORLD  # distributed optimizer: its gradient-norm group (disjoint shards)
    pgc.expt_dp = dp_group
    pgc.intra_expt_dp = dp_group
    pgc.ep = single
    pgc.expt_tp = tp_group
    pgc.tp_ep_pp = tp_group
    pgc.mp = tp_group
    pgc.pp = StagePosition(me.stage, plan.num_stages)
    pgc.embd = None  # tied embeddings across stages are synchronised by aceso_megatron.parallel.grads
    pgc.pos_embd = None
    return Groups(me, tp_group, dp_group, single, embedding, world, pgc, sharded)
