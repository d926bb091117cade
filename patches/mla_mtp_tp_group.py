"""MLA and MTP on a stage's own TP group, and the RoPE key's gradient of MLA summed over TP.

Target: the module globals ``gather_from_tensor_model_parallel_region`` / ``scatter_to_sequence_parallel_region`` of
``megatron.core.transformer.multi_latent_attention`` and ``...multi_token_prediction`` (replaced by versions that
take the group of the module running them), with ``MLASelfAttention.get_query_key_value_tensors`` and
``MultiTokenPredictionLayer._concat_embeddings`` wrapped to name that group (``self.tp_group``,
``self.eh_proj.tp_group``) for the duration of the call; and ``multi_token_prediction.get_transformer_layer_offset``,
which ``MultiTokenPredictionLayer.__init__`` calls without a pipeline rank (the global one, unset here): with a
stage's config (``pipeline_model_parallel_size`` 1) the offset is 0 whatever the rank, so rank 0 is passed.

Reason: both methods call the two mappings without a group, which falls back to the global ``parallel_state`` TP
group; per-stage groups leave it unset (``group.size()`` on None: ``AttributeError``, at every TP degree for MTP,
at TP > 1 for MLA). And with megatron-core's local spec MLA's ``linear_kv_down_proj`` is a ``ColumnParallelLinear``
whose output (``kv_lora_rank + qk_pos_emb_head_dim`` wide) is TP-sharded and gathered: the RoPE key part
``k_pos_emb`` is then shared by the heads of every TP rank, but the gather's backward (a split) keeps only this
rank's heads' gradient of it -- the other ranks' contributions to ``linear_kv_down_proj``'s RoPE rows are lost
(the latent part is whole: ``linear_kv_up_proj`` reduces its input gradient). The replacement for that one gather
sums the ``k_pos_emb`` columns of the gradient over TP before the split, which is what the single-process model
computes (``tests/distributed/test_moe_mla_mtp.py`` proves it at tp2 + SP). Outside the wrapped methods, or with
an explicit group, the mappings behave as upstream.

Applied by ``build_runtime`` for MLA or MTP models. Tested megatron-core versions: 0.16.1, 0.19.2 (the call order in
``get_query_key_value_tensors``: the ``q_compressed`` gather, when ``q_lora_rank`` is set -- in 0.19 inside
``_qkv_down_projection``, which it calls -- then ``kv_combined``). 0.19's MTP layer passes its group to both mappings
and computes its offset from the config alone (``get_mtp_layer_offset``; ``get_transformer_layer_offset`` is gone
from the module and not swapped): there only the MLA part changes anything.
Remove when megatron-core passes its ``tp_group`` to these mappings and reduces the RoPE key's gradient.
"""

from __future__ import annotations

import contextvars
import functools

import torch
import torch.distributed as dist

from ._base import Swaps, check_version

NAME = "mla_mtp_tp_group"
TESTED_VERSIONS = ("0.16.1", "0.19.2")
_swaps = Swaps()
# (tp group, the gathers still to come in this call: "q" / "kv", the RoPE key width), set by the wrapped methods
_CALL: contextvars.ContextVar = contextvars.ContextVar("aceso_mla_mtp_call", default=None)


class _GatherWithKeyPos(torch.autograd.Function):
    """All-gather along the last dim; backward: the last ``pos`` columns' gradient summed over ``group``, then
    this rank's split (the other columns' gradient is whole on every rank already)."""

    @staticmethod
    def forward(ctx, x, group, pos):
        from megatron.core.tensor_parallel.mappings import _gather_along_last_dim

        ctx.group, ctx.pos = group, pos
        return _gather_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        from megatron.core.tensor_parallel.mappings import _split_along_last_dim

        grad = grad.clone()
        part = grad[..., -ctx.pos:].contiguous()
        dist.all_reduce(part, group=ctx.group)
        grad[..., -ctx.pos:] = part
        return _split_along_last_dim(grad, ctx.group), None, None


def _gather(original):
    def gather(input_, group=None):
        call = _CALL.get()
        if group is not None or call is None:
            return original(input_, group)
        tp, pending, pos = call
        if pending and pending.pop(0) == "kv" and tp.size() > 1:
            return _GatherWithKeyPos.apply(input_, tp, pos)
        return original(input_, tp)

    return gather


def _scatter(original):
    def scatter(input_, group=None):
        call = _CALL.get()
        return original(input_, group if group is not None or call is None else call[0])

    return scatter


def _within(method, group_of, pending_of):
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        pending, pos = pending_of(self)
        token = _CALL.set((group_of(self), pending, pos))
        try:
            return method(self, *args, **kwargs)
        finally:
            _CALL.reset(token)

    return wrapped


def _layer_offset(original):
    def offset(config, vp_stage=None, pp_rank=None):
        if pp_rank is None and config.pipeline_model_parallel_size == 1:   # a stage's config: no offset
            pp_rank = 0
        return original(config, vp_stage, pp_rank)

    return offset


def is_applied() -> bool:
    return _swaps.active


def apply() -> None:
    """Swap in the group-taking mappings and wrap the two methods (idempotent)."""
    if _swaps.active:
        return
    check_version(NAME, TESTED_VERSIONS)
    from megatron.core.transformer import multi_latent_attention as mla
    from megatron.core.transformer import multi_token_prediction as mtp

    def mla_pending(attn):
        cfg = attn.config
        return (["q"] if cfg.q_lora_rank is not None else []) + ["kv"], cfg.qk_pos_emb_head_dim

    _swaps.set(mla, "gather_from_tensor_model_parallel_region", _gather(mla.gather_from_tensor_model_parallel_region))
    _swaps.set(mla, "scatter_to_sequence_parallel_region", _scatter(mla.scatter_to_sequence_parallel_region))
    _swaps.set(mla.MLASelfAttention, "get_query_key_value_tensors",
               _within(mla.MLASelfAttention.get_query_key_value_tensors, lambda a: a.tp_group, mla_pending))
    _swaps.set(mtp, "gather_from_tensor_model_parallel_region", _gather(mtp.gather_from_tensor_model_parallel_region))
    _swaps.set(mtp, "scatter_to_sequence_parallel_region", _scatter(mtp.scatter_to_sequence_parallel_region))
    if hasattr(mtp, "get_transformer_layer_offset"):   # 0.16.1; 0.19's get_mtp_layer_offset reads the config only
        _swaps.set(mtp, "get_transformer_layer_offset", _layer_offset(mtp.get_transformer_layer_offset))
    _swaps.set(mtp.MultiTokenPredictionLayer, "_concat_embeddings",
               _within(mtp.MultiTokenPredictionLayer._concat_embeddings, lambda m: m.eh_proj.tp_group,
                       lambda m: ([], 0)))


def revert() -> None:
    """Restore megatron-core's functions."""
    _swaps.restore()
