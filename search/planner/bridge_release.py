"""A Megatron-Bridge search's candidates priced at the release their export runs.

``aceso export --to megatron-bridge`` writes a hybrid model's plan in Bridge v0.3.1's form (megatron-core 0.16,
container 26.02.01) where v0.3.1's ``MambaStack`` runs it, else in v0.6.0's ``HybridModelProvider`` form
(megatron-core 0.19: an uneven split, full recompute; ``megatron.bridge_hybrid.plan_core``). The search prices at
the model's release (``bridge_hybrid.model_core``: 0.16 for a model v0.3.1 builds); a candidate whose form is
v0.6.0's is priced again, stage by stage with the same recompute, by a cost model at 0.19
(``release_constants``: the kernel efficiencies fitted per release), so that the search ranks it, and the plan
states, what its YAML runs: the search line, the export header, the YAML's import and ``explain`` give one price.
"""

from __future__ import annotations

from search.megatron.bridge_hybrid import BRIDGE_CORE, PIPES_CORE, model_core, plan_core
from search.megatron.hybrid_pattern import runs_as_pattern
from search.settings.releases import resolve


def priced_as_exported(ev, e, exact: bool):
    """``e`` (an ``Evaluation`` of the Evaluator ``ev``), or ``e`` priced at v0.6.0's release where the Bridge
    form of its plan is v0.6.0's (``release`` set to it)."""
    other = _pipes(ev)
    if other is None or not e.fits:
        return e
    from .state import to_plan
    cm = ev.cm
    plan = to_plan(e, cm.model, cm.cluster, ev.gbs, getattr(cm, "kind", "analytic"), predicted=False)
    if plan_core(plan) != PIPES_CORE:
        return e
    other.cutoff = ev.cutoff
    firsts = e.state.first_ranks()
    stages = [other.stage_with(e.state, i, firsts[i], s.rc) for i, s in enumerate(e.stages)]
    out = other.assemble(e.state, stages, exact)
    out.setting, out.release = e.setting, PIPES_CORE
    return out


def _pipes(ev):
    """The Evaluator at v0.6.0's release beside ``ev`` (made once), or None: not a Bridge search of a hybrid model
    priced at v0.3.1's release (a model only v0.6.0 builds is priced at 0.19 throughout), or a cost model that is
    not the analytic one (its release constants are the analytic model's)."""
    if ev.pipes is None:
        ev.pipes = False
        cm = ev.cm
        if ev.runs_on == "megatron-bridge" and runs_as_pattern(cm.model) and model_core(cm.model) == BRIDGE_CORE \
                and getattr(cm, "kind", None) == "analytic" and cm.settings.release == resolve(BRIDGE_CORE)[0]:
            from search.pricing.models import make_cost_model
            from .state import Evaluator
            alt = make_cost_model(cm.model, cm.cluster, cm.training, "analytic",
                                  settings=cm.settings._replace(release=resolve(PIPES_CORE)[0]),
                                  kernels=cm.source.kernels)
            alt.memory_limit_mb = cm.memory_limit_mb
            ev.pipes = Evaluator(alt, ev.gbs, None, ev.runs_on, ev.moe)
    return ev.pipes or None
