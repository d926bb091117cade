"""``ModelSpec`` -> megatron-core ``TransformerConfig`` keyword arguments and layer ``ModuleSpec``s (torch).

Architecture only: sizes, norm, activation, biases, position embedding, GPT-OSS's layer fields. Parallel degrees and
recompute are added per stage by ``aceso_megatron.model.config`` (the one place that translates our short names to
megatron-core's), and so are the ``megatron`` block's extra fields (``extensions.megatron_kwargs``).

Layer specs are megatron-core's own: the local (pure PyTorch) specs when transformer-engine is absent, the TE
specs when it is importable (never on CPU: callers pass ``te=False``); or the user's, when the model names a
``layer_spec`` provider (``model_specs.extensions``: import, checks, carving rules). A *unit* spec (one sub-layer
unit of ``search.spec.model``) is the full layer spec with the other kinds' submodules replaced by
``IdentityOp``/``IdentityFuncOp``; what each kind keeps is its registry record's ``layer_parts``
(``search.layers``): an attention (or MLA) unit keeps the input norm, the self-attention and its residual add; an
MLP (or MoE: megatron-core's ``MoELayer`` sits at ``mlp``) unit keeps the pre-MLP norm, the MLP and its residual add;
a T5 cross-attention unit keeps the pre-cross-attention norm, the cross-attention and its residual add. Chaining the units of a layer computes exactly what the full
``TransformerLayer`` computes.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
import torch.nn.functional as F
from megatron.core.activations import squared_relu
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

from patches.compat import mlp_class, mlp_on_group
from search.layers.layer_variants import config_kwargs
from search.spec.rope_scaling import runtime_kwargs
from search import layers
from search.layers.hybrid import mtp_layer
from search.spec.model import ModelSpec, UnitKind

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# the MLP activation as megatron-core's activation_func (gated: ``ModelSpec.gated_mlp``); Megatron-LM's --swiglu,
# --squared-relu, --quick-geglu (core_v0.16.1 arguments.py: fused_bias_geglu.quick_gelu with gated_linear_unit,
# the function MLP compares its activation_func with)
_ACTIVATIONS = {"swiglu": F.silu, "squared_relu": squared_relu, "quick_geglu": quick_gelu}



def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def architecture_kwargs(model: ModelSpec, dtype: str | None = None) -> dict:
    """TransformerConfig keyword arguments describing the architecture (no parallelism, no recompute)."""
    dt = _DTYPES[dtype or model.params_dtype]
    return {
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_query_groups": model.num_query_groups,
        "kv_channels": model.head_dim,
        "ffn_hidden_size": model.ffn_hidden_size,
        "normalization": "RMSNorm" if model.normalization == "rmsnorm" else "LayerNorm",
        "gated_linear_unit": model.gated_mlp,        # swiglu, quick_geglu
        "activation_func": _ACTIVATIONS.get(model.activation, F.gelu),
        "add_bias_linear": model.add_bias_linear,
        "params_dtype": dt,
        "fp16": dt == torch.float16,
        "bf16": dt == torch.bfloat16,
        **config_kwargs(model),      # GPT-OSS's window, softmax offset, GEGLU offset / clamp (search.layers.layer_variants)
        **moe_kwargs(model),
        **mla_mtp_kwargs(model),
        **mamba_kwargs(model),
        **gdn_kwargs(model),
    }


def mamba_kwargs(model: ModelSpec) -> dict:
    """A hybrid model's Mamba-2 mixer as ``TransformerConfig``'s ``mamba_*`` fields (empty without one); the
    mixer's own arguments (``chunk_size``, ``d_conv``, ``expand``) are its spec's params (``mamba_layer_spec``)."""
    m = model.mamba
    if m is None:
        return {}
    return {"mamba_state_dim": m.mamba_state_dim, "mamba_head_dim": m.mamba_head_dim,
            "mamba_num_groups": m.mamba_num_groups, "mamba_num_heads": m.mamba_num_heads,
            "use_mamba_mem_eff_path": m.use_mamba_mem_eff_path}


def mamba_layer_spec(model: ModelSpec, te: bool | None = None) -> ModuleSpec:
    """megatron-core's ``MambaLayer`` (an ``M`` layer of the hybrid pattern): its pre-norm, ``MambaMixer`` with a
    column-parallel ``in_proj`` and a row-parallel ``out_proj``, and the residual add. The norm is a module of its
    own (the final norm's class) on either path, as in megatron-core's local Mamba spec, so TE and local runs keep
    the same parameter names (``norm.weight``; TE's stock spec fuses it into ``in_proj``)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules

    if _te(te):
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear as column
        from megatron.core.extensions.transformer_engine import TERowParallelLinear as row
    else:
        from megatron.core.tensor_parallel import ColumnParallelLinear as column
        from megatron.core.tensor_parallel import RowParallelLinear as row
    m = model.mamba
    mixer = ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(in_proj=column, out_proj=row),
                       params={"chunk_size": m.chunk_size, "d_conv": m.d_conv, "expand": m.expand})
    return ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=final_norm_spec(model, te), mixer=mixer, mamba_bda=get_bias_dropout_add))


def gdn_kwargs(model: ModelSpec) -> dict:
    """A hybrid model's Gated DeltaNet mixer as ``TransformerConfig``'s ``linear_*`` fields (empty without one:
    ``search.layers.gdn.GDNSpec``'s fields are their names)."""
    return {} if model.gdn is None else model.gdn.model_dump()


def gdn_layer_spec(model: ModelSpec, te: bool | None = None) -> ModuleSpec:
    """megatron-core's GDN layer (a ``G`` layer of the hybrid pattern, ``hybrid_layer_specs.gdn_layer``): a
    ``TransformerLayer`` of the pre-norm, ``GatedDeltaNet`` (column-parallel ``in_proj``, its per-head output norm,
    row-parallel ``out_proj``) and the residual add. The pre-norm is a module of its own (``input_layernorm``, the
    final norm's class) on either path, as ``mamba_layer_spec``'s (TE's stock spec fuses it into ``in_proj``)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    if _te(te):
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear as column
        from megatron.core.extensions.transformer_engine import TERowParallelLinear as row
    else:
        from megatron.core.tensor_parallel import ColumnParallelLinear as column
        from megatron.core.tensor_parallel import RowParallelLinear as row
    norm = final_norm_spec(model, te)
    mixer = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(in_proj=column, out_norm=norm,
                                                                                out_proj=row))
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm, self_attention=mixer, self_attn_bda=get_bias_dropout_add))


def mla_mtp_kwargs(model: ModelSpec) -> dict:
    """Multi-latent attention (megatron-core's ``MLATransformerConfig`` fields; RoPE on the ``qk_pos_emb_head_dim``
    part at the model's ``rotary_base``: ``rope_type`` "rope", or "yarn" with its ``rotary_scaling_factor`` & co.
    when the spec's ``rope_scaling`` is YaRN, ``search.spec.rope_scaling``) and the MTP depth, with
    ``mtp_use_repeated_layer`` where its depths share one layer (empty for a model with neither)."""
    out = {"mtp_num_layers": model.mtp_num_layers} if model.mtp_num_layers else {}
    if model.mtp_use_repeated_layer:      # megatron-core 0.17 on (0.16.1: refused, patches.compat.shared_mtp_refusal)
        out["mtp_use_repeated_layer"] = True
    mla = model.mla
    if mla is None:
        return out
    out.update(multi_latent_attention=True, q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
               qk_head_dim=mla.qk_head_dim, qk_pos_emb_head_dim=mla.qk_pos_emb_head_dim, v_head_dim=mla.v_head_dim,
               rotary_base=model.rotary_base, rotary_percent=model.rotary_percent)
    out.update(runtime_kwargs(model))
    return out


def moe_kwargs(model: ModelSpec) -> dict:
    """The MoE architecture as ``TransformerConfig`` fields (empty for a dense model): experts, router, which layers
    are MoE (always as megatron-core's 0/1 list: ``first_k_dense_layers`` folded in), the pre-softmax router
    megatron-core requires for top-1 softmax routing. No aux loss at coefficient 0 (load balancing type "none").
    ``search.spec.model_rules.moe_config`` is the one translation (the model check and the export read it too): padding
    to capacity and forced balance (benchmark routing: megatron-core's random router logits) are passed as the spec
    says, as Megatron-LM passes its flags; the expert shape, dispatcher and router dtype are per stage / per plan
    (``aceso_megatron.model.moe.stage_fields``)."""
    from search.spec.model_rules import moe_config
    return moe_config(model)


def _te(te: bool | None) -> bool:
    return have_transformer_engine() if te is None else te


def gpt_layer_spec(model: ModelSpec, te: bool | None = None, layer: int | None = None,
                   grouped_gemm: bool = False) -> ModuleSpec:
    """megatron-core's full GPT layer spec for the model (TE when importable and ``te`` is not False, else local);
    decoder layer ``layer`` of an MoE model: the MoE layer spec (``MoELayer``; ``grouped_gemm``: TE's grouped
    experts, else ``SequentialMLP``) where ``model.moe`` makes it one, as ``get_gpt_decoder_layer_specs`` picks."""
    from megatron.core.models.gpt import gpt_layer_specs as g

    experts = model.moe.num_experts if (model.moe and layer is not None and _is_moe_layer(model, layer)) else None
    norm = "RMSNorm" if model.normalization == "rmsnorm" else "LayerNorm"
    # MLA: megatron-core's MLASelfAttention, its latent q/kv norms with qk_layernorm (as get_gpt_decoder_block_spec)
    mla = {"multi_latent_attention": True, "qk_layernorm": bool((model.megatron or {}).get("qk_layernorm"))} \
        if model.mla is not None else {}
    if _te(te):
        return g.get_gpt_layer_with_transformer_engine_spec(num_experts=experts,
                                                            moe_grouped_gemm=grouped_gemm and bool(experts), **mla)
    spec = g.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=grouped_gemm and bool(experts),
                                      normalization=norm, **mla)
    if mla:   # 0.16.1's local MLA core cannot be built as specified (model_specs.mla_core)
        from .mla_core import with_mla_core

        spec = with_mla_core(spec)
    return spec


def _is_moe_layer(model: ModelSpec, layer: int) -> bool:
    """Decoder layer ``layer`` is an MoE layer: its pattern symbol ``E`` in a hybrid model (one kind per layer; an
    MTP depth's layer: its pattern's ``E``), else ``moe_layer_freq`` / ``first_k_dense_layers``."""
    if model.hybrid_layer_pattern is None:
        return model.moe.is_moe_layer(layer)
    return any(u.kind == "moe" for u in model.units if u.layer == layer) or (
        layer >= model.num_layers and "E" in (mtp_layer(model) or ""))


def t5_layer_specs(model: ModelSpec, te: bool | None = None) -> tuple[ModuleSpec, ModuleSpec]:
    """megatron-core's (encoder, decoder) T5 layer specs."""
    from megatron.core.models.T5 import t5_spec

    if _te(te):
        return (t5_spec.encoder_model_with_transformer_engine_default_spec(),
                t5_spec.decoder_model_with_transformer_engine_default_spec())
    return t5_spec.encoder_model_with_local_spec(), t5_spec.decoder_model_with_local_spec()


def final_norm_spec(model: ModelSpec, te: bool | None = None):
    """The final-norm module class (local: megatron's WrappedTorchNorm; TE: TENorm)."""
    if _te(te):
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return WrappedTorchNorm


def layer_spec(model: ModelSpec, stack: str, te: bool | None = None, layer: int | None = None,
               grouped_gemm: bool = False) -> ModuleSpec:
    """The full layer spec of ``stack``: the user's (``model.layer_spec``) or megatron-core's stock one (for an
    MoE model: of decoder layer ``layer``, see ``gpt_layer_spec``)."""
    if model.layer_spec_path(stack):
        from .extensions import provided_spec

        return provided_spec(model.layer_spec_path(stack))
    if not model.is_t5:
        return gpt_layer_spec(model, te, layer, grouped_gemm)
    enc, dec = t5_layer_specs(model, te)
    return enc if stack == "encoder" else dec


def unit_spec(full: ModuleSpec, kind: UnitKind, tp_group=None) -> ModuleSpec:
    """The layer spec restricted to one unit: the submodules of the other kinds (``LayerKind.layer_parts``,
    ``search.layers``) become identities (``tp_group``: see ``bind_tp_group``)."""
    keep = layers.get(kind).layer_parts
    if not keep:
        raise ValueError(f"a {layers.get(kind).text} unit is no part of a TransformerLayer")
    changes = {}
    for k in layers.kinds():
        for name in k.layer_parts:
            if name not in keep:
                changes[name] = IdentityFuncOp if name.endswith("_bda") else IdentityOp
    return bind_tp_group(dataclasses.replace(full, submodules=dataclasses.replace(full.submodules, **changes)),
                         tp_group)


def _takes_tp_group(cls: type) -> bool:
    params = inspect.signature(cls.__init__).parameters
    return "tp_group" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def bind_tp_group(spec: ModuleSpec, tp_group) -> ModuleSpec:
    """The layer spec with ``tp_group`` bound where megatron-core's ``TransformerLayer`` does not pass it (those
    modules fall back to the global ``parallel_state`` group, which per-stage groups leave unset):
    ``CrossAttention``'s ``linear_q``/``linear_kv``, and an ``mlp`` that subclasses ``MLP`` (a user's MLP; 0.16.1's
    layer passes its TP group to ``MLP`` itself only; ``patches.compat.mlp_on_group``)."""
    from megatron.core.transformer.mlp import MLP

    if tp_group is None or not hasattr(spec.submodules, "mlp"):
        return spec
    changes = {}
    xa = spec.submodules.cross_attention
    sub = getattr(xa, "submodules", None)
    if all(isinstance(getattr(sub, n, None), type) for n in ("linear_q", "linear_kv")):
        sub = dataclasses.replace(sub, linear_q=functools.partial(sub.linear_q, tp_group=tp_group),
                                  linear_kv=functools.partial(sub.linear_kv, tp_group=tp_group))
        changes["cross_attention"] = dataclasses.replace(xa, submodules=sub)
    mlp = spec.submodules.mlp
    cls = mlp_class(mlp)
    if (isinstance(cls, type) and issubclass(cls, MLP) and cls is not MLP and cls.__name__ != "TEFusedMLP"
            and _takes_tp_group(cls)):
        if (on_group := mlp_on_group(mlp, tp_group)) is not mlp:
            changes["mlp"] = on_group
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **changes)) if changes else spec
