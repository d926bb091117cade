"""GPT-OSS's softmax offset (attention sinks) in the runtime's stages: megatron-core's own, marked as split over TP.

``TransformerConfig.softmax_type`` (megatron-core 0.16.1 and 0.19.2 alike): ``off-by-one`` gives the core attention
a zero tensor ``softmax_offset`` (a plain attribute, no parameter), ``learnable`` a parameter ``softmax_offset`` of
``num_attention_heads / tp`` elements, one per local query head, drawn by ``config.init_method`` (the runtime then
overwrites it with its canonical value, ``init.full_value``); the softmax appends it as one more logit per row and
drops that column (``fused_softmax.SoftmaxOne``). ``DotProductAttention`` and ``TEDotProductAttention`` both save it
split along dim 0 over TP (their ``sharded_state_dict``: ``{'softmax_offset': 0}``), the query heads' split.

Both releases allocate it on ``torch.cuda.current_device()``; on CPU ``patches.cpu_mode`` answers 0 and its
function mode puts device 0 on the host, so no patch of its own is needed.

What megatron-core leaves out: the parameter carries no ``tensor_model_parallel`` / ``partition_dim`` attribute
(its linears get them from ``set_tensor_model_parallel_attributes``). Unmarked, it reads as a TP duplicate: the
gradient norm counts TP rank 0's heads only (``param_is_not_tensor_parallel_duplicate``), and the runtime's
initialisation, gathers and checkpoints (which follow those attributes: ``parallel.shards``,
``training.checkpoint``) would treat each rank's heads as the whole tensor. ``mark_tp_split`` gives it the
attributes of a column-parallel weight: split along dim 0, stride 1.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

NAME = "softmax_offset"


def mark_tp_split(module: torch.nn.Module) -> int:
    """Flag every learnable ``softmax_offset`` under ``module`` as split over TP along dim 0 (left as it is where
    a module flagged it already); returns how many it holds."""
    n = 0
    for name, p in module.named_parameters():
        if name.rsplit(".", 1)[-1] != NAME:
            continue
        n += 1
        if not hasattr(p, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(p, True, 0, 1)
    return n
