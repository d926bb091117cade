"""Vocab-parallel cross entropy on an explicit TP group.

megatron-core 0.16's ``tensor_parallel.vocab_parallel_cross_entropy`` reads the *global* TP group from
``parallel_state``; a stage of a heterogeneous plan has its own TP group (``pg_collection.tp``). This is the same
autograd function built from megatron-core's own ``VocabParallelCrossEntropy`` pieces (max, predicted logits,
loss, gradient), with the three all-reduces on the given group. No label smoothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as V
from megatron.core.tensor_parallel.utils import VocabUtility


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        logits, logits_max = V.calculate_logits_max(logits)
        size = dist.get_world_size(group)
        if size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        lo, hi = VocabUtility.vocab_range_from_per_partition_vocab_size(
            logits.size(-1), dist.get_rank(group), size
        )
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = V.calculate_predicted_logits(
            logits, target, logits_max, lo, hi
        )
        if size > 1:
            dist.all_reduce(predicted, group=group)
            dist.all_reduce(sum_exp, group=group)
        exp_logits, loss = V.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d, arange_1d, softmax_update, grad_input = V.prepare_gradient_calculation_operands(
            softmax, target_mask
        )
        grad_input = V.calculate_gradients(
            grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, grad_output
        )
        return grad_input, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
    """Per-token loss ``[s, b]`` from vocab-sharded logits ``[s, b, v/tp]`` and targets ``[s, b]``."""
    return _CrossEntropy.apply(logits.float(), target, group)
