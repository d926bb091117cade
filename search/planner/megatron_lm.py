"""What stock Megatron-LM (core_v0.16.1) can run, for ``--target megatron-lm`` and the uniform baseline.

Megatron-LM expresses: one tp, cp, dp and sequence-parallel value for every pipeline rank; stage and virtual-stage
boundaries on layer boundaries (``--pipeline-model-parallel-layout`` allows uneven layer counts per rank and per
virtual stage, the same number of virtual stages on every rank); one per-rank ``--micro-batch-size`` (uniform dp);
and recompute only through ``--recompute-granularity full|selective``, ``--recompute-method uniform|block`` and
``--recompute-num-layers`` (``--recompute-modules core_attn``, the default, for selective). As per-unit choices
(``Setting.codes``):

    none                every unit none
    selective           attention units ``selective`` (the attention core re-run), MLP units none
    full uniform 1      every unit ``full`` (each layer's input checkpointed)
    full block N        the first N layers of every model chunk ``full``, the rest none (one N for all chunks)

``best_setting`` prices a state at the fastest of these that fits: none if it fits; else selective, full, and
block with the smallest N that fits every stage (memory falls and time rises with N, so each stage's smallest N
is found by bisection and the plan takes the largest). ``problem`` names the first thing a plan does that
Megatron-LM cannot express (None: the export can run it as is).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

NONE, SELECTIVE, FULL = 0, 1, 2


class Setting(NamedTuple):
    """One Megatron-LM recompute configuration."""

    granularity: str = "none"           # none | selective | full
    method: str | None = None           # full: uniform | block
    num_layers: int | None = None       # full: layers per checkpoint (uniform) or per chunk (block)

    @property
    def label(self) -> str:
        if self.granularity != "full":
            return self.granularity
        return f"full {self.method} {self.num_layers}"

    def codes(self, model, spans) -> np.ndarray:
        """Per unit of the chunks ``spans`` (chunk after chunk): the recompute codes of this setting."""
        units = model.units
        out = []
        for a, b in spans:
            if self.granularity == "none":
                out.append(np.zeros(b - a, np.int8))
            elif self.granularity == "selective":
                out.append(np.array([SELECTIVE if units[u].kind != "mlp" else NONE for u in range(a, b)], np.int8))
            elif self.method == "uniform":
                out.append(np.full(b - a, FULL, np.int8))
            else:
                rc = np.zeros(b - a, np.int8)
                layers = 0
                for u in range(a, b):
                    if u > a and units[u][:2] != units[u - 1][:2]:   # (stack, layer) changed
                        layers += 1
                    if layers < self.num_layers:
                        rc[u - a] = FULL
                out.append(rc)
        return np.concatenate(out) if out else np.zeros(0, np.int8)


NONE_SETTING = Setting()
SELECTIVE_SETTING = Setting("selective")
FULL_SETTING = Setting("full", "uniform", 1)


def block(n: int) -> Setting:
    return Setting("full", "block", n)


def chunk_layers(model, spans) -> list[int]:
    """Whole layers in each chunk."""
    starts = model.layer_starts
    return [sum(1 for x in starts[:-1] if a <= x < b) for a, b in spans]


def settings_for(model, all_spans: list) -> list[Setting]:
    """The uniform settings worth trying for a plan with these chunks (block N for every N up to its largest chunk
    minus one; N = the whole chunk is ``full``)."""
    top = max(max(chunk_layers(model, s)) for s in all_spans)
    return [NONE_SETTING, SELECTIVE_SETTING, FULL_SETTING] + [block(n) for n in range(1, top)]


def best_setting(ev, state, exact: bool = False):
    """The state's evaluation at its fastest fitting Megatron-LM recompute setting (``ev``: an Evaluator)."""
    model = ev.cm.model
    firsts = state.first_ranks()
    S = state.num_stages
    spans = [state.spans(i) for i in range(S)]

    def priced(setting: Setting):
        return [ev.stage_with(state, i, firsts[i], setting.codes(model, spans[i])) for i in range(S)]

    def fits(stages):
        return all(s.cost.fits for s in stages)
    none = priced(NONE_SETTING)
    if fits(none):
        return _evaluation(ev, state, none, NONE_SETTING, exact)
    full = priced(FULL_SETTING)
    if not fits(full):  # nothing fits: report the least memory
        return _evaluation(ev, state, full, FULL_SETTING, exact)
    cands = [(FULL_SETTING, full)]
    sel = priced(SELECTIVE_SETTING)
    if fits(sel):
        cands.append((SELECTIVE_SETTING, sel))
    need = 1
    for i in range(S):  # each stage's smallest block N, by bisection
        lo, hi = need, max(chunk_layers(model, spans[i]))
        if hi <= lo or ev.stage_with(state, i, firsts[i], block(lo).codes(model, spans[i])).cost.fits:
            continue
        while lo < hi:
            mid = (lo + hi) // 2
            if ev.stage_with(state, i, firsts[i], block(mid).codes(model, spans[i])).cost.fits:
                hi = mid
            else:
                lo = mid + 1
        need = lo
    blk = priced(block(need))
    if fits(blk):
        cands.append((block(need), blk))
    evs = [_evaluation(ev, state, stages, s, exact) for s, stages in cands]
    return min(evs, key=lambda e: (e.score, e.setting))


def _evaluation(ev, state, stages, setting: Setting, exact: bool):
    e = ev.assemble(state, stages, exact)
    e.setting = setting
    return e


def setting_of(model, stages) -> Setting | None:
    """The Megatron-LM setting a plan's recompute is, or None (``stages``: the plan's ``StageSpec``s)."""
    spans = [st.spans for st in stages]
    codes = [np.array([{"none": 0, "selective": 1, "full": 2}.get(r, 9) for r in st.all_recompute], np.int8)
             for st in stages]
    for s in settings_for(model, spans):
        if all(np.array_equal(s.codes(model, sp), c) for sp, c in zip(spans, codes)):
            return s
    return None


def problem(plan) -> str | None:
    """The first thing ``plan`` does that Megatron-LM cannot express, as one line naming the stage and field."""
    s0 = plan.stages[0]
    for i, st in enumerate(plan.stages[1:], start=1):
        for name in ("tp", "cp", "dp", "sequence_parallel"):
            if getattr(st, name) != getattr(s0, name):
                return (f"stages[{i}].{name} ({getattr(st, name)}) differs from stages[0].{name} "
                        f"({getattr(s0, name)}): Megatron-LM runs one {name} on every pipeline rank")
    starts = set(plan.model.layer_starts)
    for s, j, ch in plan.chunks_in_order():
        if ch.start_unit not in starts:
            return (f"stages[{s}].chunks[{j}].start_unit ({ch.start_unit}) is inside a layer: Megatron-LM cuts "
                    "stages on layer boundaries")
    if setting_of(plan.model, plan.stages) is None:
        return ("the recompute is not one Megatron-LM setting (none, selective, full uniform 1, or full block N "
                "with one N for every chunk)")
    return None
