"""The token dispatcher, searched (MoE models): alltoall, allgather and, on CUDA clusters, flex.

megatron-core 0.16.1 has one ``moe_token_dispatcher_type`` per model (``TransformerConfig``; Megatron-LM's
``--moe-token-dispatcher-type``), so the dispatcher is a plan-wide setting (``MoEPlanSettings.token_dispatcher``),
not a per-stage one. The search runs under the plan's settings (``Space.moe``; None: the defaults, alltoall) and
this module prices its final plans, and the uniform baseline's best few configurations, under every other
dispatcher on the same state (shapes, cuts, micro-batch, switches; recompute re-chosen by the evaluator): the
dispatcher changes the MoE units' dispatch / combine time and buffers, not which states are legal, so pricing the
finalists under each is what choosing it costs (a few evaluations, not a search per dispatcher). The fastest
fitting one is kept; ties keep the earlier candidate (the plan's own settings first, then alltoall, allgather,
flex). flex is priced as DeepEP / HybridEP run it (``moe_cost.flex_dispatch``: a token once per destination
node across the network, fanned out over NVLink, at the kernels' benchmarked bandwidths, plus its DeepEP buffer),
so it wins where the EP group spans nodes and loses inside an NVLink domain on Blackwell, where the benchmarked
HybridEP bandwidth (0.49 of NVLink) is below NCCL's.

Candidates (``candidates``): ``--dispatcher`` (``TrainingSpec.token_dispatchers``) keeps the ones it names, the first
the one the search runs under (``--dispatcher alltoall allgather`` keeps DeepEP and HybridEP out); flex (DeepEP /
HybridEP) needs CUDA, so not on a ``cpu`` cluster; the overlaps of the
base settings rule out what megatron-core refuses with them (``moe_plan.check_moe_settings``):
``shared_expert_overlap`` keeps alltoall, ``overlap_ep_comm`` excludes allgather.
"""

from __future__ import annotations

from ..moe_plan import MoEPlanSettings, dispatcher_settings
from .state import Evaluation, Evaluator

DISPATCHERS = ("alltoall", "allgather", "flex")


def candidates(model, cluster, base: MoEPlanSettings | None = None, allowed=None) -> list[MoEPlanSettings]:
    """The MoE settings to price a plan of ``model`` on ``cluster`` under: ``base`` (None: the defaults) first,
    then ``base`` with each other dispatcher megatron-core runs there (and ``allowed`` keeps: --dispatcher); empty
    for a dense model."""
    if model.moe is None:
        return []
    base = base or MoEPlanSettings()
    out = [base]
    for d in DISPATCHERS:
        if d == base.token_dispatcher or (d == "flex" and cluster.gpu.name == "cpu"):
            continue
        if allowed is not None and d not in allowed:
            continue
        if (base.shared_expert_overlap and d != "alltoall") or (base.overlap_ep_comm and d == "allgather"):
            continue
        out.append(dispatcher_settings(model, d, base))
    return out


class Dispatchers:
    """Prices states under each candidate dispatcher (one ``Evaluator`` each, so their stage caches are kept)."""

    def __init__(self, cm, gbs: int, target: str, base: MoEPlanSettings | None = None, accept=None):
        """``accept(evaluator, evaluation)``: an extra check a variant must pass (the megatron-lm target: the
        export's ``expressible``); None: any fitting variant."""
        self.base = base
        self.accept = accept
        cands = candidates(cm.model, cm.cluster, base, getattr(getattr(cm, "training", None), "token_dispatchers",
                                                                None))
        self.evaluators = [Evaluator(cm, gbs, None, target, s) for s in cands[1:]]

    def best(self, e: Evaluation) -> Evaluation:
        """``e`` or its state under another dispatcher when that is faster and fits (exact evaluations)."""
        if not e.fits:
            return e
        best = e
        for ev in self.evaluators:
            if ev.moe == (e.moe or self.base or MoEPlanSettings()):
                continue
            c = ev.evaluate(e.state, charge=False, exact=True)
            if c.fits and c.score < best.score and (self.accept is None or self.accept(ev, c)):
                best = c
        return best

    @property
    def active(self) -> bool:
        """Whether there is another dispatcher to try (an MoE model)."""
        return bool(self.evaluators)
