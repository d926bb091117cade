"""The report's ``Megatron-LM |-pattern`` line: the Megatron-LM plans with their stage cuts moved to any unit.

Megatron-LM 0.17 on runs a GPT model as a hybrid layer pattern (``search/megatron/hybrid_pattern.py``), whose ``|``
cuts stages anywhere, also between a layer's attention and MLP halves: a finer split than whole layers, with the
same one stage shape and Megatron-LM's recompute settings (over hybrid layers: ``block N`` is a chunk's first N
units). ``refine`` starts from the uniform plan (the even split) and the Megatron-LM plan (the layer-count uneven
split; both cut on layers, where the hybrid form is the same plan: ``block N`` of GPT layers is ``block 2N`` of
units) and, per recompute setting, moves single units off the slowest stage (by time per micro-batch; the next
slowest when no move off it helps): each chunk bound of that stage one unit into it, while the iteration gets
faster (bottleneck alleviation, as the search's own moves, on the cuts only). So the line is never slower than the
two it starts from, and the gain it shows is what finer cuts alone buy.
"""

from __future__ import annotations

import numpy as np

from ..costmodel.types import RC_CODE
from ..megatron.config import Recompute, layer_bounds, num_layers
from ..megatron.hybrid_pattern import FULL_RECOMPUTE_SINCE, model_refusal, unit_choices
from .megatron_lm import FULL_SETTING, NONE_SETTING, selective_settings
from .state import Evaluation, State

MAX_STEPS = 400          # accepted moves per start and setting (each moves one unit)


def hybrid_setting(setting: Recompute | None, model) -> Recompute:
    """A Megatron-LM setting over whole layers as the same per-unit choices over hybrid layers: ``block N`` of a GPT
    model's layers (two units each) is ``block 2N``; a hybrid model's layers are its units already (``block N``)."""
    if setting is None:
        return NONE_SETTING
    if setting.granularity == "full" and setting.method == "block":
        bounds = layer_bounds(model)
        return Recompute("full", "block", (bounds[-1] - bounds[0]) // num_layers(model) * setting.num_layers)
    return setting


def _codes(model, state: State, i: int, setting: Recompute) -> np.ndarray:
    return np.array([RC_CODE[c] for a, b in state.spans(i) for c in unit_choices(setting, model, a, b)], np.int8)


def price(ev, state: State, setting: Recompute) -> Evaluation:
    """The state as a hybrid-pattern run under ``setting`` (exact pipeline)."""
    model, firsts = ev.cm.model, state.first_ranks()
    stages = [ev.stage_with(state, i, firsts[i], _codes(model, state, i, setting)) for i in range(state.num_stages)]
    e = ev.assemble(state, stages, exact=True)
    e.setting = setting
    return e


def _moves(state: State, slow: int, last_cut: int, unit: int = 1):
    """States with one chunk bound of stage ``slow`` moved ``unit`` units into it (its chunks lose them to a
    neighbour); no chunk left empty, the MTP units kept in the last chunk (bounds up to ``last_cut``)."""
    S, b = state.num_stages, list(state.bounds)
    for j in range(state.num_chunks):
        k = j * S + slow                                   # chunk k spans bounds[k], bounds[k + 1]
        for pos, step in ((k, unit), (k + 1, -unit)):
            if pos in (0, len(b) - 1):
                continue
            nb = b[:]
            nb[pos] += step
            if nb[pos - 1] < nb[pos] < nb[pos + 1] and nb[pos] <= last_cut:
                yield state._replace(bounds=tuple(nb))


def descend(ev, start: State, setting: Recompute, unit: int = 1) -> Evaluation:
    """Bottleneck descent on the cuts: move a unit off the slowest stage while the iteration gets faster (``unit``
    2: whole GPT layers, the layer-count split's own descent, for comparison)."""
    last_cut = layer_bounds(ev.cm.model)[-1]
    best = price(ev, start, setting)
    for _ in range(MAX_STEPS):
        if not best.fits:
            return best
        better = []
        for slow in np.argsort([-s.cost.time_per_microbatch_ms for s in best.stages], kind="stable"):
            cands = [price(ev, s, setting) for s in _moves(best.state, int(slow), last_cut, unit)]
            better = [c for c in cands if c.fits and c.iteration_ms < best.iteration_ms - 1e-9]
            if better:
                break
        if not better:
            return best
        best = min(better, key=lambda c: (c.iteration_ms, c.state))
    return best


def settings_for(model, seed: Recompute, rel) -> list[Recompute]:
    """The seed's setting (over units), no recompute, the selective ones and, where the release checkpoints hybrid
    layers, every unit full and the seed's block count one unit either way."""
    out = [seed, NONE_SETTING, *selective_settings(model)]
    if rel.version >= FULL_RECOMPUTE_SINCE:
        out.append(FULL_SETTING)
        if seed.method == "block":
            out += [Recompute("full", "block", n) for n in (seed.num_layers - 1, seed.num_layers + 1) if n > 0]
    else:
        out = [s for s in out if s.granularity != "full"]
    return list(dict.fromkeys(out))


def refine(ev, seeds: list[Evaluation], rel) -> tuple[Evaluation | None, str | None]:
    """(the best hybrid-pattern plan from ``seeds``, None) or (None, why the line is not offered). ``ev``: a
    ``megatron-lm`` Evaluator (each seed is priced under its own MoE settings, the dispatcher it was chosen with);
    ``rel``: the Megatron-LM release (``versions.Release``)."""
    from .state import Evaluator
    why = model_refusal(ev.cm.model, rel) if rel is not None else "the release's Megatron-LM has no hybrid pattern"
    moes = [s.moe for s in seeds if s is not None and s.moe is not None] + ([ev.moe] if ev.moe else [])
    if why is None and any(not m.grouped_gemm for m in moes):
        why = "HybridModel's MoE layers are grouped-GEMM experts, and the search prices them off"
    if why:
        return None, why
    best = None
    for seed in seeds:
        if seed is None or not seed.fits or seed.state.features.offload_layers:
            continue      # CPU activation offload: priced for GPTModel's layers only
        sev = ev if seed.moe == ev.moe else Evaluator(ev.cm, ev.gbs, None, "megatron-lm", seed.moe)
        for setting in settings_for(ev.cm.model, hybrid_setting(seed.setting, ev.cm.model), rel):
            e = descend(sev, seed.state, setting)
            if e.fits and (best is None or e.rank < best.rank):    # rank: a total order (stack None or not)
                best = e
    return best, None
