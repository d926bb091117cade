"""A hybrid architecture record (``search.layers.hybrid.HybridArch``, ``model_specs/hybrid/*.json``) as a model spec:
``model_spec_data`` (the preset ``model_specs/presets/{name}.json`` made from it) and ``counts`` (its parameters,
module by module; the formulas are in ``search.layers.hybrid``'s docstring).
"""

from __future__ import annotations

from typing import NamedTuple

from search.layers.hybrid import HybridArch, symbol_name
from search.layers.mamba import params as mamba_params
from search.layers.moe_params import layer_mlp_params
from search.spec.hf_arch import NORM_EPSILON      # megatron-core's TransformerConfig.layernorm_epsilon default
from search.spec.model import ModelSpec

_MOE_FIELDS = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
               "moe_latent_size", "moe_router_score_function", "moe_router_enable_expert_bias", "moe_aux_loss_coeff",
               "moe_router_load_balancing_type", "moe_router_num_groups", "moe_router_group_topk")
PRESET_NOTE = ("made from model_specs/hybrid/{name}.json (each field's source there) by "
               "search.spec.hybrid_arch.model_spec_data")


def model_spec_data(a: HybridArch) -> dict:
    """``a`` as a ``ModelSpec`` mapping (a preset, ``model_specs/presets/{name}.json``): the pattern with its MTP
    depths, the Mamba-2 block, the MoE fields ``MoESpec`` holds and the router's top-k scaling factor as the
    ``megatron`` block's ``moe_router_topk_scaling_factor`` (numerics only: it scales the routed experts' weights,
    HF's ``routed_scaling_factor``), with the init std and the MTP loss weight where the record states them. Left out: the router's fp32 dtype (the 26.x containers' value is in the record)."""
    out = {"name": a.name, "family": "gpt", "num_layers": a.num_layers, "hidden_size": a.hidden_size,
           "num_attention_heads": a.num_attention_heads, "num_query_groups": a.num_query_groups,
           "kv_channels": a.kv_channels, "ffn_hidden_size": a.ffn_hidden_size, "seq_length": a.seq_length,
           "vocab_size": a.vocab_size, "make_vocab_size_divisible_by": a.make_vocab_size_divisible_by,
           "activation": a.activation, "normalization": a.normalization.lower(),
           "position_embedding": {"learned_absolute": "learned"}.get(a.position_embedding_type,
                                                                       a.position_embedding_type),
           "tied_embeddings": not a.untie_embeddings_and_output_weights, "add_bias_linear": a.add_bias_linear,
           "params_dtype": "bf16", "nominal_params_b": a.published["total_params"] / 1e9}
    block = {"layernorm_epsilon": a.layernorm_epsilon} if a.layernorm_epsilon != NORM_EPSILON else {}
    #                                             megatron-core's default is left out, as a command line's import does
    if a.moe is not None and a.moe.moe_router_topk_scaling_factor not in (None, 1.0):
        block["moe_router_topk_scaling_factor"] = a.moe.moe_router_topk_scaling_factor
    block.update({k: getattr(a, k) for k in ("init_method_std", "mtp_loss_scaling_factor") if getattr(a, k) is not None})
    if block:
        out["megatron"] = block
    if a.moe is not None:
        out["moe"] = {k: getattr(a.moe, k) for k in _MOE_FIELDS if getattr(a.moe, k) is not None}
    if a.mtp_num_layers:
        out["mtp_num_layers"] = a.mtp_num_layers
        if a.mtp_use_repeated_layer:
            out["mtp_use_repeated_layer"] = True
    out["hybrid_layer_pattern"] = a.full_pattern
    out["mamba"] = a.mamba.model_dump()
    return out


# ----- parameter counts ------------------------------------------------------------------------------------------
def _proxy(a: HybridArch):
    """A ``ModelSpec`` with the attention, MLP and MoE shapes of ``a`` (squared ReLU counts as the ungated gelu)."""
    moe = None
    if a.moe is not None:
        moe = {"num_experts": a.moe.num_experts, "moe_router_topk": a.moe.moe_router_topk,
               "moe_ffn_hidden_size": a.moe.moe_ffn_hidden_size,
               "moe_shared_expert_intermediate_size": a.moe.moe_shared_expert_intermediate_size,
               "moe_latent_size": a.moe.moe_latent_size}
    return ModelSpec(name=a.name, family="llama", num_layers=1, hidden_size=a.hidden_size,
                     num_attention_heads=a.num_attention_heads, num_query_groups=a.num_query_groups,
                     kv_channels=a.kv_channels, ffn_hidden_size=a.ffn_hidden_size, seq_length=a.seq_length,
                     vocab_size=a.vocab_size, make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
                     activation="swiglu" if a.activation == "swiglu" else "gelu",
                     normalization="rmsnorm" if a.normalization == "RMSNorm" else "layernorm",
                     position_embedding="learned" if a.position_embedding_type == "learned_absolute" else "rope",
                     tied_embeddings=not a.untie_embeddings_and_output_weights, add_bias_linear=a.add_bias_linear,
                     moe=moe)


class HybridCounts(NamedTuple):
    total: int            # main model + the MTP block(s) stored
    active: int           # per token (routed experts not taken excluded), embedding and output included, no MTP
    mtp: int              # inside total
    by_kind: dict         # layer kind -> parameters of all such layers of the main pattern
    embedding: int        # input embedding
    output: int           # final norm + untied output layer


def _layer(a: HybridArch, m, symbol: str) -> tuple[int, int]:
    kind = symbol_name(symbol)
    if kind == "mamba":
        n = mamba_params(a.mamba, a.hidden_size, layernorm=a.normalization == "LayerNorm").total
        return n, n
    if kind == "attention":
        n = m.unit_params("attention")
        return n, n
    if kind == "mlp":
        n = m.unit_params("mlp")
        return n, n
    if kind == "moe":
        return layer_mlp_params(m, 0)
    raise ValueError(f"hybrid counts: layer kind {kind} ('{symbol}') is not counted yet")


def counts(a: HybridArch) -> HybridCounts:
    m = _proxy(a)
    by_kind: dict[str, int] = {}
    total = active = 0
    for symbol in a.hybrid_layer_pattern:
        tot, act = _layer(a, m, symbol)
        by_kind[symbol_name(symbol)] = by_kind.get(symbol_name(symbol), 0) + tot
        total, active = total + tot, active + act
    mtp = 0
    if a.mtp_num_layers:
        own = 3 * m._norm_params() + 2 * a.hidden_size * a.hidden_size
        block = own + sum(_layer(a, m, s)[0] for s in a.mtp_pattern)
        mtp = block * (1 if a.mtp_use_repeated_layer else a.mtp_num_layers)
    embedding, output = m.embedding_params(), m.output_params()
    return HybridCounts(total + mtp + embedding + output, active + embedding + output, mtp, by_kind, embedding,
                        output)
