"""Full-model tensors from a running plan, by canonical name (tests and benches compare them with a
single-process model).

A parameter's full value is its TP shards put together (``init.gather_full``) on DP replica 0, CP rank 0 of its
stage (a routed expert's: its expert-TP shards on expert-DP replica 0 of its EP rank). Its gradient is its ``main_grad`` after the step's finalisation -- except with the distributed optimizer,
where each DP (x CP) rank holds the reduced gradient of its shard of every DDP bucket only: the shards are put
together first (``reduced_grads``); with Megatron FSDP, gradients and weights from its buffers
(``local_full``). Adam's state (``full_optimizer_state``) likewise: the distributed optimizer's
flat DP shards put together, then the TP shards.
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
        for buf in m.buffers + m.expert_parallel_buffers:   # MoE: expert buffers shard over expert-DP
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


def local_full(rt, which: str) -> dict:
    """``which`` = "grad" or "param": local name -> its DP-complete (TP-local) tensor (collective over DP x CP)."""
    out = {}
    for i, m in enumerate(rt.models):
        fsdp = m.module
        names = {p: n for n, p in fsdp.raw_param.items()}
        for group in fsdp.param_and_grad_buffer.parameter_groups:
            buf = group.main_grad_buffer if which == "grad" else group.model_weight_buffer
            if buf is None:
                continue
            # each rank's (virtual) shard is what it reduced / updated: summed over DP x CP into the whole bucket
            sh, whole = buf.shard_bucket_index, buf.bucket_index
            data = torch.zeros(whole.global_data_index + whole.size, dtype=buf.data.dtype)
            lo = sh.global_data_index
            data[lo:lo + sh.size] = buf.data[sh.local_data_index:sh.local_data_index + sh.size].cpu()
            dist.all_reduce(data, group=buf.data_parallel_group)
            for k, p in enumerate(buf.params):
                ix = buf.item_index_map[k]
                out[f"chunks.{i}.{names[p]}"] = data[ix.global_data_index:ix.global_data_index + ix.size].view(p.shape)
    return out


def full_tensors(rt, which: str) -> dict[str, torch.Tensor]:
    """``which`` = "param" or "grad": every full-model tensor on every rank (collective)."""
    params = dict(rt.named_parameters())
    names = rt.canonical_names()
    if rt.plan.megatron_fsdp is not None:   # Megatron FSDP: its buffers put together over DP x CP
        local = local_full(rt, which)
    elif which == "grad" and rt.plan.distributed_optimizer:
        reduced = reduced_grads(rt)
        local = {n: reduced[p] for n, p in params.items()}
    else:
        local = {n: (p.main_grad if which == "grad" else p.data) for n, p in params.items()}
    mine = _gathered_here(rt, local)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v.cpu() for k, v in mine.items()})
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for k, v in part.items():
            out.setdefault(k, v)
    return out


def expert_bias_buffers(rt) -> list[tuple[str, torch.Tensor]]:
    """``(local name, buffer)`` of every router's expert bias (``moe_router_enable_expert_bias``): a persistent
    buffer, which megatron-core's router saves with its weight, the same on every rank of its stage."""
    return [(f"chunks.{i}.{n}.expert_bias", m.expert_bias) for i, c in enumerate(rt.chunks)
            for n, m in c.named_modules() if getattr(m, "expert_bias", None) is not None]


def expert_bias_name(names: dict[str, str], local: str) -> str:
    """The canonical name of the expert bias ``local`` (``...router.expert_bias``): its router weight's (``names``:
    local parameter name -> canonical) with ``expert_bias`` for ``weight``."""
    return names[local.removesuffix("expert_bias") + "weight"].removesuffix("weight") + "expert_bias"


def expert_biases(modules, names: dict[str, str]) -> dict[str, torch.Tensor]:
    """The routers' expert biases among ``modules`` (``(name, module)`` pairs), by canonical name
    (``expert_bias_name``)."""
    return {expert_bias_name(names, f"{n}.expert_bias"): m.expert_bias.detach().cpu().clone()
            for n, m in modules if getattr(m, "expert_bias", None) is not None}


def all_expert_biases(rt) -> dict[str, list[torch.Tensor]]:
    """Every router's expert bias (a buffer, which each rank of its stage updates itself), by canonical name: every
    rank's copy, to check them against one reference and against each other (collective)."""
    names = rt.canonical_names()
    mine = {expert_bias_name(names, local): b.detach().cpu().clone() for local, b in expert_bias_buffers(rt)}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    out: dict[str, list[torch.Tensor]] = {}
    for part in parts:
        for k, v in part.items():
            out.setdefault(k, []).append(v)
    return out


def _gathered_here(rt, local: dict) -> dict[str, torch.Tensor]:
    """Local name -> tensor (this rank's shards) to canonical name -> full tensor, for the tensors this rank
    reports: dense ones on TP rank 0 of DP replica 0 (CP rank 0), each EP rank's experts gathered over expert-TP
    on expert-DP replica 0 (collective over TP and expert-TP)."""
    params, names = dict(rt.named_parameters()), rt.canonical_names()
    lay, pgc = rt.layout, rt.groups.pg_collection
    experts = {n: t for n, t in local.items() if is_expert(names[n])}
    dense = {n: t for n, t in local.items() if n not in experts}
    full = gather_full(dense, params, names, rt.plan.model, rt.groups.tp)
    mine = full if (lay.tp_rank == 0 and lay.dp_rank == 0 and lay.cp_rank == 0) else {}
    if experts:
        full = gather_full(experts, params, names, rt.plan.model, pgc.expt_tp)
        mine = {**mine, **(full if (lay.etp_rank == 0 and lay.edp_rank == 0) else {})}
    return mine


OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq", "param")   # Adam's moments and the fp32 master weight


def _local_optimizer_state(rt) -> tuple[dict[str, dict], set[float]]:
    """Per key of ``OPTIMIZER_KEYS``: local parameter name -> its value on this TP rank (the distributed
    optimizer's flat DP shards summed over DP); and the step counts seen."""
    params = dict(rt.named_parameters())
    by_id = {id(p): n for n, p in params.items()}
    out = {k: {} for k in OPTIMIZER_KEYS}
    steps: set[float] = set()
    for opt in getattr(rt.optimizer, "chained_optimizers", [rt.optimizer]):
        if rt.plan.distributed_optimizer:   # MoE: one optimizer for the dense buffers, one for the experts'
            held = {p for buf in opt.buffers for p in buf.param_index_map}   # (whether or not in this rank's shard)
            flat = {n: {k: torch.zeros(p.numel()) for k in OPTIMIZER_KEYS} for n, p in params.items() if p in held}
            for maps in opt.gbuf_ranges:
                for per_bucket in maps.values():
                    for bucket in per_bucket:
                        for p, ranges in bucket["param_map"].items():
                            r, mine = ranges["param"], opt._get_main_param_and_optimizer_states(p)
                            steps.add(float(mine["step"]))
                            for k in OPTIMIZER_KEYS:
                                flat[by_id[id(p)]][k][r.start:r.end] = mine[k].float()
            for n, p in params.items():
                if n not in flat:
                    continue
                for k in OPTIMIZER_KEYS:
                    dist.all_reduce(flat[n][k], group=opt.data_parallel_group)
                    out[k][n] = flat[n][k].view(p.shape)
        else:   # bf16/fp16: the fp32 copy beside each parameter; fp32: the parameter itself
            mains = {id(m): f for g16, g32 in zip(getattr(opt, "float16_groups", []),
                                                  getattr(opt, "fp32_from_float16_groups", [])) for m, f in zip(g16, g32)}
            for n, p in params.items():
                main = mains.get(id(p), p)
                if main not in opt.optimizer.state:   # MoE: the other optimizer's (dense | expert) parameter
                    continue
                state = opt.optimizer.state[main]
                steps.add(float(state["step"]))
                out["exp_avg"][n], out["exp_avg_sq"][n], out["param"][n] = state["exp_avg"], state["exp_avg_sq"], main
    return out, steps


def full_optimizer_state(rt) -> dict:
    """Adam's state from the live optimizer: ``{key of OPTIMIZER_KEYS: {canonical name: full tensor}, "step":
    [the step counts of every rank]}`` on every rank (collective; tests compare optimizer kinds with it)."""
    local, steps = _local_optimizer_state(rt)
    mine = {k: {n: t.cpu() for n, t in _gathered_here(rt, v).items()} for k, v in local.items()}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (mine, sorted(steps)))
    out = {k: {} for k in OPTIMIZER_KEYS}
    for part, _ in parts:
        for k, v in part.items():
            for n, t in v.items():
                out[k].setdefault(n, t)
    out["step"] = sorted({s for _, ss in parts for s in ss})
    return out
