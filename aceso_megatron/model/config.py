"""The one module that translates our short names (``tp``, ``dp``, recompute choices) to megatron-core's
``TransformerConfig`` fields, per stage and per unit.

A stage's config carries its own ``tensor_model_parallel_size``; ``pipeline_model_parallel_size`` stays 1 because
the runtime places layers itself (megatron-core's layer offsets read the global pipeline rank, which a
heterogeneous plan does not have). Loss is per token (``calculate_per_token_loss``): the loss function divides by
the global token count, and DDP then sums (not averages) gradients over a stage's DP group, which is what makes
stages of different DP agree.

Per-unit recompute: ``unit_config`` switches on a unit's selective recompute (see ``aceso_megatron.model.recompute``).

The model's ``megatron`` block (extra ``TransformerConfig`` fields, ``model_specs.extensions.megatron_kwargs``) is
passed unchanged; it may turn the kernel fusions on, except on CPU, where the CUDA-only fusions
(``search.megatron_fields.CPU_OFF``) stay off whatever it says (logged once). Fields the runtime sets itself are
refused in the block, so they never collide here.
"""

from __future__ import annotations

import copy
import logging

from megatron.core.transformer.transformer_config import TransformerConfig

from model_specs.builders import architecture_kwargs
from model_specs.extensions import megatron_kwargs
from search.megatron_fields import CPU_OFF
from search.model import ModelSpec, UnitKind

from .recompute import CheckpointedActivation

log = logging.getLogger(__name__)
_logged: set[str] = set()


def _fusions(extra: dict, cpu: bool, base: dict | None = None) -> dict:
    """The kernel-fusion switches: ``base`` (the runtime's choice; default all off) with the megatron block's on
    top, except on CPU where the CUDA-only kernels stay off. Pops them from ``extra``."""
    base = dict(base if base is not None else dict.fromkeys(CPU_OFF, False))
    asked = {f: bool(extra.pop(f)) for f in CPU_OFF if f in extra}
    if not cpu:
        return {**base, **asked}
    if on := sorted(set(f for f, v in asked.items() if v) - _logged):
        log.info("on CPU: %s off (CUDA-only kernels)", ", ".join(f"megatron.{f}" for f in on))
        _logged.update(on)
    return base


def stage_config(model: ModelSpec, tp: int, device: str = "cpu", num_layers: int | None = None) -> TransformerConfig:
    """The TransformerConfig of a stage with tensor-parallel degree ``tp``.

    On CPU: fp32, CPU initialisation, every fusion off (the fused kernels are CUDA-only). Plus the ``megatron``
    block's fields.
    """
    kw = architecture_kwargs(model, dtype="fp32" if device == "cpu" else None)
    if num_layers is not None:
        kw["num_layers"] = num_layers
    cpu = device == "cpu"
    extra = megatron_kwargs(model)
    fusions = _fusions(extra, cpu)
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
        **fusions,
        **extra,
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
