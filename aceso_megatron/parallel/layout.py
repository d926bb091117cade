"""Rank layout and process groups of a ``ParallelPlan``.

Stage ``s`` owns ranks ``[first_rank(s), first_rank(s) + num_gpus)``. Inside it ranks are ordered as in Megatron
(``tp-cp-dp``): rank ``first + t + tp * (c + cp * j)`` has TP index ``t``, CP index ``c`` and DP index ``j``. TP
groups are ``tp`` adjacent ranks, CP groups are strided by ``tp``, DP groups by ``tp * cp``. ``RankLayout`` is
pure arithmetic (testable without torch.distributed); ``build_groups`` creates every group on every rank in the
same order (``torch.distributed.new_group`` is collective) and returns this rank's ``ProcessGroupCollection`` for
megatron-core.

An MoE model's stages also get megatron-core's expert groups, folded over the same GPUs in its expert
``RankGenerator`` order ``tp-ep-dp``: rank ``first + t + etp * (e + ep * j)`` has expert-TP index ``t``, EP index
``e`` and expert-DP index ``j`` (ETP groups adjacent, EP strided by ``etp``, expert-DP by ``etp * ep``), plus the
expert tensor-and-model group (``etp x ep``, the dispatchers' ``tp_ep``); they go into the stage's
``ProcessGroupCollection`` (``ep``, ``expt_tp``, ``expt_dp``, ``tp_ep``), which ``MoELayer`` and DDP read.

megatron-core's schedules only ask the pipeline group for ``rank()``/``size()`` (first/last stage, warm-up
length); stages of different widths have no common pipeline group, so ``StagePosition`` stands in for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from search.settings.moe_plan import expert_tp
from search.spec.plan import ParallelPlan


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
    cp: int = 1
    cp_rank: int = 0
    ep: int = 1   # the stage's expert shape, folded over the same GPUs: etp fastest, then ep, then edp
    etp: int = 1
    ep_rank: int = 0
    etp_rank: int = 0
    edp_rank: int = 0

    @classmethod
    def of(cls, plan: ParallelPlan, rank: int) -> RankLayout:
        s = plan.stage_of_rank(rank)
        st = plan.stages[s]
        first = plan.first_rank(s)
        local = rank - first
        etp = expert_tp(st)
        return cls(rank, s, st.tp, st.dp, local % st.tp, local // (st.tp * st.cp), first, st.cp,
                   (local // st.tp) % st.cp, st.ep, etp, (local // etp) % st.ep, local % etp,
                   local // (etp * st.ep))

    @property
    def edp(self) -> int:
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

    def _expert_rank(self, t: int, e: int, j: int) -> int:
        return self.first_rank + t + self.etp * (e + self.ep * j)

    def etp_ranks(self) -> list[int]:
        return [self._expert_rank(t, self.ep_rank, self.edp_rank) for t in range(self.etp)]

    def ep_ranks(self) -> list[int]:
        return [self._expert_rank(self.etp_rank, e, self.edp_rank) for e in range(self.ep)]

    def edp_ranks(self) -> list[int]:
        return [self._expert_rank(self.etp_rank, self.ep_rank, j) for j in range(self.edp)]

    def etp_ep_ranks(self) -> list[int]:
        """megatron-core's expert tensor-and-model group: the etp x ep ranks of this expert-DP index."""
        return [self._expert_rank(t, e, self.edp_rank) for e in range(self.ep) for t in range(self.etp)]

    def stage_ranks(self) -> list[int]:
        return list(range(self.first_rank, self.first_rank + self.tp * self.cp * self.dp))

    def _rank(self, t: int, c: int, j: int) -> int:
        return self.first_rank + t + self.tp * (c + self.cp * j)

    def tp_ranks(self) -> list[int]:
        return [self._rank(t, self.cp_rank, self.dp_rank) for t in range(self.tp)]

    def cp_ranks(self) -> list[int]:
        return [self._rank(self.tp_rank, c, self.dp_rank) for c in range(self.cp)]

    def dp_ranks(self) -> list[int]:
        return [self._rank(self.tp_rank, self.cp_rank, j) for j in range(self.dp)]

    def tp_cp_ranks(self) -> list[int]:
        return [self._rank(t, c, self.dp_rank) for c in range(self.cp) for t in range(self.tp)]

    def dp_cp_ranks(self) -> list[int]:
        """Megatron's data-and-context-parallel group: every rank of the stage with this TP index."""
        return [self._rank(self.tp_rank, c, j) for j in range(self.dp) for c in range(self.cp)]


def stage_rank(plan: ParallelPlan, stage: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
    st = plan.stages[stage]
    return plan.first_rank(stage) + tp_rank + st.tp * (cp_rank + st.cp * dp_rank)


def sample_range(micro_batch_size: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """Samples ``[lo, hi)`` of the pipeline micro-batch that DP replica ``dp_rank`` of a stage with ``dp`` runs."""
    n = micro_batch_size // dp
    return dp_rank * n, (dp_rank + 1) * n


def stage_of_unit(plan: ParallelPlan, unit: int) -> int:
    return next(s for s, _, ch in plan.chunks_in_order() if ch.start_unit <= unit < ch.end_unit)


def embedding_stages(plan: ParallelPlan) -> list[int]:
    """Stages holding a copy of the word embedding: the first, the one of the first T5 decoder unit (decoder
    input embedding), and the last when input and output embeddings are tied or it holds the MTP block."""
    m = plan.model
    stages = {0}
    if m.is_t5:
        stages.add(stage_of_unit(plan, m.num_encoder_units))
    if m.tied_embeddings or m.mtp_num_layers:   # the MTP block embeds on the last stage
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
    cp: dist.ProcessGroup  # the stage's CP group (just this rank when cp == 1)
    dp_cp: dist.ProcessGroup  # DP x CP: what DDP reduces over (the DP group when cp == 1)
    embedding: dist.ProcessGroup | None  # stages holding a word-embedding copy (if > 1 stage), see below
    world: dist.ProcessGroup
    pg_collection: ProcessGroupCollection
    embedding_sharded: bool = False  # holders share one TP: one group per TP index, shards reduced directly


_EXPERT_KINDS = [("etp", RankLayout.etp_ranks), ("ep", RankLayout.ep_ranks), ("edp", RankLayout.edp_ranks),
                 ("etp_ep", RankLayout.etp_ep_ranks), ("stage", RankLayout.stage_ranks)]


def _stage_groups(plan: ParallelPlan, rank: int) -> dict[str, dist.ProcessGroup]:
    """TP, CP, DP and DP x CP groups of every stage (created on every rank, in one order); this rank's."""
    mine: dict[str, dist.ProcessGroup] = {}
    for s, st in enumerate(plan.stages):
        lays = [RankLayout.of(plan, r) for r in range(plan.first_rank(s), plan.first_rank(s) + st.num_gpus)]
        kinds = [("tp", RankLayout.tp_ranks), ("cp", RankLayout.cp_ranks), ("dp", RankLayout.dp_ranks),
                 ("tp_cp", RankLayout.tp_cp_ranks), ("dp_cp", RankLayout.dp_cp_ranks)]
        if plan.model.moe is not None:
            kinds += _EXPERT_KINDS
        for kind, members_of in kinds:
            if kind in ("cp", "tp_cp", "dp_cp") and st.cp == 1:
                continue
            done = set()
            for lay in lays:
                members = tuple(members_of(lay))
                if members in done:
                    continue
                done.add(members)
                g = dist.new_group(list(members))
                if rank in members:
                    mine[kind] = g
    return mine


def build_groups(plan: ParallelPlan, rank: int) -> Groups:
    """Create all groups of the plan (every rank, same order) and return this rank's."""
    me = RankLayout.of(plan, rank)
    mine = _stage_groups(plan, rank)
    single = None
    for r in range(plan.world_size):
        g = dist.new_group([r])
        if r == rank:
            single = g
    cp_group = mine.get("cp", single)
    dp_cp = mine.get("dp_cp", mine["dp"])
    embedding = None
    emb = embedding_stages(plan)
    sharded = len({plan.stages[s].tp for s in emb}) == 1
    if len(emb) > 1:
        ranks = [r for s in emb for r in range(plan.first_rank(s), plan.first_rank(s) + plan.stages[s].num_gpus)]
        lists = [[r for r in ranks if RankLayout.of(plan, r).tp_rank == t] for t in range(plan.stages[emb[0]].tp)]
        for members in (lists if sharded else [ranks]):
            g = dist.new_group(members)
            if rank in members:
                embedding = g

    tp = mine["tp"]
    pgc = ProcessGroupCollection()
    pgc.tp = tp
    pgc.cp = cp_group
    pgc.tp_cp = mine.get("tp_cp", tp)
    pgc.dp = mine["dp"]
    pgc.dp_cp = dp_cp
    pgc.intra_dp_cp = dp_cp
    pgc.intra_dist_opt = dist.group.WORLD  # distributed optimizer: its gradient-norm group (disjoint shards)
    pgc.expt_dp = mine.get("edp", dp_cp)   # MoE: the stage's expert groups (etp x ep x edp folded over its GPUs)
    pgc.intra_expt_dp = pgc.expt_dp
    pgc.ep = mine.get("ep", single)
    pgc.expt_tp = mine.get("etp", tp)
    pgc.tp_ep = mine.get("etp_ep", tp)
    pgc.tp_ep_pp = pgc.tp_ep
    if "stage" in mine:
        pgc.tp_dp_cp = mine["stage"]   # the router's group for a global aux loss
    pgc.mp = tp
    pgc.pp = StagePosition(me.stage, plan.num_stages)
    pgc.embd = None  # tied embeddings across stages are synchronised by aceso_megatron.parallel.grads
    pgc.pos_embd = None
    return Groups(me, tp, mine["dp"], cp_group, dp_cp, embedding, dist.group.WORLD, pgc, sharded)
