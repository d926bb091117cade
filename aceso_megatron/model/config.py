"""The one module that translates our short names (``tp``, ``dp``, recompute choices) to megatron-core's
``TransformerConfig`` fields, per stage and per unit.

A stage's config carries its own ``tensor_model_parallel_size``; ``pipeline_model_parallel_size`` stays 1 because
the runtime places layers itself (megatron-core's layer offsets read the global pipeline rank, which a
heterogeneous plan does not have). Loss is per token (``calculate_per_token_loss``): the loss function divides by
the global token count, and DDP then sums (not averages) gradients over a stage's DP group, which is what makes
stages of different DP agree.

Per-unit recompute: ``unit_config`` switches on a unit's selective recompute (see ``aceso_megatron.model.recompute``).
"""

from __future__ import annotations

import copy

from megatron.core.transformer.transformer_config import TransformerConfig

from model_specs.builders import architecture_kwargs
from search.model import ModelSpec, UnitKind

from .recompute import CheckpointedActivation


def stage_config(model: ModelSpec, tp: int, device: str = "cpu", num_layers: int | None = None) -> TransformerConfig:
    """The TransformerConfig of a stage with tensor-parallel degree ``tp``.

    On CPU: fp32, CPU initialisation, every fusion off (the fused kernels are CUDA-only).
    """
    kw = architecture_kwargs(model, dtype="fp32" if device == "cpu" else None)
    if num_layers is not None:
        kw["num_layers"] = num_layers
    cpu = device == "cpu"
    return TransformerConfig(
        **kw,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        calculate_per_token_loss=True,
        use_cpu_initialization=cpu,
        pipeline_dtype=kw["params_dtype"],
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
    )


def unit_config(base: TransformerConfig, kind: UnitKind, recompute: str) -> TransformerConfig:
    """The config of one unit: ``base`` with the unit's selective recompute switched on (a shallow copy)."""
    if recompute != "selective":
        return base
    cfg = copy.copy(base)
    if kind == "mlp":
        cfg.activation_func = CheckpointedActivation(base.activation_func)
    else:
        cfg.recompute_granularity = "selective"
        cfg.recompute_modules = ["core_attn"]
    return cfg
