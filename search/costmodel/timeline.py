"""Finer timeline boxes (``types.Event`` kinds) from the schedule's coarse ones and the stages' costs.

``pipeline.py`` emits one ``forward`` / ``backward`` box per op, a ``sync`` box after each stage's last op and a
``step`` box after the barrier. Each is split here into what the cost model priced inside it, in the order the
runtime runs it, without moving any boundary: so the boxes of a stage still add up to its busy time and the last
box still ends at the iteration time.

    forward   -> forward | tp_comm | cp_comm (exposed TP collectives, ring K/V exchange) | p2p (exposed send/recv)
    backward  -> recompute (megatron re-runs the forward first) | backward | tp_comm | cp_comm | p2p
                 (tp_comm / cp_comm: where the stage has ``StageCost.chunk_comm``; they run between the GEMMs,
                 drawn here as one piece at the end of the op, their exact total)
    sync      -> dp_comm (exposed gradient reduction + tied-embedding all-reduce)
                 (without the optimizer barrier ``sync`` also holds the step: then | param_gather | optimizer)
    step      -> param_gather (distributed optimizer, not overlapped) | optimizer
    (ready)   -> param_gather from 0 to the stage's ``prologue_ms`` (overlapped all-gather, its exposed part)
Hidden communication goes on the stage's communication lane: ``dp_comm_hidden`` ending with the last backward,
``param_gather_hidden`` after the exposed prologue, ``tp_comm_hidden`` / ``cp_comm_hidden`` from the start of the
compute they hide behind (each op's own share).
"""

from __future__ import annotations

from .types import Event, StageCost


def _parts(s: StageCost, chunk: int) -> tuple[float, float, float, float, float]:
    if s.chunk_parts:
        return s.chunk_parts[chunk]
    return s.fwd_ms, s.p2p_ms / 2, s.recompute_ms, s.bwd_ms, s.p2p_ms / 2


_NO_COMM = (0.0,) * 8


def _comm(s: StageCost, chunk: int) -> tuple[float, ...]:
    """(tp fwd, tp bwd, cp fwd, cp bwd, tp hidden fwd, tp hidden bwd, cp hidden fwd, cp hidden bwd) per op."""
    return s.chunk_comm[chunk] if s.chunk_comm else _NO_COMM


def _hidden(e: Event, t0: float, window: float, tp: float, cp: float) -> list[Event]:
    """Hidden TP / CP communication of one op, from ``t0`` (its compute's start), at most the compute's length."""
    return [Event(e.stage, e.chunk, e.micro_batch, kind, t0, t0 + min(d, window))
            for kind, d in (("tp_comm_hidden", tp), ("cp_comm_hidden", cp)) if d > 0 and window > 0]


def _split(stage: int, chunk: int, mb: int, t0: float, pieces) -> list[Event]:
    out, t = [], t0
    for kind, d in pieces:
        if d > 0:
            out.append(Event(stage, chunk, mb, kind, t, t + d))
            t += d
    return out


def _gather_in_step(s: StageCost) -> float:
    pg = s.comm.get("param_gather")
    return pg[0] if pg and not s.prologue_ms else 0.0


def refine(events: list[Event], stages: list[StageCost], barrier: bool) -> list[Event]:
    out: list[Event] = []
    for e in events:
        s = stages[e.stage]
        if e.kind == "forward":
            f, pf, _, _, _ = _parts(s, e.chunk)
            tf, _, cf, _, htf, _, hcf, _ = _comm(s, e.chunk)
            out += _split(e.stage, e.chunk, e.micro_batch, e.start_ms,
                          (("forward", f - tf - cf), ("tp_comm", tf), ("cp_comm", cf), ("p2p", pf)))
            out += _hidden(e, e.start_ms, f - tf - cf, htf, hcf)
        elif e.kind == "backward":
            _, _, r, bw, pb = _parts(s, e.chunk)
            _, tb, _, cb, _, htb, _, hcb = _comm(s, e.chunk)
            out += _split(e.stage, e.chunk, e.micro_batch, e.start_ms,
                          (("recompute", r), ("backward", bw - tb - cb), ("tp_comm", tb), ("cp_comm", cb),
                           ("p2p", pb)))
            out += _hidden(e, e.start_ms + r, bw - tb - cb, htb, hcb)
        elif e.kind == "sync":
            pieces = [("dp_comm", s.dp_sync_ms)]
            if not barrier:
                ag = _gather_in_step(s)
                pieces += [("param_gather", ag), ("optimizer", s.optimizer_ms - ag)]
            out += _split(e.stage, -1, -1, e.start_ms, pieces)
            hid = s.comm.get("dp", (0.0, 0.0))[1]
            if hid > 0:
                out.append(Event(e.stage, -1, -1, "dp_comm_hidden", e.start_ms - hid, e.start_ms))
        elif e.kind == "step":
            ag = _gather_in_step(s)
            out += _split(e.stage, -1, -1, e.start_ms, (("param_gather", ag), ("optimizer", s.optimizer_ms - ag)))
        else:
            out.append(e)
    for k, s in enumerate(stages):
        if s.prologue_ms > 0:
            out.append(Event(k, -1, -1, "param_gather", 0.0, s.prologue_ms))
            hid = s.comm.get("param_gather", (0.0, 0.0))[1]
            if hid > 0:
                out.append(Event(k, -1, -1, "param_gather_hidden", s.prologue_ms, s.prologue_ms + hid))
    return out
