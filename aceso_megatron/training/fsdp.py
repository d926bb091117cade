"""Megatron FSDP plans (``plan.megatron_fsdp``, ``search/fsdp.py``) on megatron-core's own
``FullyShardedDataParallel`` (``distributed/fsdp/mcore_fsdp_adapter.py``), as Megatron-LM's ``--use-megatron-fsdp
--data-parallel-sharding-strategy S`` runs them.

What runs: one pipeline stage (one chunk), dense, tp 1, wrapped in ``FullyShardedDataParallel`` on the stage's DP x CP
group with the plan's strategy (``optim_grads_params``: every ``TransformerLayer`` -- each unit -- is an FSDP unit,
its weights all-gathered before its forward and backward), megatron-core's distributed optimizer over its shards
(``get_megatron_optimizer`` takes the FSDP branch), megatron-core's clipping. On CPU with ``patches.fsdp_cpu``
(host streams). What is refused, one line before any process group (``refusal``): pipeline stages (the runtime's
embedding-copy and p2p helpers read DDP's buckets), ``no_shard`` (megatron-core's step fails on it; it is DDP),
tp > 1 (``wrap``), MoE (the expert groups), CPU activation offload (not built),
and a machine without einops (``FullyShardedDataParallel`` builds its device mesh with it).

Full tensors (tests): ``local_full`` puts each parameter group's gradient buffer (after the reduction) or weight
buffer (after the optimizer step) together from every DP x CP rank's shard -- the part it reduced or updated; an
unsharded buffer (``optim``) holds the rest unreduced -- and cuts each parameter out of it at its place in the
buffer (``item_index_map``): a TP-local tensor per local name, as DDP's ``main_grad``.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist


def refusal(plan) -> str | None:
    """Why the runtime cannot run ``plan``'s Megatron FSDP or activation offload (one line), or None."""
    if plan.activation_offload is not None:
        return ("activation_offload: the aceso runtime keeps activations on the device (megatron-core's CPU "
                "offloading is not built); run the plan with Megatron-LM (aceso export --to megatron-lm) or remove it")
    if plan.megatron_fsdp is None:
        return None
    if plan.num_stages > 1 or plan.num_virtual_stages > 1:
        return (f"megatron_fsdp with {plan.num_stages} pipeline stages ({plan.num_virtual_stages} chunks each): the "
                "runtime runs Megatron FSDP on one stage with one chunk; use one stage or run the plan with "
                "Megatron-LM (aceso export --to megatron-lm)")
    if plan.megatron_fsdp.data_parallel_sharding_strategy == "no_shard":
        return ("megatron_fsdp no_shard: megatron-core 0.16.1's optimizer step fails on it (start_param_sync -> "
                "async_bucket_gather: the weight buffer is None) and it shards nothing; remove megatron_fsdp (DDP)")
    if (tp := max(st.tp for st in plan.stages)) > 1:
        return (f"megatron_fsdp with tp {tp}: megatron-core's FullyShardedDataParallel flags TP parameters from the "
                "global parallel_state groups, which the runtime's per-stage groups are not; use tp 1 or run the "
                "plan with Megatron-LM (aceso export --to megatron-lm)")
    if plan.model.moe is not None:
        return "megatron_fsdp with an MoE model: the runtime runs Megatron FSDP on dense models only; remove it"
    if importlib.util.find_spec("einops") is None:
        return ("megatron_fsdp: megatron-core's FullyShardedDataParallel needs einops, which is not installed; "
                "pip install einops")
    return None


def ddp_fields(plan) -> dict:
    """The ``DistributedDataParallelConfig`` fields of a Megatron FSDP plan (empty without one; the distributed
    optimizer is on with it: ``Runtime.sharded_optimizer``)."""
    if plan.megatron_fsdp is None:
        return {}
    return {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": plan.megatron_fsdp.data_parallel_sharding_strategy}


def wrap(chunk, ddp_config, groups, device):
    """``chunk`` in megatron-core's ``FullyShardedDataParallel`` on the stage's groups.

    ``_fix_tensor_parallel_attributes`` reads the global ``parallel_state`` TP groups (asserted initialised, which
    the runtime's per-stage groups never are) to flag TE and expert parameters of TP > 1; at TP 1 without experts
    (``refusal``) it flags nothing, so it is skipped."""
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    class StageFSDP(FullyShardedDataParallel):
        def _fix_tensor_parallel_attributes(self, module):
            pass

    return StageFSDP(chunk.config, ddp_config, chunk, device=torch.device(device), pg_collection=groups.pg_collection)


def local_full(rt, which: str) -> dict[str, torch.Tensor]:
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
