"""Gradient finalisation and clipping for a heterogeneous plan.

- Data parallelism: megatron-core DDP per stage on the stage's DP group. The loss is per token and already
  divided by the global token count, so DDP *sums* gradients (``calculate_per_token_loss`` makes its scaling 1):
  a stage with DP ``d`` then holds exactly the gradient of the global loss, whatever the DP of other stages.
- Embedding copies on several stages (tied output layer on the last stage; T5's decoder-input embedding on the
  stage of the first decoder unit): before the DP reduction, the local gradients of all copies are summed over
  the embedding group (TP-gathered when the holders' TP differ) and DP replica 0 of each holder takes the total.
- Clipping: the global norm counts every parameter once (DP replica 0 of each stage; TP-replicated parameters
  on TP rank 0 only; copies of the first stage's embedding not at all), summed over the world, then
  megatron-core's rule ``coeff = max_norm / (norm + 1e-6)``, applied when below 1. With the distributed
  optimizer, megatron-core's own clipping does the same: its norm runs over the world of disjoint DP shards,
  skipping TP duplicates and parameters flagged ``shared`` (the embedding copies).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..model.init import gather_full, shard


def finalize_model_grads_fn(runtime):
    """A ``config.finalize_model_grads_func`` for megatron-core's schedule, bound to ``runtime``."""

    def finalize(model_chunks, num_tokens=None, pg_collection=None, force_all_reduce=False):
        sync_tied_embedding_grads(runtime)  # on the local (not yet DP-reduced) gradients
        for chunk in model_chunks:
            chunk.finish_grad_sync()

    return finalize


def shared_names(plan) -> dict[str, tuple[int, int]]:
    """Canonical names of parameters with copies on several stages -> their full shape."""
    m = plan.model
    out = {"embedding.word_embeddings.weight": (m.padded_vocab_size, m.hidden_size)}
    if m.is_t5:
        out["embedding.position_embeddings.weight"] = (max(m.seq_length, m.decoder_seq_length), m.hidden_size)
    return out


def sync_tied_embedding_grads(runtime) -> None:
    """Sum the local gradients of all embedding copies (every holding stage and DP replica, whatever their TP);
    DP replica 0 of each holding stage takes the total, the other replicas zero, so that the DP reduction that
    follows (all-reduce, or reduce-scatter for the distributed optimizer) leaves the total on every copy.

    When all holders share one TP degree, each TP index has its own group and shards are summed directly;
    otherwise full (TP-gathered) gradients are summed over one group (TP rank 0 contributing) and re-sharded.
    """
    groups, lay, model = runtime.groups, runtime.layout, runtime.plan.model
    if groups.embedding is None:
        return
    stage = runtime.stage_module
    params = dict(stage.named_parameters())
    names = stage.canonical_names()
    by_canon = {c: n for n, c in names.items()}
    for canon, shape in shared_names(runtime.plan).items():
        local = by_canon.get(canon)
        if groups.embedding_sharded:
            if canon == "embedding.word_embeddings.weight":
                shape = (shape[0] // lay.tp, shape[1])
            g = params[local].main_grad if local is not None else None
            contributes = True
        else:
            g = gather_full({local: params[local].main_grad}, params, names, model, groups.tp)[canon] \
                if local is not None else None
            contributes = lay.tp_rank == 0
        if g is not None and contributes:
            total = g.clone()
        else:
            total = torch.zeros(shape, dtype=stage.config.params_dtype, device=runtime.device)
        dist.all_reduce(total, group=groups.embedding)
        if local is not None:
            p = params[local]
            if lay.dp_rank != 0:
                p.main_grad.zero_()
            elif groups.embedding_sharded:
                p.main_grad.copy_(total)
            else:
                p.main_grad.copy_(shard(total, p, canon, model, lay.tp, lay.tp_rank))


def mark_embedding_copies(stage_module, plan) -> None:
    """Flag the embedding copies outside the first stage ``shared`` so megatron-core's norm counts them once
    (before the optimizer is built: the distributed optimizer copies the flag onto its shards)."""
    if stage_module.stage == 0:
        return
    shared, names = shared_names(plan), stage_module.canonical_names()
    for name, p in stage_module.named_parameters():
        if names[name] in shared:
            p.shared = True


def counted_once(runtime, name: str, param: torch.Tensor, names: dict[str, str], shared) -> bool:
    """Whether this rank counts ``param`` in the global gradient norm."""
    lay = runtime.layout
    if lay.dp_rank != 0:
        return False
    if lay.stage != 0 and names[name] in shared:
        return False  # a copy of the first stage's embedding
    return getattr(param, "tensor_model_parallel", False) or lay.tp_rank == 0


def clip_grad_norm(runtime, max_norm: float) -> float:
    """Clip ``main_grad`` of all parameters by the global norm; returns the norm before clipping."""
    params = list(runtime.stage_module.named_parameters())
    names, shared = runtime.stage_module.canonical_names(), shared_names(runtime.plan)
    counted = [p.main_grad for n, p in params if counted_once(runtime, n, p, names, shared)]
    sq = torch.zeros((), dtype=torch.float64, device=runtime.device)
    for g in counted:
        sq += torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
    dist.all_reduce(sq, group=runtime.groups.world)
    norm = math.sqrt(sq.item())
    if max_norm > 0:
        coeff = max_norm / (norm + 1.0e-6)
        if coeff < 1.0:
            torch._foreach_mul_([p.main_grad for _, p in params], coeff)
    return norm
