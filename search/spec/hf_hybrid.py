"""A Hugging Face ``nemotron_h`` config.json (Nemotron-H, Nemotron-3) as a hybrid ``ModelSpec``'s fields.

Read as transformers' ``NemotronHConfig`` (models/nemotron_h/configuration_nemotron_h.py) defines them: the layers
as ``hybrid_override_pattern`` (``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` MoE) or ``layers_block_type``
(linear_attention / full_attention / mlp / moe, and the older mamba / attention names), the Mamba-2 mixer
(``ssm_state_size``, ``mamba_num_heads``, ``mamba_head_dim``, ``n_groups``, ``conv_kernel``, ``expand``,
``chunk_size``, with the ``mamba_*`` spellings of older configs), squared-ReLU MLPs and experts (``relu2``), RMSNorm,
no position embedding, the sigmoid router with its score-correction bias and top-k scaling factor
(``routed_scaling_factor``: ``megatron.moe_router_topk_scaling_factor``), LatentMoE (``moe_latent_size``: Nemotron-3
Super, Ultra) and MTP depths (``num_nextn_predict_layers`` of ``mtp_hybrid_override_pattern`` /
``mtp_layers_block_type``: the MTP blocks the checkpoint stores, one each; Megatron-Bridge's Super recipe runs its one
block at 2 depths with ``mtp_use_repeated_layer``, a training choice the preset nemotron-3-super holds). What megatron-core's ``HybridModel`` cannot build or
aceso does not model is refused in one line naming the field: biases, another MLP or Mamba activation, a sliding
window, more than one shared expert. Initialisation and inference fields
(``time_step_*``, ``rescale_prenorm_residual``, ``use_mamba_kernels``, ``mamba_ssm_cache_dtype``, ...) are read and
not used: they do not change the trained architecture or its cost.
"""

from __future__ import annotations

from search.io.errors import AcesoError
from search.spec.hf_arch import NORM_EPSILON
from search.spec.hf_moe import topk_scaling

_BLOCKS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}
_IGNORED = ("time_step_min", "time_step_max", "time_step_limit", "time_step_floor", "mamba_dt_min", "mamba_dt_max",
            "mamba_dt_limit", "mamba_dt_init_floor", "rescale_prenorm_residual", "residual_in_fp32",
            "use_mamba_kernels", "mamba_ssm_cache_dtype", "num_logits_to_keep", "norm_topk_prob",
            "moe_shared_expert_overlap", "hidden_dropout", "attention_dropout")


def _pattern(c, key_str: str, key_list: str, required: bool = True) -> str | None:
    """A layer pattern from its string or its list spelling."""
    text = c.raw(key_str)
    if text is not None:
        if not isinstance(text, str) or any(ch not in "M*-E" for ch in text):
            raise c.bad(key_str, text, "a string of M, *, - and E")
        return text
    blocks = c.raw(key_list)
    if blocks is None:
        if required:
            raise AcesoError(f"{c.source}: field {key_str} (or {key_list}) is missing; this does not look like a "
                             "complete nemotron_h config.json")
        return None
    if not isinstance(blocks, list) or any(b not in _BLOCKS for b in blocks):
        raise c.bad(key_list, blocks, f"a list of {', '.join(sorted(set(_BLOCKS)))}")
    return "".join(_BLOCKS[b] for b in blocks)


def nemotron_h_fields(c, seq_length: int) -> dict:
    """The ``ModelSpec`` fields of a ``nemotron_h`` config (``c``: ``search.spec.hf_config.HFConfig``)."""
    pattern = _pattern(c, "hybrid_override_pattern", "layers_block_type")
    layers = c.int("num_hidden_layers", default=len(pattern))
    if layers != len(pattern):
        raise c.refuse("num_hidden_layers", f"the layer pattern has {len(pattern)} layers; they must agree")
    for key in ("use_bias", "mlp_bias", "attention_bias", "mamba_proj_bias"):
        c.expect(key, lambda v: v is False, "biases are not modelled for hybrid models (megatron-core's Nemotron "
                                            "runs have none); set it false")
    c.expect("use_conv_bias", lambda v: v is True, "megatron-core's Mamba conv1d always has a bias")
    c.expect("mlp_hidden_act", lambda v: v == "relu2", "megatron-core's Nemotron MLP is squared ReLU (relu2)")
    c.expect("mamba_hidden_act", lambda v: v == "silu", "megatron-core's Mamba mixer uses silu")
    c.expect("sliding_window", lambda v: False, "sliding-window attention in a hybrid model is not modelled")
    c.ignore(*_IGNORED)
    heads = c.int("num_attention_heads")
    # transformers' NemotronHConfig says head_dim; the remote-code one of the published Nemotron-H checkpoints
    # (nvidia/Nemotron-H-8B-Base-8K) says attention_head_dim
    head_dim = c.int("head_dim", "attention_head_dim")
    if c.raw("attention_head_dim") not in (None, head_dim):
        raise c.refuse("attention_head_dim", f"head_dim is {head_dim}; the two spellings of the head size must agree")
    data = dict(family="gpt", num_layers=layers, hidden_size=c.int("hidden_size"), num_attention_heads=heads,
                num_query_groups=c.int("num_key_value_heads", default=heads), kv_channels=head_dim,
                ffn_hidden_size=c.int("intermediate_size"), seq_length=seq_length, vocab_size=c.int("vocab_size"),
                activation="squared_relu", normalization="rmsnorm", position_embedding="none",
                tied_embeddings=c.bool("tie_word_embeddings", False), add_bias_linear=False,
                megatron=_epsilon(c.float("layer_norm_epsilon", "rms_norm_eps", default=NORM_EPSILON)))
    data["mamba"] = {"mamba_state_dim": c.int("ssm_state_size"), "mamba_head_dim": c.int("mamba_head_dim"),
                     "mamba_num_groups": c.int("n_groups", "mamba_n_groups"),
                     "mamba_num_heads": c.int("mamba_num_heads"), "expand": c.int("expand", "mamba_expand", default=2),
                     "d_conv": c.int("conv_kernel", "mamba_d_conv", default=4),
                     "chunk_size": c.int("chunk_size", "mamba_chunk_size", default=128)}
    mtp_depths = c.int("num_nextn_predict_layers", default=0, minimum=0)
    mtp = _pattern(c, "mtp_hybrid_override_pattern", "mtp_layers_block_type", required=False) or "*E"
    used = pattern + (mtp if mtp_depths else "")
    if "E" in used:
        shared = c.int("n_shared_experts", default=1, minimum=0)
        if shared > 1:
            raise c.refuse("n_shared_experts", "one shared expert of moe_shared_expert_intermediate_size is modelled")
        data["moe"] = {"num_experts": c.int("n_routed_experts", "num_local_experts"),
                       "moe_router_topk": c.int("num_experts_per_tok"),
                       "moe_ffn_hidden_size": c.int("moe_intermediate_size"),
                       "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                       "moe_router_num_groups": c.int("n_group", default=1),
                       "moe_router_group_topk": c.int("topk_group", default=1)}
        if shared:
            data["moe"]["moe_shared_expert_intermediate_size"] = c.int("moe_shared_expert_intermediate_size")
        latent = c.int("moe_latent_size", required=False)
        if latent is not None:
            data["moe"]["moe_latent_size"] = latent
        if scaling := topk_scaling(c):          # routed_scaling_factor (numerics only: scales the expert weights)
            data["megatron"] = {**(data["megatron"] or {}), **scaling}
    else:
        c.ignore("n_routed_experts", "moe_latent_size", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                 "moe_shared_expert_intermediate_size", "n_group", "topk_group", "routed_scaling_factor")
    data["hybrid_layer_pattern"] = pattern + ("/" + mtp) * mtp_depths
    if mtp_depths:
        data["mtp_num_layers"] = mtp_depths
    return data


def _epsilon(eps: float) -> dict | None:
    """``megatron.layernorm_epsilon`` when not megatron-core's default (as ``hf_arch`` and a command line's import)."""
    return {"layernorm_epsilon": eps} if eps != NORM_EPSILON else None
