"""The MoE / MLA / MTP part of a Hugging Face config.json, as ``ModelSpec`` fields (``search.moe``).

Read by ``search.cli.import_hf`` for the Llama-style types that carry experts or latent attention:
mixtral (num_local_experts, num_experts_per_tok, intermediate_size = each expert's width, router_aux_loss_coef);
qwen3 / qwen3_moe (q/k norms; num_experts, num_experts_per_tok, moe_intermediate_size, decoder_sparse_step with HF's
rule "layer i is MoE when (i + 1) % step == 0", mlp_only_layers, router_aux_loss_coef); deepseek_v3 and kimi_k2
(n_routed_experts, n_shared_experts x moe_intermediate_size, first_k_dense_replace, moe_layer_freq, n_group /
topk_group, scoring_func, topk_method noaux_tc = the expert score bias, aux_loss_alpha, q_lora_rank, kv_lora_rank,
qk_nope_head_dim, qk_rope_head_dim, v_head_dim, num_nextn_predict_layers); gpt_oss (num_local_experts,
num_experts_per_tok, intermediate_size = each expert's width, head_dim, attention_bias = all linear biases;
sliding_window w = window_size [w - 1, 0] (HF's window counts the query itself: keys i-w+1..i), layer_types as
window_attn_skip_freq (sliding = windowed), the attention sinks as softmax_type learnable, quick_geglu with
glu_linear_offset 1 and swiglu_limit as activation_func_clamp_value; router_aux_loss_coef is not taken: Megatron-LM's
GPT-OSS flags train without the aux loss, --moe-router-load-balancing-type none; YaRN rope scaling is not
expressed). Routing is learned and dropless (megatron-core's defaults; force-balanced routing is a benchmark
setting a spec turns on with ``moe_router_force_load_balancing``).
"""

from __future__ import annotations

MOE_TYPES = ("mixtral", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2", "gpt_oss")
MLA_TYPES = ("deepseek_v3", "kimi_k2")


def _mixtral(c) -> dict:
    return {"moe": {"num_experts": c.int("num_local_experts"), "moe_router_topk": c.int("num_experts_per_tok"),
                    "moe_ffn_hidden_size": c.int("intermediate_size"),
                    "moe_aux_loss_coeff": c.float("router_aux_loss_coef", default=0.0)}}


def _qwen3(c, layers: int) -> dict:
    out = {"megatron": {"qk_layernorm": True}}
    if c.cfg.get("num_experts") is None:
        return out                         # dense Qwen3
    step = c.int("decoder_sparse_step", default=1)
    dense = c.cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise c._bad("mlp_only_layers", dense, "a list of layer numbers")
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    out["moe"] = {"num_experts": c.int("num_experts"), "moe_router_topk": c.int("num_experts_per_tok"),
                  "moe_ffn_hidden_size": c.int("moe_intermediate_size"),
                  "moe_layer_freq": 1 if all(pattern) else pattern,
                  "moe_aux_loss_coeff": c.float("router_aux_loss_coef", default=0.0)}
    return out


def _deepseek(c) -> dict:
    ffn = c.int("moe_intermediate_size")
    score = c.str("scoring_func", "softmax")
    if score not in ("softmax", "sigmoid"):          # megatron-core's router has these two (and no other)
        raise c._bad("scoring_func", score, "softmax or sigmoid")
    shared = c.int("n_shared_experts", default=0, required=False) if c.cfg.get("n_shared_experts") else 0
    groups = c.int("n_group", default=1)
    moe = {"num_experts": c.int("n_routed_experts"), "moe_router_topk": c.int("num_experts_per_tok"),
           "moe_ffn_hidden_size": ffn, "moe_shared_expert_intermediate_size": shared * ffn or None,
           "moe_layer_freq": c.int("moe_layer_freq", default=1),
           "first_k_dense_layers": c.int("first_k_dense_replace", default=0, required=False)
           if c.cfg.get("first_k_dense_replace") else 0,
           "moe_router_score_function": score,
           "moe_router_num_groups": groups if groups > 1 else None,
           "moe_router_group_topk": c.int("topk_group", default=1) if groups > 1 else None,
           "moe_router_enable_expert_bias": c.str("topk_method") == "noaux_tc",
           "moe_aux_loss_coeff": c.float("aux_loss_alpha", default=0.0)}
    mla = {"q_lora_rank": c.int("q_lora_rank", required=False), "kv_lora_rank": c.int("kv_lora_rank"),
           "qk_head_dim": c.int("qk_nope_head_dim"), "qk_pos_emb_head_dim": c.int("qk_rope_head_dim"),
           "v_head_dim": c.int("v_head_dim")}
    mtp = c.int("num_nextn_predict_layers", required=False) if c.cfg.get("num_nextn_predict_layers") else None
    return {"moe": {k: v for k, v in moe.items() if v is not None}, "mla": {k: v for k, v in mla.items()
            if v is not None}, "mtp_num_layers": mtp, "kv_channels": mla["v_head_dim"],
            "megatron": {"qk_layernorm": True}}


def _skip_freq(c, layers: int) -> int | list[int] | None:
    """HF ``layer_types`` (default: sliding, full, sliding, ...) as megatron-core's ``window_attn_skip_freq``:
    None when every layer slides, N when it is megatron-core's every-N-th-full rule, else a 0/1 list."""
    types = c.cfg.get("layer_types")
    if types is None:
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or \
            not set(types) <= {"sliding_attention", "full_attention"}:
        raise c._bad("layer_types", types, f"{layers} entries of sliding_attention / full_attention")
    pattern = [int(t == "sliding_attention") for t in types]
    if all(pattern):
        return None
    for n in range(2, layers + 1):
        if pattern == [int((i + 1) % n != 0) for i in range(layers)]:
            return n
    return pattern


def _gpt_oss(c, layers: int) -> dict:
    window = c.int("sliding_window", default=128)
    return {"moe": {"num_experts": c.int("num_local_experts"),
                    "moe_router_topk": c.int("num_experts_per_tok", "experts_per_token"),
                    "moe_ffn_hidden_size": c.int("intermediate_size")},
            "activation": "quick_geglu", "glu_linear_offset": 1.0,
            "activation_func_clamp_value": c.float("swiglu_limit", default=7.0),
            "softmax_type": "learnable", "window_size": [window - 1, 0],
            "window_attn_skip_freq": _skip_freq(c, layers)}


def moe_fields(c, mtype: str, layers: int) -> dict:
    """The spec fields ``mtype``'s experts, latent attention and MTP set (``c``: import_hf's typed reader)."""
    if mtype == "mixtral":
        return _mixtral(c)
    if mtype in ("qwen3", "qwen3_moe"):
        return _qwen3(c, layers)
    if mtype in MLA_TYPES:
        return _deepseek(c)
    if mtype == "gpt_oss":
        return _gpt_oss(c, layers)
    return {}
