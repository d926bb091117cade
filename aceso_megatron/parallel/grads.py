"""Gradient finalisation and clipping for a heterogeneous plan.

- Data parallelism: megatron-core DDP per model chunk on the stage's DP (x CP) group. DDP *sums* gradients (built
  with scaling 1, ``build_steps._summing``) and the schedule's loss scale normalises (``Runtime.loss_scale``): a stage
  with DP ``d`` then holds exactly the gradient of the loss, whatever the DP of other stages. With ``overlap_grad_reduce`` DDP's bucket hooks start each bucket's reduction during the last
  micro-batch's backward.
- Embedding copies on several stages (tied output layer on the last stage; T5's decoder-input embedding on the
  stage of the first decoder unit): before the DP reduction, the local gradients of all copies are summed over
  the embedding group (TP-gathered when the holders' TP differ) and DP replica 0 of each holder takes the total.
  With ``overlap_grad_reduce`` the DDP buckets holding a copy are held back until then
  (``hold_embedding_buckets``).
- Sequence parallelism: norm weights and row-parallel biases see only the rank's ``s/tp`` tokens; their
  gradients (flagged ``sequence_parallel``, as megatron-core flags them) and the QK-layernorm weights and GDN's
  ``out_norm`` weight (each TP rank normalising its own heads; with or without SP) are summed over the TP group after the DP reduction, as megatron-core's ``finalize_model_grads`` does (``allreduce_tp_partial_grads``).
- MoE: routed expert parameters are reduced by DDP over the stage's expert-DP group (``model.moe``); the router
  weight is flagged ``sequence_parallel`` by megatron-core and summed over TP with the others below. Then the
  routers' batch ends as in megatron-core (``finish_router_batch``): the expert bias is updated from the tokens
  counted over the stage's TP x DP x CP group, and the per-batch counters are reset.
- Clipping: the global norm counts every parameter once (DP replica 0 and CP rank 0 of each stage;
  TP-replicated parameters on TP rank 0 only; copies of the first stage's embedding not at all), summed over the
  world, then megatron-core's rule ``coeff = max_norm / (norm + 1e-6)``, applied when below 1. With the
  distributed optimizer, megatron-core's own clipping does the same: its norm runs over the world of disjoint DP
  shards, skipping TP duplicates and parameters flagged ``shared`` (the embedding copies).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..model.init import gather_full, shard
from ..model.moe import is_expert


def grad_of(p):
    """The gradient the runtime finalises in place: DDP's ``main_grad``; a Megatron FSDP parameter's (after
    ``finish_grad_sync``, a DTensor of the distributed optimizer) its local shard, a view of FSDP's gradient buffer
    (None when this rank holds none of it), as megatron-core's ``_allreduce_non_tensor_model_parallel_grads``."""
    if getattr(p, "__fsdp_param__", False):
        return p.grad._local_tensor.data if p.grad is not None else None
    return p.main_grad.data


def finalize_model_grads_fn(runtime):
    """A ``config.finalize_model_grads_func`` for megatron-core's schedule, bound to ``runtime``."""

    def finalize(model_chunks, num_tokens=None, pg_collection=None, force_all_reduce=False):
        sync_tied_embedding_grads(runtime)  # on the local (not yet DP-reduced) gradients
        # buckets whose reduction the backward hooks already started (overlap_grad_reduce): for the record
        runtime.overlapped_buckets = sum(bg.grad_reduce_handle is not None for m in model_chunks
                                         for bg in getattr(m, "bucket_groups", ()))   # Megatron FSDP: none
        for chunk in model_chunks:
            chunk.finish_grad_sync(force_all_reduce=force_all_reduce)
        allreduce_tp_partial_grads(runtime)
        if runtime.plan.model.moe is not None:
            finish_router_batch(runtime, model_chunks)

    return finalize


def finish_router_batch(runtime, model_chunks) -> None:
    """megatron-core's end-of-batch router step (``finalize_model_grads``, after the gradient reductions): with
    ``moe_router_enable_expert_bias`` each router's expert bias moves towards balance by the tokens its experts got
    in the global batch, counted over the stage's TP x DP x CP group (``pg_collection.tp_dp_cp``: the ranks that
    route this stage's tokens, which megatron-core's global group is for a uniform plan); then the per-batch
    counters are reset (``reset_model_temporary_tensors``: the tokens per expert, the global aux loss's tracker)."""
    from megatron.core.distributed.finalize_model_grads import reset_model_temporary_tensors

    from patches.compat import update_router_expert_bias

    config = model_chunks[0].config
    if config.moe_router_enable_expert_bias:
        update_router_expert_bias(model_chunks, config, runtime.groups.pg_collection.tp_dp_cp)
    reset_model_temporary_tensors(config, model_chunks)


def shared_names(plan) -> dict[str, tuple[int, int]]:
    """Canonical names of parameters with copies on several stages -> their full shape."""
    m = plan.model
    out = {"embedding.word_embeddings.weight": (m.padded_vocab_size, m.hidden_size)}
    if m.mtp_num_layers and m.position_embedding == "learned":   # the MTP block's embedding copy
        out["embedding.position_embeddings.weight"] = (m.seq_length, m.hidden_size)
    if m.is_t5:
        out["embedding.position_embeddings.weight"] = (max(m.seq_length, m.decoder_seq_length), m.hidden_size)
    return out


def sync_tied_embedding_grads(runtime) -> None:
    """Sum the local gradients of all embedding copies (every holding stage, DP replica and CP rank, whatever
    their TP); DP replica 0 (CP rank 0) of each holding stage takes the total, the other replicas zero, so that the DP reduction that
    follows (all-reduce, or reduce-scatter for the distributed optimizer) leaves the total on every copy.

    When all holders share one TP degree, each TP index has its own group and shards are summed directly;
    otherwise full (TP-gathered) gradients are summed over one group (TP rank 0 contributing) and re-sharded.
    """
    groups, lay, model = runtime.groups, runtime.layout, runtime.plan.model
    if groups.embedding is None:
        return
    params = dict(runtime.named_parameters())
    names = runtime.canonical_names()
    by_canon = {c: n for n, c in names.items()}
    dtype = runtime.chunks[0].config.params_dtype
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
            total = torch.zeros(shape, dtype=g.dtype if g is not None else dtype, device=runtime.device)
        dist.all_reduce(total, group=groups.embedding)
        if local is not None:
            p = params[local]
            if lay.dp_rank != 0 or lay.cp_rank != 0:  # the DP (x CP) reduction that follows spreads the total
                p.main_grad.zero_()
            elif groups.embedding_sharded:
                p.main_grad.copy_(total)
            else:
                p.main_grad.copy_(shard(total, p, canon, model, lay.tp, lay.tp_rank))


def embedding_bucket_groups(runtime) -> list:
    """The DDP bucket groups (all chunks) that hold an embedding copy."""
    names, shared = runtime.canonical_names(), shared_names(runtime.plan)
    copies = {p for n, p in runtime.named_parameters() if names[n] in shared}
    return [bg for m in runtime.models for bg in m.bucket_groups if bg.params & copies]


def hold_embedding_buckets(bucket_groups) -> None:
    """Keep DDP from reducing these buckets during backward (call after ``zero_grad_buffer``, every step).

    With ``overlap_grad_reduce`` a bucket's reduction starts from its parameters' backward hooks once every
    gradient of the bucket is ready -- for an embedding copy before ``sync_tied_embedding_grads`` has summed the
    copies. megatron-core's bucket group has one mode that counts hook calls but dispatches in
    ``finish_grad_sync`` instead: its first batch (``is_first_batch``, while it learns how many hook calls make a
    bucket ready). Holding these groups in that mode every step moves their reduction to ``finish_grad_sync``,
    after the copies are summed; all other buckets still overlap.
    """
    for bg in bucket_groups:
        bg.is_first_batch = True


def allreduce_tp_partial_grads(runtime) -> None:
    """Sum over the TP group the gradients that TP ranks hold in part: parameters flagged ``sequence_parallel``
    on a sequence-parallel chunk, and q/k layer norms (``qk_layernorm``), as megatron-core's
    ``_allreduce_non_tensor_model_parallel_grads``, and a GDN layer's ``out_norm`` (one ``d_v`` weight shared by the
    value heads, replicated over TP: each rank normalises its own heads; megatron-core sums it only under SP, where
    TE's norm flags it, so its TP replicas drift apart without SP) -- except routed experts' biases, which megatron-core flags too
    but whose gradient the token dispatcher already brought whole to their EP rank."""
    if runtime.layout.tp == 1:
        return
    grads = []
    for chunk in runtime.chunks:
        cfg, names = chunk.config, chunk.canonical_names()
        for name, p in chunk.named_parameters():
            if is_expert(names[name]):   # full on its EP rank after the dispatcher's backward (biases are flagged)
                continue
            if (cfg.sequence_parallel and getattr(p, "sequence_parallel", False)) or \
                    (cfg.qk_layernorm and not cfg.multi_latent_attention   # MLA's: on whole latents (SP: flagged)
                     and ("q_layernorm" in name or "k_layernorm" in name)) or ".self_attention.out_norm." in name:
                if (g := grad_of(p)) is not None:   # Megatron FSDP: the local shard (grad_of)
                    grads.append(g)
    if grads:
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=runtime.groups.tp)
        for buf, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            buf.copy_(synced)


def mark_embedding_copies(chunks, plan) -> None:
    """Flag the embedding copies outside the first stage ``shared`` so megatron-core's norm counts them once
    (before the optimizer is built: the distributed optimizer copies the flag onto its shards), and every copy
    ``shared_embedding`` as megatron-core's ``LanguageModule`` does (DDP gives each its own bucket: megatron-core
    with the distributed optimizer, ``patches.shared_embedding_bucket`` without) -- when the plan has copies on
    several stages."""
    from .layout import embedding_stages

    if len(embedding_stages(plan)) < 2:
        return
    shared = shared_names(plan)
    for chunk in chunks:
        names = chunk.canonical_names()
        for name, p in chunk.named_parameters():
            if names[name] in shared:
                p.shared_embedding = True
                if chunk.stage != 0:
                    p.shared = True


def counted_once(runtime, name: str, param: torch.Tensor, names: dict[str, str], shared) -> bool:
    """Whether this rank counts ``param`` in the global gradient norm (a routed expert's: on expert-DP replica 0,
    expert-TP rank 0 unless sharded over expert-TP)."""
    lay = runtime.layout
    if is_expert(names[name]):
        return lay.edp_rank == 0 and (getattr(param, "tensor_model_parallel", False) or lay.etp_rank == 0)
    if lay.dp_rank != 0 or lay.cp_rank != 0:
        return False
    if lay.stage != 0 and names[name] in shared:
        return False  # a copy of the first stage's embedding
    return getattr(param, "tensor_model_parallel", False) or lay.tp_rank == 0


def clip_grad_norm(runtime, max_norm: float) -> float:
    """Clip ``main_grad`` of all parameters by the global norm; returns the norm before clipping."""
    params = list(runtime.named_parameters())
    names, shared = runtime.canonical_names(), shared_names(runtime.plan)
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
