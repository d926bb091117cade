"""Full-model tensors from a running plan, by canonical name (tests and benches compare them with a
single-process model).

A parameter's full value is its TP shards put together (``init.gather_full``) on DP replica 0, CP rank 0 of its
stage (a routed expert's: its expert-TP shards on expert-DP replica 0 of its EP rank). Its gradient is its ``main_grad`` after the step's finalisation -- except with the distributed optimizer,
where each DP (x CP) rank holds the reduced gradient of its shard of every DDP bucket only: the shards are put
together first (``reduced_grads``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..model.init import gather_full
from ..model.moe import is_expert


def reduced_grads(rt) -> dict:
    """Distributed optimizer: parameter -> its full DP-reduced gradient, from every rank's bucket shards."""
    out = {}
    for m in rt.models:
        for buf in m.buffers:
            size, rank = buf.data_parallel_world_size, dist.get_rank(buf.data_parallel_group)
            mine = torch.zeros_like(buf.grad_data)
            for bucket in buf.buckets:  # the rank's shard of each bucket, in buffer coordinates
                n = bucket.grad_data.numel() // size
                lo = bucket.offset + rank * n
                mine[lo:lo + n] = buf.grad_data[lo:lo + n]
            dist.all_reduce(mine, group=buf.data_parallel_group)
            for p, (lo, hi, _) in buf.param_index_map.items():
                out[p] = mine[lo:hi].view(p.shape)
    return out


def full_tensors(rt, which: str) -> dict[str, torch.Tensor]:
    """``which`` = "param" or "grad": every full-model tensor on every rank (collective)."""
    params = dict(rt.named_parameters())
    names = rt.canonical_names()
    if which == "grad" and rt.plan.distributed_optimizer:
        reduced = reduced_grads(rt)
        local = {n: reduced[p] for n, p in params.items()}
    else:
        local = {n: (p.main_grad if which == "grad" else p.data) for n, p in params.items()}
    lay, pgc = rt.layout, rt.groups.pg_collection
    experts = {n: t for n, t in local.items() if is_expert(names[n])}
    dense = {n: t for n, t in local.items() if n not in experts}
    full = gather_full(dense, params, names, rt.plan.model, rt.groups.tp)
    mine = full if (lay.tp_rank == 0 and lay.dp_rank == 0 and lay.cp_rank == 0) else {}
    if experts:   # each EP rank's experts, gathered over expert-TP, from expert-DP replica 0
        full = gather_full(experts, params, names, rt.plan.model, pgc.expt_tp)
        mine = {**mine, **(full if (lay.etp_rank == 0 and lay.edp_rank == 0) else {})}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v.cpu() for k, v in mine.items()})
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for k, v in part.items():
            out.setdefault(k, v)
    return out
