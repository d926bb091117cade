"""Intra-stage resharding between consecutive GPT ops of different layouts (SPEC §2.1 layout table, §3.3).

A layout is ``(R, V, (d0, d1, d2))``: replication, partial-sum factor, partition count per dim of
[seq, batch, hidden] (attention tensors: [batch, heads, .]). For producer output ``(Ri, Vi, di)`` and consumer
required input ``(Rr, Vr, dr)`` the reference picks (forward, backward, group size n):

    Ri > Rr and some d grows      -> split (free),   all_gather,  Ri/Rr
    Vi > Vr and Ri < Rr           -> all_reduce,     -,           Vi/Vr
    Vi > Vr and some d grows      -> reduce_scatter, all_gather,  Vi/Vr
    some d shrinks and Ri < Rr    -> all_gather,     split,       d ratio
    some d shrinks, another grows -> all_to_all,     all_to_all,  d ratio

The cost is the collective table at the consumer's input size rounded to whole MB (then size-1; else the 100 s
veto), forward costs added to the stage's in-comm, backward to its out-comm. Only GPT configs use it (T5 runs with
resharding off); a uniform stage (one tp/dp, algo 0) never reshards.
"""

from __future__ import annotations

Layout = tuple[int, int, tuple[int, int, int]]


def op_layouts(name: str, tp: int, dp: int, algo: int) -> tuple[Layout | None, Layout | None]:
    """(required input, output) layout of a GPT op."""
    base = name.removeprefix("enc-")
    rep: Layout = (tp, 1, (1, dp, 1))
    split_h: Layout = (1, 1, (1, dp, tp))
    heads: Layout = (1, 1, (dp, tp, 1))
    if base == "encoder-embedding":
        return None, rep
    if base in ("1st-layernorm", "2nd-layernorm", "post-attention-dropout", "post-MLP-dropout"):
        return rep, rep
    if base == "final-layernorm":
        return rep, (tp, 1, (dp, 1, 1))
    if base in ("attention-qkv", "MLP-GEMM-1"):
        return (rep, split_h) if algo == 0 else (split_h, rep)
    if base in ("attention-dense", "MLP-GEMM-2"):
        return (split_h, rep) if algo == 0 else (rep, split_h)
    if base == "attention-score":
        return split_h, heads
    if base in ("attention-softmax", "attention-dropout"):
        return heads, heads
    if base == "attention-context":
        return heads, split_h
    if base == "MLP-gelu":
        return split_h, split_h
    if base == "gpt-post-process":
        return (tp, 1, (dp, 1, 1)), None
    raise ValueError(f"unknown GPT op {name}")


def reshard_prims(out: Layout | None, req: Layout | None) -> tuple[str | None, str | None, int]:
    """(forward primitive, backward primitive, group size) to turn ``out`` into ``req``."""
    if out is None or req is None or out == req:
        return None, None, 0
    (ri, vi, di), (rr, vr, dr) = out, req
    grows = [j for j in range(3) if dr[j] > di[j]]
    shrinks = [j for j in range(3) if dr[j] < di[j]]
    if ri > rr and grows:
        return "split", "all_gather", ri // rr
    if vi > vr and ri < rr:
        return "all_reduce", None, vi // vr
    if vi > vr and grows:
        return "reduce_scatter", "all_gather", vi // vr
    if shrinks and ri < rr:
        return "all_gather", "split", di[shrinks[0]] // dr[shrinks[0]]
    if shrinks and grows:
        return "all_to_all", "all_to_all", di[shrinks[0]] // dr[shrinks[0]]
    return None, None, 0


def reshard_us(db, prev: tuple, cur: tuple, cur_input_mb: float) -> tuple[float, float]:
    """(forward µs, backward µs) between ops ``prev`` and ``cur``, each ``(name, tp, dp, algo)``."""
    fwd, bwd, n = reshard_prims(op_layouts(*prev)[1], op_layouts(*cur)[0])
    cost = [0.0, 0.0]
    for i, prim in enumerate((fwd, bwd)):
        if prim and prim != "split":
            cost[i] = db.collective_ms(prim, n, cur_input_mb) * 1000.0
    return cost[0], cost[1]
