"""Bottleneck stage, what dominates it, and which primitives to try first (Aceso §4.2-4.3; SPEC §4.3-4.4).

The bottleneck is the over-memory stage with the most memory if any stage does not fit, else the stage with the
longest pipeline total. A fitting plan whose pipeline bubble takes ``BUBBLE_SHARE`` of its iteration is bubble-bound:
more virtual stages first (where the space has them). Its time is split into three shares relative to all stages:

* compute: ideal time per GPU (its units on one GPU, divided by its GPUs) over the sum of ideal times;
* communication / parallelisation inefficiency: ``fwd + bwd + p2p - ideal`` (TP collectives, p2p, lost scaling)
  over the sum of those losses;
* recompute: its recompute time over the sum of recompute times.

The primitives' resource effects (time, memory, communication: ``-`` relieves, ``+`` costs more, ``0`` neutral)
order the candidates: for an over-memory plan only memory-relieving ones; otherwise the dimensions in decreasing
share, each contributing a filtered group then the rest of its relieving primitives, then everything left.
"""

from __future__ import annotations

from ..costmodel.types import StageCost

# name: (time, memory, comm) -- the reference's table (SPEC §4.5), plus the cost-balanced partition move, then
# the modern-Megatron primitives (after the reference's, so seed 0 keeps its order where they do not apply):
# SP splits the replicated activations and element-wise work over the TP group at the same TP traffic; moving DP
# into CP splits each rank's tokens (with the per-rank batch kept: less memory, ring exchanges); more model chunks
# shrink the bubble for more p2p and a little more in flight; the plan-level switches (distributed optimizer,
# overlap) trade memory and exposed DP traffic.
EFFECTS: dict[str, tuple[str, str, str]] = {
    "move_units": ("-", "-", "0"),
    "rebalance": ("-", "-", "0"),
    "inc_dp": ("-", "-", "+"),
    "dec_dp": ("+", "+", "-"),
    "inc_tp": ("-", "-", "+"),
    "dec_tp": ("+", "+", "-"),
    "inc_mbs": ("-", "+", "0"),
    "dec_mbs": ("+", "-", "0"),
    "tp_to_dp": ("-", "+", "-"),
    "dp_to_tp": ("+", "-", "+"),
    "sp_on": ("-", "-", "0"),
    "sp_off": ("+", "+", "0"),
    "dp_to_cp": ("0", "-", "+"),
    "cp_to_dp": ("0", "+", "-"),
    "inc_vpp": ("-", "+", "+"),
    "dec_vpp": ("+", "-", "-"),
    "features_on": ("-", "-", "-"),
    "features_off": ("+", "+", "+"),
    # MoE expert shapes (expert_moves.py; nothing on a dense model): more ep, fewer local experts (less memory,
    # wider all-to-all); etp 1 drops the experts' TP collectives for unsplit expert weights; the trades move a
    # factor between attention tp and ep on the same GPUs
    "inc_ep": ("-", "-", "+"),
    "dec_ep": ("+", "+", "-"),
    "etp_1": ("-", "+", "-"),
    "etp_tp": ("+", "-", "+"),
    "tp_to_ep": ("-", "0", "-"),
    "ep_to_tp": ("+", "0", "+"),
}
PRIMITIVES = tuple(EFFECTS)
EXPERT_PRIMITIVES = frozenset({"inc_ep", "dec_ep", "etp_1", "etp_tp", "tp_to_ep", "ep_to_tp"})   # expert_moves.py
BUBBLE_SHARE = 0.10    # a fitting plan whose pipeline bubble is this share of its iteration is bubble-bound
BUBBLE = ("inc_vpp",)  # what shrinks the bubble at the same micro-batches: more model chunks per stage


def find_bottleneck(stages: list[StageCost], stage_total_ms: list[float], limit_mb: float) -> int:
    over = [i for i, s in enumerate(stages) if not s.fits or s.memory_mb > limit_mb]
    if over:
        return max(over, key=lambda i: (stages[i].memory_mb, -i))
    return max(range(len(stages)), key=lambda i: (stage_total_ms[i], -i))


def shares(stages: list[StageCost], b: int) -> dict[str, float]:
    ideal = [s.ideal_ms if s.ideal_ms > 0 else max(s.fwd_ms + s.bwd_ms - s.tp_comm_ms, 0.0) for s in stages]
    loss = [max(s.fwd_ms + s.bwd_ms + s.p2p_ms - i, 0.0) for s, i in zip(stages, ideal)]
    rec = [s.recompute_ms for s in stages]

    def share(v):
        tot = sum(v)
        return v[b] / tot if tot > 0 else 0.0
    return {"compute": share(ideal), "communication": share(loss), "recompute": share(rec),
            "_ideal_above_mean": ideal[b] > sum(ideal) / len(ideal),
            "_loss_above_mean": loss[b] > sum(loss) / len(loss), "_recomputes": rec[b] > 0}


def classify(stages: list[StageCost], b: int, limit_mb: float, bubble_share: float = 0.0) -> str:
    """``memory`` if the bottleneck does not fit, ``bubble`` if the pipeline bubble takes ``BUBBLE_SHARE`` of the
    iteration, else the largest of compute / communication / recompute."""
    if not stages[b].fits or stages[b].memory_mb > limit_mb:
        return "memory"
    if bubble_share >= BUBBLE_SHARE:
        return "bubble"
    sh = shares(stages, b)
    return max(("compute", "communication", "recompute"), key=lambda k: sh[k])  # ties: this order


def order_primitives(stages: list[StageCost], b: int, limit_mb: float, bubble_share: float = 0.0) -> list[list[str]]:
    """Groups of primitive names, most promising first (SPEC §4.4); a bubble-bound plan (``classify``) tries the
    bubble's primitives first."""
    if not stages[b].fits or stages[b].memory_mb > limit_mb:
        return [[p for p in PRIMITIVES if EFFECTS[p][1] == "-"]]
    if bubble_share >= BUBBLE_SHARE:
        rest = order_primitives(stages, b, limit_mb)
        return [list(BUBBLE)] + [g2 for g2 in ([p for p in g if p not in BUBBLE] for g in rest) if g2]
    sh = shares(stages, b)
    dims = sorted(("compute", "communication", "recompute"), key=lambda k: -sh[k])  # stable: table order on ties
    listed: set[str] = set()
    groups: list[list[str]] = []

    def ok(p, want_dim, filters):
        t, m, c = EFFECTS[p]
        eff = {"time": t, "memory": m, "comm": c}
        return eff[want_dim] == "-" and all(eff[k] in ("-", "0") for k in filters)

    for d in dims:
        axis = {"compute": "time", "communication": "comm", "recompute": "memory"}[d]
        filters = []
        if d == "compute":
            filters += ["comm"] if sh["_loss_above_mean"] else []
            filters += ["memory"] if sh["_recomputes"] else []
        elif d == "communication":
            filters += ["time"] if sh["_ideal_above_mean"] else []
            filters += ["memory"] if sh["_recomputes"] else []
        else:
            filters += ["time"] if sh["_ideal_above_mean"] else []
            filters += ["comm"] if sh["_loss_above_mean"] else []
        for flt in (filters, []):
            g = [p for p in PRIMITIVES if p not in listed and ok(p, axis, flt)]
            listed.update(g)
            if g:
                groups.append(g)
    rest = [p for p in PRIMITIVES if p not in listed]
    if rest:
        groups.append(rest)
    return groups
