"""The one module that translates our short names (``tp``, ``cp``, sequence parallelism, virtual stages,
recompute choices, the fast-path choice) to megatron-core's ``TransformerConfig`` fields, per stage and per unit.

A stage's config carries its own ``tensor_model_parallel_size``, ``context_parallel_size`` and
``sequence_parallel``; ``pipeline_model_parallel_size`` stays 1 because the runtime places layers itself
(megatron-core's layer offsets read the global pipeline rank, which a heterogeneous plan does not have). The loss is
normalised as megatron-core's schedule does it, by ``calculate_per_token_loss`` (``aceso train
--calculate-per-token-loss``; ``engine`` has the rest: DDP sums over a stage's DP group and one loss scale makes
stages of different DP agree).

Interleaved plans: the schedule reads ``virtual_pipeline_model_parallel_size`` and
``microbatch_group_size_per_vp_stage`` (= the number of stages, megatron-core's default for a pipeline of that
size) from the first chunk's config (``interleaving``).

Fusions: what ``fast_path.choose`` decided (CPU: all off, fp32). Per-unit recompute: ``unit_config`` switches
on a unit's selective recompute (see ``aceso_megatron.model.recompute``).

The model's ``megatron`` block (extra ``TransformerConfig`` fields, ``model_specs.extensions.megatron_kwargs``) is
passed unchanged; it may turn the kernel fusions on, except on CPU, where the CUDA-only fusions
(``search.spec.megatron_fields.CPU_OFF``) stay off whatever it says (logged once). Fields the runtime sets itself are
refused in the block, so they never collide here.

YaRN on standard attention (GPT-OSS's rope scaling): the ``yarn_*`` attributes ``GPTModel(position_embedding_type=
"yarn")`` and every attention read from the config (no ``TransformerConfig`` field holds them; Megatron-LM core_v0.19.0
sets them the same way, ``argument_utils._apply_yarn_config_from_args``), on the config itself so that the shallow
copies of ``unit_config`` keep them (``aceso_megatron.model.rotary``).

Low precision (``low``: the plan's ``settings.low_precision``): the recipe's fields as Megatron-LM sets them from
the exported flags (``lowprec.config_fields``); a megatron block that sets one of them too is refused (one truth).
"""

from __future__ import annotations

import copy
import logging

from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from model_specs.builders import architecture_kwargs
from model_specs.extensions import megatron_kwargs
from search import layers
from search.io.errors import AcesoError
from search.spec.megatron_fields import CPU_OFF
from search.spec.model import ModelSpec, UnitKind
from search.spec.rope_scaling import yarn_config, yarn_on_standard_attention

from .fast_path import Environment, FastPath, choose
from .lowprec import config_fields
from .recompute import CheckpointedActivation

log = logging.getLogger(__name__)
_logged: set[str] = set()


def _fusions(extra: dict, cpu: bool, base: dict) -> dict:
    """The kernel-fusion switches: ``base`` (the fast path's choice, ``FastPath.config``) with the megatron block's
    on top, except on CPU where the CUDA-only kernels stay off. Pops them from ``extra``."""
    asked = {f: bool(extra.pop(f)) for f in CPU_OFF if f in extra}
    if not cpu:
        return {**base, **asked}
    if on := sorted(set(f for f, v in asked.items() if v) - _logged):
        log.info("on CPU: %s off (CUDA-only kernels)", ", ".join(f"megatron.{f}" for f in on))
        _logged.update(on)
    return base


def stage_config(model: ModelSpec, tp: int, device: str = "cpu", num_layers: int | None = None, *,
                 cp: int = 1, sequence_parallel: bool = False, fast: FastPath | None = None,
                 moe: dict | None = None, low=None, per_token_loss: bool = False) -> TransformerConfig:
    """The TransformerConfig of a stage with tensor-parallel degree ``tp`` (and ``cp``, SP) on ``device``, with
    the fusions of ``fast`` (default: what this machine offers; on CPU fp32 and every fusion off), the stage's MoE
    fields ``moe`` (expert shape, dispatcher: ``model.moe.stage_fields``), the recipe of ``low`` (a
    ``LowPrecision``), plus the ``megatron`` block's fields; an MLA model's is an ``MLATransformerConfig``
    (``builders.mla_mtp_kwargs``). ``per_token_loss``: megatron-core's ``calculate_per_token_loss``."""
    fast = fast or choose(Environment.detect(device), model)
    kw = architecture_kwargs(model, dtype=fast.dtype)
    if num_layers is not None:
        kw["num_layers"] = num_layers
    extra = megatron_kwargs(model)
    recipe = config_fields(low) if low is not None else {}
    if clash := sorted(set(recipe) & set(extra)):
        raise AcesoError(f"megatron.{clash[0]}: the plan's settings.low_precision ({low.recipe}) sets it; remove it "
                         "from the model's megatron block")
    cls = MLATransformerConfig if model.mla is not None else TransformerConfig   # MLA: its own config class
    cfg = cls(
        **kw,
        **_fusions(extra, device == "cpu", fast.config),
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        pipeline_model_parallel_size=1,
        sequence_parallel=sequence_parallel and tp > 1,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        calculate_per_token_loss=per_token_loss,
        use_cpu_initialization=device == "cpu",
        pipeline_dtype=kw["params_dtype"],
        **(moe or {}),
        **recipe,
        **extra,
    )
    if yarn_on_standard_attention(model):   # no TransformerConfig field: attributes, as Megatron-LM sets them
        for name, value in yarn_config(model).items():
            setattr(cfg, name, value)
    return cfg


def interleaving(config: TransformerConfig, num_stages: int, num_chunks: int) -> None:
    """Mark ``config`` (the first chunk's) for megatron-core's interleaved schedule."""
    if num_chunks > 1:
        config.virtual_pipeline_model_parallel_size = num_chunks
        config.microbatch_group_size_per_vp_stage = num_stages


def without_grad_accum_fusion(config: TransformerConfig) -> TransformerConfig:
    """A copy for megatron-core's *local* linears when only transformer-engine's support the fusion."""
    if not config.gradient_accumulation_fusion:
        return config
    cfg = copy.copy(config)
    cfg.gradient_accumulation_fusion = False
    return cfg


def unit_config(base: TransformerConfig, kind: UnitKind, recompute: str) -> TransformerConfig:
    """The config of one unit: ``base`` with the unit's selective recompute switched on (a shallow copy).
    ``mla_up_proj`` (MLA attention units) is megatron-core 0.16.1's ``recompute_modules`` ["mla_up_proj"]:
    ``MLASelfAttention`` checkpoints its Q/K/V up projections and RoPE without output and discards Q, K and V
    once the core attention has run.

    A selective MLP unit runs its activation through ``CheckpointedActivation`` with ``bias_activation_fusion``
    off: megatron-core's MLP calls the fused bias-GELU/SwiGLU kernel directly when the fusion is on, which would
    bypass the checkpoint and keep the activation output.
    """
    if recompute == "mla_up_proj":   # an MLA attention unit: megatron-core's own up-projection recompute
        cfg = copy.copy(base)
        cfg.recompute_granularity = "selective"
        cfg.recompute_modules = ["mla_up_proj"]
        return cfg
    if recompute != "selective":
        return base
    cfg = copy.copy(base)
    if layers.get(kind).role == "mlp":   # an MoE unit: each expert's activation (SequentialMLP; not megatron's moe_act)
        cfg.activation_func = CheckpointedActivation(base.activation_func)
        cfg.bias_activation_fusion = False
    else:
        cfg.recompute_granularity = "selective"
        cfg.recompute_modules = ["core_attn"]
    return cfg
