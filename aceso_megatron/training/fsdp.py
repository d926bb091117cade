"""Megatron FSDP plans (``plan.megatron_fsdp``, ``search/settings/fsdp.py``) on megatron-core's own
``FullyShardedDataParallel`` (``distributed/fsdp/mcore_fsdp_adapter.py``), as Megatron-LM's ``--use-megatron-fsdp
--data-parallel-sharding-strategy S`` runs them.

What runs: one pipeline stage (one chunk), dense at any tp (sequence parallel or not) or MoE at tp 1 / etp 1 (the
experts' FSDP buffers sharded over expert-DP on megatron-core's expert device mesh), with DP x CP (and expert-DP)
>= 2, wrapped in ``FullyShardedDataParallel`` on the stage's DP x CP group with the plan's strategy
(``optim_grads_params``: every ``TransformerLayer`` -- each unit -- is an FSDP unit, its weights all-gathered before
its forward and backward), megatron-core's distributed optimizer over its shards (``get_megatron_optimizer`` takes
the FSDP branch), megatron-core's clipping. On CPU with ``patches.fsdp_cpu`` (host streams). TP: each TP rank's
FSDP shards its own TP-local weights over DP x CP (the buffers of a stage's TP ranks have one layout), so the
sequence-parallel partial gradients are summed over TP on the local shards (``parallel.grads.grad_of``), as
megatron-core's ``finalize_model_grads`` does.

What is refused, one line before any process group (the first two by the plan itself,
``search.settings.fsdp.structural_refusal``; the rest by the capability table's runtime rules,
``search.targets.runtime_rules.megatron_fsdp``, and einops, ``aceso_megatron.preflight.fsdp_machine_refusal``; the
one pre-flight asks both):
- pipeline stages or chunks: megatron-core 0.16.1 cannot build Megatron FSDP's device mesh with pipeline
  parallelism, in Megatron-LM either: ``_get_dp_tp_mesh`` lays ``torch.arange(world_size)`` out as
  ``(dp_cp ep tp)``, which fails (``EinopsError: Shape mismatch``) when the world also spans pipeline stages
  (``tests/distributed/test_fsdp_upstream.py`` shows it on stock megatron-core);
- DP x CP 1 (or expert-DP 1) with ``optim_grads`` / ``optim_grads_params``: megatron-core 0.16.1 counts every
  gradient twice there (an unsharded buffer's bucket *is* the buffer, and ``_bucket_group_gradient_reduce`` adds
  the reduce-scatter's output onto it: measured, each gradient exactly 2x DDP's with one micro-batch, no multiple
  with more, ``tests/distributed/test_fsdp_upstream.py``); over one rank FSDP shards nothing anyway;
- ``no_shard`` (megatron-core's step fails on it; it is DDP); MoE at tp or etp > 1 (not run yet:
  ``_fix_tensor_parallel_attributes`` flags the router and expert-TP weights, skipped here without
  transformer-engine); CPU activation offload (not built); a machine without einops (the device mesh needs it);
- checkpoints (``checkpoint_refusal``, asked by ``aceso train``'s argument check): the FSDP optimizer's state
  comes only in megatron-core's ``fsdp_dtensor`` format, not the canonical-name layout of ``training.checkpoint``.

Torch-free at import (the pre-flight and the argument check read it).

Full tensors (tests): ``parallel.gather.local_full`` puts each parameter group's gradient buffer (after the
reduction) or weight buffer (after the optimizer step) together from every DP x CP rank's shard -- the part it
reduced or updated; an unsharded buffer (``optim``) holds the rest unreduced -- and cuts each parameter out of it
at its place in the buffer (``item_index_map``): a TP-local tensor per local name, as DDP's ``main_grad``.
"""

from __future__ import annotations

CHECKPOINT_REASON = ("megatron-core 0.16.1's Megatron FSDP optimizer gives its state only in the fsdp_dtensor format "
                     "(DistributedOptimizer.sharded_state_dict: 'sharding_type fully_reshardable is not supported "
                     "with Megatron FSDP'), which the runtime's canonical-name checkpoints cannot hold")


def checkpoint_refusal(plan, save: str | None, load: str | None) -> str | None:
    """Why ``aceso train`` cannot ``--save`` / ``--load`` under ``plan`` (one line), or None (torch-free)."""
    if plan.megatron_fsdp is None or not (save or load):
        return None
    flag = "--save" if save else "--load"
    return (f"{flag} with megatron_fsdp: {CHECKPOINT_REASON}; train it without {flag}, or remove megatron_fsdp "
            "(the distributed optimizer's checkpoints resume under any plan)")


def ddp_fields(plan) -> dict:
    """The ``DistributedDataParallelConfig`` fields of a Megatron FSDP plan (empty without one; the distributed
    optimizer is on with it: ``Runtime.sharded_optimizer``)."""
    if plan.megatron_fsdp is None:
        return {}
    return {"use_megatron_fsdp": True,
            "data_parallel_sharding_strategy": plan.megatron_fsdp.data_parallel_sharding_strategy}


def wrap(chunk, ddp_config, groups, device):
    """``chunk`` in megatron-core's ``FullyShardedDataParallel`` on the stage's groups (the class as the installed
    megatron-core needs it for per-stage groups: ``patches.compat.fsdp_class``)."""
    import torch

    from patches.compat import fsdp_class

    cls = fsdp_class(groups.tp, groups.pg_collection.expt_tp)
    return cls(chunk.config, ddp_config, chunk, device=torch.device(device), pg_collection=groups.pg_collection)
