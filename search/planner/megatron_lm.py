"""What stock Megatron-LM (core_v0.16.1) can run, for ``--target megatron-lm`` and the uniform baseline.

One definition: ``search.megatron`` (the export) says what Megatron-LM can express (``check_expressible``) and how
its recompute settings map onto units (``recompute.unit_choices``); this module only prices states with them. The
search space for the target (``Space``, ``target="megatron-lm"``) keeps to it structurally: one tp, cp, dp and
sequence-parallel value for every pipeline rank, stage and virtual-stage boundaries on layer boundaries (uneven
layer counts per rank and per virtual stage are fine: ``--pipeline-model-parallel-layout``), one per-rank
``--micro-batch-size`` (uniform dp), ``--overlap-param-gather`` only with ``--overlap-grad-reduce``, T5 on one
stage; the final plans are filtered with ``check_expressible`` itself.

Recompute is one setting for the whole plan (``Recompute``):

    none                every unit none
    selective           attention units ``selective`` (``--recompute-modules core_attn``), MLP units none;
                        MoE models also ``core_attn moe_act`` (the experts' activation function re-run), MLA
                        models ``mla_up_proj`` (and ``moe_act mla_up_proj``: MLA attention units ``mla_up_proj``);
                        which units each marks is ``recompute.unit_choices``'s mapping
    full uniform 1      every unit ``full`` (each layer checkpointed)
    full block N        the first N layers of every transformer block (model chunk) ``full``, the rest none

``best_setting`` prices a state at the fastest of these that fits: none if it fits; else selective, full, and
block with the smallest N that fits every stage (memory falls and time rises with N, so each stage's smallest N is
found by bisection and the plan takes the largest). A one-stage state that does not fit without recompute also tries CPU activation offload
(``offloaded``: the fewest layers that make it fit, by bisection; megatron-core offloads only without recompute
and pipeline parallelism). Megatron FSDP is a plan-level feature (``space.with_fsdp``). A state with fine-grained
activation offload (``fine_offload.py``) takes no full recompute and no selective setting that re-runs a module it
offloads (``fine_offload.recompute_ok``), and no CPU offloading (megatron-core refuses the two together).
"""

from __future__ import annotations

import numpy as np

from ..costmodel.types import RC_CODE
from ..megatron import check_expressible
from ..megatron.config import NO_RECOMPUTE, NotExpressible, Recompute
from ..megatron.recompute import recompute_of, unit_choices
from .fine_offload import recompute_ok
from .state import lower_bound

NONE_SETTING = NO_RECOMPUTE
SELECTIVE_SETTING = Recompute("selective", modules=("core_attn",))
MOE_ACT_SETTING = Recompute("selective", modules=("core_attn", "moe_act"))   # MoE: the experts' activation too
FULL_SETTING = Recompute("full", "uniform", 1)
_CODES: dict = {}


def block(n: int) -> Recompute:
    return Recompute("full", "block", n)


UP_PROJ_SETTING = Recompute("selective", modules=("mla_up_proj",))    # MLA: the Q/K/V up projections
UP_PROJ_MOE_ACT_SETTING = Recompute("selective", modules=("moe_act", "mla_up_proj"))


def selective_settings(model) -> tuple[Recompute, ...]:
    """The selective settings a Megatron-LM user of this model tries (MoE: with ``moe_act`` too; MLA:
    ``mla_up_proj``, alone and with ``moe_act``, as Megatron-Bridge's DeepSeek-V3 recipes set it)."""
    out = (SELECTIVE_SETTING,) + ((MOE_ACT_SETTING,) if model.moe is not None else ())
    if model.mla is not None:
        out += (UP_PROJ_SETTING,) + ((UP_PROJ_MOE_ACT_SETTING,) if model.moe is not None else ())
    return out


def codes(setting: Recompute, model, spans) -> np.ndarray:
    """Per unit of the chunks ``spans`` (chunk after chunk): the recompute codes of a setting (cached, whole and
    per chunk: a chunk's codes depend on its own bounds only, and the same chunks recur in many states)."""
    key = (setting, spans, id(model))
    hit = _CODES.get(key)
    if hit is None or hit[0] is not model:
        if len(_CODES) > 100_000:
            _CODES.clear()
        parts = [_chunk_codes(setting, model, a, b) for a, b in spans]
        hit = _CODES[key] = (model, parts[0] if len(parts) == 1 else np.concatenate(parts))
    return hit[1]


def _chunk_codes(setting: Recompute, model, a: int, b: int) -> np.ndarray:
    """One chunk's codes, sliced from ``unit_choices`` of a longer chunk (each call is linear in the model's units,
    so a 1024-layer model's search spent half its time there): a chunk's choices are a prefix of those of the
    chunk from the same start to the model's end (block N marks the first N layers of each block from the chunk's
    start; the MTP units come last), and without block recompute they do not depend on the chunk's start at all
    (one choice per unit kind), so they are a slice of the whole model's. Chunks not on layer cuts: directly."""
    if a not in _cuts(model) or b not in _cuts(model):
        return _direct(setting, model, a, b)
    start = a if setting.granularity == "full" and setting.method == "block" else 0
    return _direct(setting, model, start, model.num_units)[a - start:b - start]


def _direct(setting: Recompute, model, a: int, b: int) -> np.ndarray:
    key = (setting, a, b, id(model), "chunk")
    hit = _CODES.get(key)
    if hit is None or hit[0] is not model:
        rc = np.array([RC_CODE[c] for c in unit_choices(setting, model, a, b)], np.int8)
        hit = _CODES[key] = (model, rc)
    return hit[1]


def _cuts(model) -> frozenset[int]:
    """The layer cuts a Megatron-LM chunk starts and ends on (``space.cut_points``), cached per model."""
    hit = _CODES.get(("cuts", id(model)))
    if hit is None or hit[0] is not model:
        from .space import cut_points
        hit = _CODES[("cuts", id(model))] = (model, frozenset(cut_points(model)))
    return hit[1]


def _layer_starts(model) -> np.ndarray:
    """``model.layer_starts`` without the end, as an array (cached per model: the property rebuilds the list)."""
    hit = _CODES.get(("starts", id(model)))
    if hit is None or hit[0] is not model:
        hit = _CODES[("starts", id(model))] = (model, np.asarray(model.layer_starts[:-1]))
    return hit[1]


def chunk_layers(model, spans) -> list[int]:
    """Whole layers in each chunk (layer starts in ``[a, b)``)."""
    starts = _layer_starts(model)
    return [int(np.searchsorted(starts, b, "left") - np.searchsorted(starts, a, "left")) for a, b in spans]


def best_setting(ev, state, exact: bool = False):
    """The state's evaluation at its fastest fitting Megatron-LM recompute setting (``ev``: an Evaluator)."""
    model = ev.cm.model
    firsts = state.first_ranks()
    S = state.num_stages
    spans = [state.spans(i) for i in range(S)]

    def priced(setting: Recompute):
        return [ev.stage_with(state, i, firsts[i], codes(setting, model, spans[i])) for i in range(S)]

    def fits(stages):
        return all(s.cost.fits for s in stages)
    none = priced(NONE_SETTING)
    if fits(none):
        return _accepted(ev, _evaluation(ev, state, none, NONE_SETTING, exact))
    off = offloaded(ev, state, spans, firsts)
    cands = []
    # full recompute (and its blocks) is refused under the MoE EP overlap and CUDA graphs (Evaluator.full_refused),
    # and saves nothing to offload (fine_offload.recompute_ok)
    no_full = ev.full_refused(state.features) or not recompute_ok(FULL_SETTING, state.features.stack)
    if not no_full:
        full = priced(FULL_SETTING)
        if not fits(full):  # nothing fits: report the least memory
            return _evaluation(ev, *off, NONE_SETTING, exact) if off else \
                _evaluation(ev, state, full, FULL_SETTING, exact)
        cands.append((FULL_SETTING, full))
    for setting in selective_settings(model):
        if not recompute_ok(setting, state.features.stack):
            continue            # a module both recomputed and offloaded (fine_offload.py)
        sel = priced(setting)
        if fits(sel):
            cands.append((setting, sel))
    if no_full:
        if not cands and not off:
            return _evaluation(ev, state, none, NONE_SETTING, exact)
        return _accepted(ev, _best(ev, state, cands, off, exact))
    need = 1
    for i in range(S):  # each stage's smallest block N, by bisection
        lo, hi = need, max(chunk_layers(model, spans[i]))
        if hi <= lo or ev.stage_with(state, i, firsts[i], codes(block(lo), model, spans[i])).cost.fits:
            continue
        while lo < hi:
            mid = (lo + hi) // 2
            if ev.stage_with(state, i, firsts[i], codes(block(mid), model, spans[i])).cost.fits:
                hi = mid
            else:
                lo = mid + 1
        need = lo
    blk = priced(block(need))
    if fits(blk):
        cands.append((block(need), blk))
    return _accepted(ev, _best(ev, state, cands, off, exact))


def _accepted(ev, e):
    """``e``, or ``e`` as not fitting where the search's target does not run it (``ev.runs_on`` other than
    Megatron-LM: its capability rules, e.g. Bridge's hybrid split), so the search moves away from it."""
    if e is None or not e.fits or ev.runs_on == "megatron-lm" or expressible(ev, e):
        return e
    e.fits, e.iteration_ms = False, float("inf")
    return e


def _best(ev, state, cands, off, exact: bool):
    """The fastest of the fitting (setting, stages) candidates and the offloaded state: their pipelines in
    lower-bound order, each only while it could beat the best so far."""
    M = ev.gbs // state.mbs
    cands = [(s, stages, state) for s, stages in cands] + ([(NONE_SETTING, off[1], off[0])] if off else [])
    bounds = [lower_bound([x.cost for x in stages], M)[0] for _, stages, _ in cands]
    best = refused = None
    for lb, (s, stages, st) in sorted(zip(bounds, cands), key=lambda c: (c[0], c[1][0].label)):
        if best is not None and lb >= best.iteration_ms:
            continue
        e = _evaluation(ev, st, stages, s, exact)
        if ev.runs_on != "megatron-lm" and e.fits and not expressible(ev, e):
            refused = refused or e      # a setting the target refuses (Bridge's MambaStack: no full recompute)
            continue
        if best is None or (e.score, e.setting.label) < (best.score, best.setting.label):
            best = e
    return best or refused


def offloaded(ev, state, spans, firsts):
    """``(state, stages)`` with the fewest offloaded layers that make a one-stage state fit without recompute
    (megatron-core's CPU offloading: one stage, no recompute, fewer layers than the model's; bisection: memory
    falls with the layers offloaded), or None (not allowed, not one stage, or even the most do not fit; a model
    Megatron-LM runs only as a hybrid pattern, which the export writes without offload: ``runs_as_pattern``)."""
    from ..megatron.hybrid_pattern import runs_as_pattern
    cm, model = ev.cm, ev.cm.model
    if state.num_stages > 1 or len(spans[0]) > 1 or "activation_offload" not in getattr(cm, "features", ()) \
            or cm.training.activation_offload is False or runs_as_pattern(model) or \
            (state.features.stack is not None and state.features.stack.offload_modules):
        return None     # (megatron-core refuses CPU offloading with the fine-grained offload: stack.refusal)
    rc = codes(NONE_SETTING, model, spans[0])

    def at(n):
        st = state._replace(features=state.features._replace(offload_layers=n))
        return st, [ev.stage_with(st, 0, firsts[0], rc)]
    lo, hi = 1, len(model.layer_starts) - 2
    if hi < lo or not at(hi)[1][0].cost.fits:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if at(mid)[1][0].cost.fits:
            hi = mid
        else:
            lo = mid + 1
    return at(lo)


def _evaluation(ev, state, stages, setting: Recompute, exact: bool):
    """The plan of ``state`` with these stages and ``setting``, priced at the release its target runs it
    (``bridge_release``: a Bridge search's candidate in v0.6.0's form)."""
    from .bridge_release import priced_as_exported
    e = ev.assemble(state, stages, exact)
    e.setting = setting
    return priced_as_exported(ev, e, exact)


def setting_of(plan) -> Recompute | None:
    """The Megatron-LM recompute setting of a plan's per-unit choices, or None."""
    try:
        return recompute_of(plan)
    except NotExpressible:
        return None


def problem(plan) -> str | None:
    """The first thing ``plan`` does that Megatron-LM cannot express (``search.megatron.check_expressible``)."""
    return check_expressible(plan)


def expressible(ev, e) -> bool:
    """Whether an evaluation's plan passes ``check_expressible`` (``ev``: the Evaluator that priced it); for a
    search whose plans Megatron-Bridge runs (``ev.runs_on``), the capability table's rules for that target
    (``capabilities.plan_refusal``: the Bridge export's own checks)."""
    from .state import to_plan
    cm = ev.cm
    plan = to_plan(e, cm.model, cm.cluster, ev.gbs, getattr(cm, "kind", "analytic"), predicted=False)
    runs_on = getattr(ev, "runs_on", "megatron-lm")
    if runs_on == "megatron-lm":
        return check_expressible(plan) is None
    from search.targets.capabilities import plan_refusal
    return plan_refusal(plan, runs_on) is None
