"""The plan-wide stack choices, searched: the token dispatcher (MoE models: alltoall, allgather and, on CUDA
clusters, flex), the EP communication overlap with delayed weight gradients, and (``--target megatron-lm``) the
CUDA-graph scope.

megatron-core 0.16.1 has one ``moe_token_dispatcher_type`` per model (``TransformerConfig``; Megatron-LM's
``--moe-token-dispatcher-type``), one ``overlap_moe_expert_parallel_comm`` and one ``cuda_graph_scope``, so these are
plan-wide settings (``MoEPlanSettings``; ``StackSettings.cuda_graphs``), not per-stage ones. The search runs under
the plan's settings (``Space.moe``; None: the defaults, alltoall) and this module prices its final plans, and the
uniform baseline's best few configurations, under every other combination megatron-core runs on the same state
(shapes, cuts, micro-batch, switches; recompute re-chosen by the evaluator): the choices change the MoE units'
dispatch / combine time, the overlap, the host-bound wait and buffers, not which states are legal, so pricing the
finalists under each is what choosing it costs (a few evaluations, not a search per choice). The fastest fitting
one is kept; ties keep the earlier candidate (the plan's own settings first, then alltoall, allgather, flex with
DeepEP, flex with HybridEP, each without, with the EP overlap, then with the shared-expert overlap). flex is priced
as DeepEP / HybridEP run it (``moe_cost.flex_dispatch``), so it wins where the EP group spans nodes; the overlap
(``costmodel/ep_overlap.py``) wins where the all-to-all is long against the layer's compute; a CUDA graph (``costmodel/host.py``) wins where the MoE layers are host-bound.

Candidates (``candidates``, ``graph_candidates``), megatron-core's rules (``moe_plan.check_moe_settings``,
``stack.refusal``; a variant whose plan the rules refuse is skipped): flex (DeepEP / HybridEP) needs CUDA, so not
on a ``cpu`` cluster; ``shared_expert_overlap`` (a model with a shared expert: the shared expert beside the
dispatch, ``moe_cost.py``) runs with alltoall, and from megatron-core 0.18 with flex
(``moe_plan.shared_overlap_dispatchers``, by the priced release), not with the EP overlap, and is offered on GPUs
under the analytic model; the EP overlap needs ep > 1, alltoall or flex, no full recompute (the evaluator then
re-chooses recompute without it) and, with pipeline stages, virtual chunks; ``delay_wgrad`` comes with the overlap. CUDA graphs (megatron-lm target only: the aceso runtime captures none):
transformer-engine graphs of ``attn moe_router moe_preprocess`` (Megatron-Bridge's MoE recipes) and of
``moe_router moe_preprocess``, on a hybrid model with Mamba layers each also with ``mamba`` (the Nemotron-3 recipes'
``attn mamba moe_router moe_preprocess``: the Mamba layer before an MoE one is in its host-bound wait), and on
drop-and-pad MoE megatron-core's ``full_iteration`` graph (``local``; the export writes
``--no-check-for-nan-in-loss-and-grad`` with it, as validate_args asserts); a dense model's graphs remove no priced
host time (``host.py``) and are not offered.
Fine-grained activation offload (``fine_offload.py``; the megatron-lm target from megatron-core 0.16) is priced on the
finalists that recompute, on their own stack and each graph scope's where megatron-core runs the two together.
``--dispatcher`` (``TrainingSpec.token_dispatchers``) keeps the dispatchers it names, the first the one the search
runs under (``--dispatcher alltoall allgather`` keeps DeepEP and HybridEP out).
"""

from __future__ import annotations

import pydantic

from ..costmodel.types import StackKey
from search.settings.moe_plan import MoEPlanSettings
from search.settings.stack import drop_and_pad
from . import fine_offload
from .state import Evaluation, Evaluator

DISPATCHERS = ("alltoall", "allgather", "flex")
GRAPH_SCOPES = (frozenset({"attn", "moe_router", "moe_preprocess"}), frozenset({"moe_router", "moe_preprocess"}))
FULL_ITERATION = frozenset({"full_iteration"})     # megatron-core's own capture of the whole forward-backward


def candidates(model, cluster, base: MoEPlanSettings | None = None, target: str = "aceso",
               allowed=None, shared_overlap: tuple[str, ...] = (), sms: int | None = None) -> list[MoEPlanSettings]:
    """The MoE settings to price a plan of ``model`` on ``cluster`` under: ``base`` (None: the defaults) first,
    then ``base`` with each other dispatcher megatron-core runs there (and ``allowed`` keeps: --dispatcher), each
    (``--target megatron-lm``: the aceso runtime runs no EP overlap; nor does HybridModel, a Mamba / GDN model's) also
    with the EP overlap and delayed weight gradients where ``base`` has no overlap and megatron-core's rules on the
    settings allow it (``moe_plan.settings_refusal``), and (a model with a shared expert, ``shared_overlap``: the
    dispatchers the release runs it with, ``moe_plan.shared_overlap_dispatchers``) with the shared-expert overlap
    where ``base`` has neither overlap; HybridEP's SM count (``sms``: ``--moe-hybridep-num-sms``; None: ``base``'s)
    on the HybridEP candidates only (``moe_plan.settings_refusal``); empty for a dense model."""
    if model.moe is None:
        return []
    base = base or MoEPlanSettings()
    out = [base]
    shared = bool(model.moe.moe_shared_expert_intermediate_size) and not base.overlap_ep_comm
    from search.megatron.hybrid_pattern import runs_as_pattern
    from search.settings.moe_plan import settings_refusal
    hybrid = runs_as_pattern(model)     # HybridModel runs no EP overlap (hybrid_pattern.EP_OVERLAP_REFUSAL)
    for d, backend in _dispatch_options(model):
        if (d == "flex" and cluster.gpu.name == "cpu") or (allowed is not None and d not in allowed):
            continue
        if (base.shared_expert_overlap and d not in shared_overlap) or (base.overlap_ep_comm and d == "allgather"):
            continue
        same = base.model_copy(update={"token_dispatcher": d, "flex_backend": backend, "hybridep_num_sms": (
            sms or base.hybridep_num_sms) if (d, backend) == ("flex", "hybridep") else None})
        if (d, backend) != (base.token_dispatcher, base.flex_backend if d == "flex" else "deepep"):
            out.append(same)
        overlap = same.model_copy(update={"overlap_ep_comm": True, "delay_wgrad": True})
        if target == "megatron-lm" and not base.overlap_ep_comm and d != "allgather" and not hybrid \
                and not base.shared_expert_overlap and settings_refusal(overlap, model) is None:
            out.append(overlap)     # (settings_refusal: a bf16 / fp16 model, grouped GEMM, at most one MTP layer)
        if shared and not base.shared_expert_overlap and d in shared_overlap:
            out.append(same.model_copy(update={"shared_expert_overlap": True}))
    return out


def shared_overlap_options(cm, target: str) -> tuple[str, ...]:
    """The dispatchers to offer the shared-expert overlap with: those the priced release's megatron-core runs it
    with (``moe_plan.shared_overlap_dispatchers``), where it runs and is priced: the analytic model (the profiler
    measures the shared expert without it), a GPU (the aceso runtime turns it off on CPU: CUDA streams)."""
    from search.settings.moe_plan import shared_overlap_dispatchers
    if getattr(cm, "kind", "analytic") != "analytic" or cm.cluster.gpu.name == "cpu":
        return ()
    return shared_overlap_dispatchers(core_of(cm))


def core_of(cm) -> tuple[int, int]:
    """(major, minor) of the megatron-core ``cm`` prices: the stated release's (``pricing.cost_model`` sets
    ``cm.megatron_core``), else its ``RunSettings.release``'s."""
    from search.settings.releases import megatron_core
    return getattr(cm, "megatron_core", None) or \
        megatron_core(getattr(getattr(cm, "settings", None), "release", None) or None)


def _dispatch_options(model) -> list[tuple[str, str]]:
    """(dispatcher, flex backend) pairs: alltoall, allgather, flex with DeepEP and with HybridEP (megatron-core
    pads the expert input to capacity with HybridEP only)."""
    flex = ["hybridep"] if model.moe.moe_pad_expert_input_to_capacity else ["deepep", "hybridep"]
    return [(d, "deepep") for d in DISPATCHERS if d != "flex"] + [("flex", b) for b in flex]


def graph_candidates(model, target: str) -> list[StackKey]:
    """The CUDA-graph scopes to price an MoE plan under (``--target megatron-lm``; module docstring): the
    transformer-engine scopes and, on drop-and-pad MoE, ``full_iteration`` (``local``): megatron-core captures the
    whole iteration only where the MoE layers do not synchronise with the host (``stack.refusal``; 0.19's per-rank
    capacity, the other such case, is the user's MoE setting, not searched)."""
    if model.moe is None or target != "megatron-lm":
        return []
    mamba = any(u.kind == "mamba" for u in model.units)
    scopes = list(GRAPH_SCOPES) + ([g | {"mamba"} for g in GRAPH_SCOPES] if mamba else [])
    return [StackKey(graphs=g, graph_impl="transformer_engine") for g in scopes] + \
        ([StackKey(graphs=FULL_ITERATION, graph_impl="local")] if drop_and_pad(model.moe) else [])


class Dispatchers:
    """Prices states under each candidate (MoE settings x CUDA-graph scope; one ``Evaluator`` per MoE settings, so
    their stage caches are kept)."""

    def __init__(self, cm, gbs: int, target: str, base: MoEPlanSettings | None = None, accept=None, stacks=(),
                 shared_overlap: bool = True, offload: bool = True):
        """``accept(evaluator, evaluation)``: an extra check a variant must pass (the megatron-lm target: the
        export's ``expressible``); None: any fitting variant. ``stacks``: the seeds' own stack switches
        (``StackKey``: a published plan's CUDA graphs), also priced on every plan (the megatron-lm target).
        ``shared_overlap`` False: no shared-expert overlap candidates (``settle``'s other overlap). ``offload``
        False: no fine-grained offload candidates (the uniform baseline: a tuned user's configuration)."""
        self.base = base
        self.accept = accept
        training = getattr(cm, "training", None)
        cands = candidates(cm.model, cm.cluster, base, target, getattr(training, "token_dispatchers", None),
                           shared_overlap_options(cm, target) if shared_overlap else (),
                           getattr(training, "moe_hybridep_num_sms", None))
        self.cm, self.gbs, self.target = cm, gbs, target
        self.offload = fine_offload.candidates(cm, target, base) if offload else []    # (fine_offload.py)
        self.core = core_of(cm)
        self.evaluators = [Evaluator(cm, gbs, None, target, s) for s in cands[1:]]
        self.own = Evaluator(cm, gbs, None, target, cands[0] if cands else None) if cands or self.offload else None
        self.graphs = graph_candidates(cm.model, target)
        self.stacks = list(dict.fromkeys(stacks)) if target == "megatron-lm" else []

    def best(self, e: Evaluation) -> Evaluation:
        """``e`` or its state under another candidate when that is faster and fits (exact evaluations)."""
        if not e.fits:
            return e
        best = e
        own = e.moe or self.base or MoEPlanSettings()
        evs = [ev for ev in self.evaluators if ev.moe != own] + ([self.own] if self.own is not None else [])
        # the offload only makes room: priced where the plan recomputes (fine_offload.py)
        room = getattr(e.setting, "granularity", None) is not None
        for ev in evs:
            for st in self._states(e.state, room):
                if ev is self.own and st == e.state:
                    continue
                try:
                    c = ev.evaluate(st, charge=False, exact=True)
                    ok = c.fits and c.score < best.score and self.passes(ev, c)
                except (pydantic.ValidationError, ValueError):
                    continue               # a combination megatron-core refuses (the plan's own rules)
                if ok:
                    best = c
        return best

    def ranked_stacks(self, e: Evaluation) -> list:
        """The stack switches (``StackKey``: the CUDA-graph scopes) ``e``'s state fits and passes the rules under,
        under ``e``'s own MoE setting, fastest first (``settle``'s rounds under the runner-up scopes)."""
        if not e.fits:
            return []
        ev = self.own if self.own is not None and self.own.moe == e.moe else \
            Evaluator(self.cm, self.gbs, None, self.target, e.moe)
        priced = []
        for st in self._states(e.state):
            try:
                c = e if st == e.state else ev.evaluate(st, charge=False, exact=True)
                ok = c.fits and self.passes(ev, c)
            except (pydantic.ValidationError, ValueError):
                continue
            if ok:
                priced.append(c)
        return list(dict.fromkeys(c.state.features.stack for c in sorted(priced, key=lambda c: c.rank)))

    def _valid(self, c: Evaluation) -> bool:
        """Whether the variant's plan passes the plan's own rules (megatron-core's: the EP overlap's structure,
        the CUDA graphs' scopes)."""
        from search.settings.plan_settings import PlanSettings

        from .state import to_plan
        release = PlanSettings(release="%d.%d" % core_of(self.cm))     # megatron-core's rules of the priced release
        try:
            to_plan(c, self.cm.model, self.cm.cluster, self.gbs, getattr(self.cm, "kind", "analytic"), predicted=False,
                    settings=release)
        except (pydantic.ValidationError, ValueError):
            return False
        return True

    def passes(self, ev, c: Evaluation) -> bool:
        """Whether the variant ``c`` (priced by ``ev``) passes the plan's own rules and the extra check (``accept``)."""
        return self._valid(c) and (self.accept is None or self.accept(ev, c))

    def variants(self, st):
        """``st`` and ``st`` under each CUDA-graph scope and seed stack (``_states`` without the offload)."""
        return self._states(st)

    def _states(self, st, room: bool = False):
        """``st`` and, with CUDA-graph candidates, ``st`` under each scope (its other switches kept, or a seed's);
        ``room``: also under each fine-grained offload candidate (``fine_offload.variants``)."""
        yield st
        f = st.features
        if f.offload_layers:              # megatron-core: no CUDA graphs with CPU offloading
            return
        # each scope on the state's own switches and on each seed's (its loss fusion: a published plan's TE fusion
        # keeps less at the peak, so a scope may fit only with it)
        graphed = list(dict.fromkeys(base._replace(graphs=g.graphs, graph_impl=g.graph_impl)
                                     for base in [f.stack or StackKey()] + self.stacks for g in self.graphs))
        for sk in graphed:
            if sk != f.stack and fine_offload.graphs_ok(sk, self.core):
                yield st._replace(features=f._replace(stack=sk))
        for sk in self.stacks:
            if sk != f.stack:
                yield st._replace(features=f._replace(stack=sk))
        if self.offload and room:    # the offload on the state's own stack and on each graph scope's
            for base in [f] + [f._replace(stack=sk) for sk in graphed]:
                for sk in fine_offload.variants(base, self.offload, self.core):
                    yield st._replace(features=f._replace(stack=sk))

    @property
    def active(self) -> bool:
        """Whether there is another candidate to try (an MoE model)."""
        return bool(self.evaluators) or bool(self.graphs) or bool(self.stacks) or bool(self.offload)
