"""The MoE / MLA / MTP part of a Hugging Face config.json, as ``ModelSpec`` fields (``search.layers.moe_spec``).

Read by ``search.cli.import_hf`` for the Llama-style types that carry experts or latent attention (the attention,
norms and RoPE are ``search.spec.hf_arch``'s):
mixtral (num_local_experts, num_experts_per_tok, intermediate_size = each expert's width, router_aux_loss_coef
(default 0.001, ``HF_AUX_LOSS_COEF``); router_jitter_noise must be 0); qwen3_moe (num_experts, num_experts_per_tok,
moe_intermediate_size, decoder_sparse_step with HF's rule "layer i is MoE when (i + 1) % step == 0", mlp_only_layers,
router_aux_loss_coef default 0.001);
qwen2_moe (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B: qwen3_moe's fields, and every MoE layer's shared expert of
shared_expert_intermediate_size with its sigmoid gate shared_expert_gate as moe_shared_expert_gate; router_aux_loss_coef
default 0.001 and norm_topk_prob default false, as Qwen2MoeConfig);
deepseek_v3 and kimi_k2 (n_routed_experts, n_shared_experts x moe_intermediate_size, first_k_dense_replace,
moe_layer_freq, n_group / topk_group, scoring_func softmax | sigmoid, topk_method greedy | noaux_tc (= the expert
score bias), aux_loss_alpha, routed_scaling_factor as megatron.moe_router_topk_scaling_factor, q_lora_rank,
kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, num_nextn_predict_layers; seq_aux true,
the sequence-wise balance loss, as moe_router_load_balancing_type seq_aux_loss); glm4_moe (GLM-4.5: n_routed_experts,
n_shared_experts, moe_intermediate_size, first_k_dense_replace, n_group / topk_group, its sigmoid router with the
score-correction bias, routed_scaling_factor, num_nextn_predict_layers); gpt_oss (num_local_experts,
num_experts_per_tok, intermediate_size = each expert's width, head_dim, attention_bias = all linear biases;
layer_types as window_attn_skip_freq (sliding = windowed, default alternate), the attention sinks as softmax_type
learnable, quick_geglu with glu_linear_offset 1 and swiglu_limit as activation_func_clamp_value;
router_aux_loss_coef is not taken: Megatron-LM's GPT-OSS flags train without the aux loss,
--moe-router-load-balancing-type none).

Routing: HF ``norm_topk_prob`` true renormalizes the top-k weights (megatron-core's default: a softmax over the
top-k, a normalized sigmoid); false on a softmax router (softmax over all experts, then the top-k: Qwen3-MoE, whose
default is false, and DeepSeek's softmax scoring) is megatron-core's ``moe_router_pre_softmax``; false on a sigmoid
router (megatron-core renormalizes its top-k), an unknown ``scoring_func`` or ``topk_method`` and DeepSeek-V2's
group_limited_greedy (its group score is the group's best, megatron-core's the sum of its top scores) are refused
with one line. Mixtral and GPT-OSS have no such key (softmax over the top-k logits: megatron-core's default).
Routing is learned and dropless (megatron-core's defaults; force-balanced
routing is a benchmark setting a spec turns on with ``moe_router_force_load_balancing``).
"""

from __future__ import annotations

from search.spec.hf_arch import layer_types, skip_freq

MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2", "glm4_moe", "gpt_oss")
MLA_TYPES = ("deepseek_v3", "kimi_k2")


def _router(c, default: bool, score: str = "softmax") -> dict:
    """The router's top-k weights: HF ``norm_topk_prob`` true renormalizes them (megatron-core's default router);
    false keeps them as they are, which a softmax router (softmax over all experts, then the top-k: HF Qwen3-MoE,
    DeepSeek's softmax scoring) runs as megatron-core's ``moe_router_pre_softmax``. megatron-core's sigmoid router
    renormalizes above top-1 whatever ``moe_router_pre_softmax`` says (``topk_routing_with_score_function``), so a
    sigmoid router that does not is refused. ``default``: the model type's default when the key is absent."""
    if c.bool("norm_topk_prob", default):
        return {}
    if score == "softmax":
        return {"moe_router_pre_softmax": True}
    raise c.refuse("norm_topk_prob", "HF keeps the sigmoid router's top-k weights unnormalized; megatron-core's "
                   "sigmoid router renormalizes them (set norm_topk_prob true)",
                   shown=None if c.has("norm_topk_prob") else f"(absent: the model's default {str(default).lower()})")


# transformers' MixtralConfig, Qwen2MoeConfig and Qwen3MoeConfig: router_aux_loss_coef = 0.001 when the key is absent
# (configuration_mixtral.py / configuration_qwen2_moe.py / configuration_qwen3_moe.py). Glm4MoeConfig and
# DeepseekV3Config have no such key (their aux loss is not trained by transformers): 0.0 there.
HF_AUX_LOSS_COEF = 0.001


def topk_scaling(c) -> dict:
    factor = c.float("routed_scaling_factor", default=1.0)
    if not factor > 0:
        raise c.bad("routed_scaling_factor", factor, "a positive number")
    return {} if factor == 1.0 else {"moe_router_topk_scaling_factor": factor}


def _mixtral(c) -> dict:
    c.expect("router_jitter_noise", lambda v: v == 0, "noise on the router's input is not in megatron-core 0.16.1's "
             "router")
    return {"moe": {"num_experts": c.int("num_local_experts"), "moe_router_topk": c.int("num_experts_per_tok"),
                    "moe_ffn_hidden_size": c.int("intermediate_size"),
                    "moe_aux_loss_coeff": c.float("router_aux_loss_coef", default=HF_AUX_LOSS_COEF)}}


def _qwen3(c, layers: int) -> dict:
    if c.raw("num_experts") is None:
        return {}                         # dense Qwen3
    step = c.int("decoder_sparse_step", default=1)
    dense = c.raw("mlp_only_layers", [])
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers
                                              for i in dense):
        raise c.bad("mlp_only_layers", dense, f"a list of layer numbers in [0, {layers})")
    router = _router(c, False)            # Qwen3MoeConfig's default is false
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    if not any(pattern):                  # every layer dense: HF builds a dense model
        c.ignore("num_experts", "num_experts_per_tok", "moe_intermediate_size", "router_aux_loss_coef",
                 "shared_expert_intermediate_size")
        return {}
    return {"moe": {"num_experts": c.int("num_experts"), "moe_router_topk": c.int("num_experts_per_tok"),
                    "moe_ffn_hidden_size": c.int("moe_intermediate_size"),
                    "moe_layer_freq": 1 if all(pattern) else pattern,
                    "moe_aux_loss_coeff": c.float("router_aux_loss_coef", default=HF_AUX_LOSS_COEF), **router}}


def _qwen2_moe(c, layers: int) -> dict:
    """Qwen2-MoE (``Qwen2MoeSparseMoeBlock``): Qwen3-MoE's routed experts and layer rule, and in every MoE layer a
    shared expert (an MLP of ``shared_expert_intermediate_size``) scaled by ``sigmoid(shared_expert_gate(x))``, a
    ``hidden -> 1`` linear without bias: megatron-core's ``moe_shared_expert_gate`` (``SharedExpertMLP``:
    ``output * sigmoid(linear(x, gate_weight))``, gate_weight 1 x h)."""
    c.int("num_experts")                            # required: an absent key is Qwen2MoeConfig's 60, not dense
    out = _qwen3(c, layers)
    if out:
        out["moe"].update(moe_shared_expert_intermediate_size=c.int("shared_expert_intermediate_size"),
                          moe_shared_expert_gate=True)
    return out


def _shared_and_dense(c) -> dict:
    """Routed experts, the shared expert(s) and the first dense layers (DeepSeek-V3, Kimi-K2, GLM-4.5)."""
    ffn = c.int("moe_intermediate_size")
    shared = c.int("n_shared_experts", default=0, required=False, minimum=0)
    return {"num_experts": c.int("n_routed_experts"), "moe_router_topk": c.int("num_experts_per_tok"),
            "moe_ffn_hidden_size": ffn, "moe_shared_expert_intermediate_size": shared * ffn or None,
            "first_k_dense_layers": c.int("first_k_dense_replace", default=0, required=False, minimum=0)}


def _groups(c, limited: bool) -> dict:
    groups = c.int("n_group", default=1)
    topk = c.int("topk_group", default=1)
    if not limited or groups == 1:
        return {}
    return {"moe_router_num_groups": groups, "moe_router_group_topk": topk}


def _mtp(c) -> int | None:
    return c.int("num_nextn_predict_layers", default=0, required=False, minimum=0) or None


def _deepseek(c) -> dict:
    # transformers' DeepseekV3 router is sigmoid with the score-correction bias (noaux_tc): the defaults when absent
    score = c.choice("scoring_func", ("softmax", "sigmoid"), "sigmoid")
    method = c.choice("topk_method", ("greedy", "group_limited_greedy", "noaux_tc"), "noaux_tc")
    if method == "group_limited_greedy":
        raise c.refuse("topk_method", "DeepSeek-V2's group score is the group's best expert, megatron-core's "
                       "group-limited routing sums the group's top scores")
    moe = {**_shared_and_dense(c), "moe_layer_freq": c.int("moe_layer_freq", default=1),
           "moe_router_score_function": score, **_router(c, True, score), **_groups(c, method == "noaux_tc"),
           "moe_router_enable_expert_bias": method == "noaux_tc",
           "moe_aux_loss_coeff": c.float("aux_loss_alpha", default=0.0),
           # transformers' DeepseekV3 config: seq_aux true = the sequence-wise balance loss (megatron-core's
           # seq_aux_loss, which Megatron-Bridge's DeepSeek providers set); false = the batch-wise aux_loss
           "moe_router_load_balancing_type": "seq_aux_loss" if c.bool("seq_aux", False) else "aux_loss"}
    mla = {"q_lora_rank": c.int("q_lora_rank", required=False), "kv_lora_rank": c.int("kv_lora_rank"),
           "qk_head_dim": c.int("qk_nope_head_dim"), "qk_pos_emb_head_dim": c.int("qk_rope_head_dim"),
           "v_head_dim": c.int("v_head_dim")}
    return {"moe": moe, "mla": {k: v for k, v in mla.items() if v is not None}, "mtp_num_layers": _mtp(c),
            "kv_channels": mla["v_head_dim"], "megatron": topk_scaling(c)}


def _glm4_moe(c) -> dict:
    """GLM-4.5's router (``Glm4MoeTopkRouter``): sigmoid scores, the score-correction bias in the top-k choice,
    group-limited when n_group > 1, renormalized and scaled by routed_scaling_factor."""
    c.choice("topk_method", ("noaux_tc",), "noaux_tc")
    c.ignore("moe_router_dtype")          # the router's compute dtype (numerics, not the architecture)
    moe = {**_shared_and_dense(c), "moe_router_score_function": "sigmoid", **_router(c, True, "sigmoid"),
           **_groups(c, True),
           "moe_router_enable_expert_bias": True,
           "moe_aux_loss_coeff": c.float("router_aux_loss_coef", default=0.0)}
    return {"moe": moe, "mtp_num_layers": _mtp(c), "megatron": topk_scaling(c)}


def _gpt_oss(c, layers: int) -> dict:
    window = c.int("sliding_window", default=128)
    c.ignore("router_aux_loss_coef", "initial_context_length")   # see the module docstring; YaRN's original length
    types = layer_types(c, layers, ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])
    return {"moe": {"num_experts": c.int("num_local_experts"),
                    "moe_router_topk": c.int("num_experts_per_tok", "experts_per_token"),
                    "moe_ffn_hidden_size": c.int("intermediate_size")},
            "activation": "quick_geglu", "glu_linear_offset": 1.0,
            "activation_func_clamp_value": c.float("swiglu_limit", default=7.0),
            "softmax_type": "learnable",
            **({"window_size": [window - 1, 0], "window_attn_skip_freq": skip_freq(types)}
               if "sliding_attention" in types else {})}


def moe_fields(c, mtype: str, layers: int) -> dict:
    """The spec fields ``mtype``'s experts, latent attention and MTP set (``c``: a ``search.spec.hf_config.HFConfig``);
    a ``megatron`` entry holds the block fields to merge."""
    if mtype == "mixtral":
        return _mixtral(c)
    if mtype in ("qwen3", "qwen3_moe"):
        return _qwen3(c, layers)
    if mtype == "qwen2_moe":
        return _qwen2_moe(c, layers)
    if mtype in MLA_TYPES:
        return _deepseek(c)
    if mtype == "glm4_moe":
        return _glm4_moe(c)
    if mtype == "gpt_oss":
        return _gpt_oss(c, layers)
    return {}
