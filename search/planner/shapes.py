"""Shape primitives: change the bottleneck stage's (tp, dp, cp, sp), moving GPUs between stages where needed.

* ``grow`` (``inc_tp`` / ``inc_dp``): double the bottleneck's TP or DP, taking the GPUs from the least loaded
  stages (each donor halves its TP or DP, whichever its estimated time prefers).
* ``shrink`` (``dec_tp`` / ``dec_dp``): the reverse, giving the freed GPUs to the most loaded stage that can use them.
* ``exchange``: same GPUs, a factor between two degrees (``tp_to_dp``, ``dp_to_tp``, ``dp_to_cp``, ``cp_to_dp``).
* ``toggle_sp`` (``sp_on`` / ``sp_off``): sequence parallelism of the bottleneck.

Uniform spaces apply a change to every stage at once: the ``megatron-lm`` target (one shape for all stages: only
exchanges and SP, since the GPUs per stage are fixed) and cp under ``uniform_cp``. Every new shape takes its
sequence-parallel value with ``Space.sp_for`` and (MoE) its expert shape with ``Space.expert_fit`` (both kept
where allowed). A move of one stage keeps the plan's
micro-batch (no move where the new shapes cannot run it); a move of every stage takes it with
``Space.retarget_mbs`` (kept when legal, else the changed stage's per-rank batch kept).
"""

from __future__ import annotations

from ..costmodel.types import Shape
from . import primitives as P
from .state import Evaluation, State


def _fix_sp(ctx, s: Shape, old: Shape) -> Shape | None:
    """The new shape ``s`` of a stage that had ``old``: its SP value and (MoE) expert shape kept where allowed."""
    sp = ctx.space.sp_for(s.tp, s.cp, old.sp)
    if sp is None:
        return None
    s = ctx.space.expert_fit(s._replace(sp=sp), old)
    return s if s is not None and ctx.space.shape_ok(s) else None


def _state(ctx, st: State, shapes, keep: int | None, old_dp: int | None, every: bool = False) -> State | None:
    """The state at the new shapes. A move of one stage keeps the plan's micro-batch (None where the new shapes
    cannot run it): the pipeline micro-batch is plan-wide, so retargeting it would change every other stage's
    per-rank batch too -- a plan-wide jump that ``inc_mbs`` / ``dec_mbs`` own; taken inside a stage move it sent
    the first-improvement search astray (aceso-compat GPT-13B on 32 V100s, docs/search.md). A move of every stage
    at once (``every``) retargets it with ``Space.retarget_mbs``: all stages' per-rank batches stay consistent."""
    if every:
        m = ctx.space.retarget_mbs(shapes, st.mbs, keep, old_dp)
    else:
        m = st.mbs if ctx.space.mbs_ok(shapes, st.mbs) else None
    return None if m is None else st._replace(mbs=m, shapes=tuple(shapes))


def _uniform(ctx) -> bool:
    return ctx.space.target == "megatron-lm"


def grow(ctx, ev: Evaluation, b: int, kind: str) -> list[State]:
    st = ev.state
    if _uniform(ctx):
        return []
    s = st.shapes[b]
    new = _fix_sp(ctx, s._replace(tp=s.tp * 2) if kind == "tp" else s._replace(dp=s.dp * 2), s)
    if new is None:
        return []
    need = s.num_gpus
    shapes = list(st.shapes)
    shapes[b] = new
    firsts = st.first_ranks()
    freed = 0
    for d in sorted((i for i in range(st.num_stages) if i != b), key=lambda i: (ev.stage_total_ms[i], i)):
        half = st.gpus(d) // 2
        if half == 0 or freed + half > need:
            continue
        opts = _halves(ctx, st, d, firsts[d])
        if not opts:
            continue
        shapes[d] = opts[0]
        freed += half
        if freed == need:
            s2 = _state(ctx, st, shapes, b, s.dp)
            if s2 is None:
                return []
            bal = P.balanced_bounds(ctx, s2.shapes, s2.mbs, ctx.space.num_units, st.num_chunks)
            return P.legal(ctx, [s2] + ([s2._replace(bounds=bal)] if bal else []))
    return []


def _halves(ctx, st: State, i: int, first: int) -> list[Shape]:
    """Stage i at half its GPUs (tp or dp halved), fastest first by estimated time."""
    s = st.shapes[i]
    opts = [s._replace(tp=s.tp // 2)] if s.tp > 1 else []
    opts += [s._replace(dp=s.dp // 2)] if s.dp > 1 else []
    opts = [o for o in (_fix_sp(ctx, o, s) for o in opts) if o is not None]
    return sorted(opts, key=lambda o: (ctx.stage_time(st, i, o, first), o))


def shrink(ctx, ev: Evaluation, b: int, kind: str) -> list[State]:
    st = ev.state
    if _uniform(ctx):
        return []
    s = st.shapes[b]
    if (kind == "tp" and s.tp < 2) or (kind == "dp" and s.dp < 2):
        return []
    new = _fix_sp(ctx, s._replace(tp=s.tp // 2) if kind == "tp" else s._replace(dp=s.dp // 2), s)
    if new is None:
        return []
    freed = s.num_gpus // 2
    out = []
    for c in sorted((i for i in range(st.num_stages) if i != b), key=lambda i: (-ev.stage_total_ms[i], i)):
        g = st.gpus(c) + freed
        base = list(st.shapes)
        base[b] = new
        cp = st.shapes[c].cp if ctx.space.uniform_cp else None
        for shape in ctx.space.shapes(g, st.mbs, cp=cp, sp=st.shapes[c].sp, old=st.shapes[c]):
            shapes = list(base)
            shapes[c] = shape
            out.append(_state(ctx, st, shapes, b, s.dp))
        out = P.legal(ctx, out)
        if out:
            break
    return out


def _next(values, x, step):
    k = values.index(x) + step if x in values else -1
    return values[k] if 0 <= k < len(values) else None


def _exchanged(ctx, s: Shape, kind: str) -> Shape | None:
    if kind in ("tp_to_dp", "dp_to_tp"):
        if kind == "tp_to_dp":
            if s.tp < 2:
                return None
            new = s._replace(tp=s.tp // 2, dp=s.dp * 2)
        else:
            if s.dp % 2:
                return None
            new = s._replace(tp=s.tp * 2, dp=s.dp // 2)
    else:
        c = _next(ctx.space.cps, s.cp, +1 if kind == "dp_to_cp" else -1)
        if c is None:
            return None
        if kind == "dp_to_cp":
            if (s.dp * s.cp) % c:
                return None
            new = s._replace(cp=c, dp=s.dp * s.cp // c)
        else:
            if (s.cp % c) or s.dp * s.cp % c:
                return None
            new = s._replace(cp=c, dp=s.dp * s.cp // c)
    return _fix_sp(ctx, new, s)


def exchange(ctx, ev: Evaluation, b: int, kind: str) -> list[State]:
    """Same GPUs, a factor moved between two degrees; every stage at once in uniform spaces (cp: uniform_cp)."""
    st = ev.state
    every = _uniform(ctx) or (kind in ("dp_to_cp", "cp_to_dp") and ctx.space.uniform_cp)
    targets = range(st.num_stages) if every else (b,)
    shapes = list(st.shapes)
    for i in targets:
        new = _exchanged(ctx, st.shapes[i], kind)
        if new is None:
            return []
        shapes[i] = new
    return P.legal(ctx, [_state(ctx, st, shapes, b, st.shapes[b].dp, every)])


def toggle_sp(ctx, ev: Evaluation, b: int, on: bool) -> list[State]:
    st = ev.state
    targets = range(st.num_stages) if _uniform(ctx) else (b,)
    shapes = list(st.shapes)
    for i in targets:
        s = st.shapes[i]
        if s.tp < 2 or s.sp == on:
            if _uniform(ctx):
                return []
            continue
        shapes[i] = s._replace(sp=on)
    if tuple(shapes) == st.shapes:
        return []
    return P.legal(ctx, [st._replace(shapes=tuple(shapes))])
