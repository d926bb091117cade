"""Expert-shape primitives (MoE models): change the bottleneck stage's expert folding on the same GPUs.

* ``inc_ep`` / ``dec_ep``: the next larger / smaller ep at the same etp (fewer local experts per rank, less expert
  memory and expert-DP gradient traffic, against an all-to-all that spans more ranks, maybe across nodes);
* ``etp_1`` / ``etp_tp``: expert tp 1 (published runs: no TP collectives in the experts, whole expert GEMMs) or the
  attention tp (megatron-core's default: expert weights split over TP), ep kept where legal else the nearest
  smaller;
* ``tp_to_ep`` / ``ep_to_tp``: trade expert shape against attention shape: attention tp halved (dp doubled) while
  ep doubles (at least), or attention tp doubled while ep halves (at most): the stage's GPUs stay the same.

Uniform spaces (``megatron-lm``: one folding for all stages) change every stage at once. A move keeps the plan's
micro-batch (the dp changes of the trades are the attention exchanges' own rules: ``shapes.exchange``); a dense
model has no expert moves (every one returns nothing).
"""

from __future__ import annotations

from ..costmodel.types import Shape
from . import primitives as P
from . import shapes as sh
from .state import Evaluation, State


def _apply(ctx, ev: Evaluation, b: int, change, every_stage: bool = False) -> list[State]:
    st, space = ev.state, ctx.space
    if space.experts is None:
        return []
    every = every_stage or space.target == "megatron-lm"
    shapes = list(st.shapes)
    for i in (range(st.num_stages) if every else (b,)):
        new = change(st.shapes[i])
        if new is None or not space.shape_ok(new):
            return []
        shapes[i] = new
    return P.legal(ctx, [sh._state(ctx, st, shapes, b, st.shapes[b].dp, every)])


def step_ep(ctx, ev: Evaluation, b: int, step: int) -> list[State]:
    return _apply(ctx, ev, b, lambda s: ctx.space.experts.stepped(s, step))


def set_etp(ctx, ev: Evaluation, b: int, one: bool) -> list[State]:
    def change(s: Shape):
        if (s.etp == 1) == one:
            return None
        return ctx.space.experts.toggled(s)
    return _apply(ctx, ev, b, change)


def trade(ctx, ev: Evaluation, b: int, to_ep: bool) -> list[State]:
    """Attention tp -> dp with ep up (``to_ep``), or dp -> attention tp with ep down, on the same GPUs."""
    ex = ctx.space.experts

    def change(s: Shape):
        new = sh._exchanged(ctx, s, "tp_to_dp" if to_ep else "dp_to_tp")
        if new is None:
            return None
        eps = ex.eps(new.num_gpus, new.expert_tp, new.tp)
        pick = [e for e in eps if e >= 2 * s.ep] if to_ep else [e for e in eps if 2 * e <= s.ep]
        if not pick:
            return None
        return new._replace(ep=pick[0] if to_ep else pick[-1])
    return _apply(ctx, ev, b, change)


MOVES = {
    "inc_ep": lambda c, e, b: step_ep(c, e, b, +1),
    "dec_ep": lambda c, e, b: step_ep(c, e, b, -1),
    "etp_1": lambda c, e, b: set_etp(c, e, b, True),
    "etp_tp": lambda c, e, b: set_etp(c, e, b, False),
    "tp_to_ep": lambda c, e, b: trade(c, e, b, True),
    "ep_to_tp": lambda c, e, b: trade(c, e, b, False),
}
