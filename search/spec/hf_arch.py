"""The attention, normalization and position fields a Llama-style Hugging Face ``config.json`` sets, as ``ModelSpec``
fields in megatron-core 0.16.1's terms (``search.cli.import_hf`` calls ``llama_style``; the experts, MLA and MTP
are ``search.spec.hf_moe``'s).

Each field is kept (and then priced and exported), or refused naming it:

- biases: what HF's ``attention_bias`` covers depends on the model (``BIAS``): q/k/v only (Qwen2 always, Qwen2-MoE's
  ``qkv_bias`` (default true), GLM-4.5) is megatron-core's ``add_qkv_bias`` (``megatron.add_qkv_bias``); every
  linear (GPT-OSS; Llama with ``mlp_bias`` too) is ``add_bias_linear``; q/k/v and the output projection but no MLP
  bias has no megatron-core setting;
- QK norms: Qwen3's per-head RMSNorm and GLM-4.5's ``use_qk_norm`` are ``megatron.qk_layernorm``;
- ``head_dim`` is ``kv_channels`` (Qwen3-30B-A3B: 128 with hidden 2048 / 32 heads), ``partial_rotary_factor``
  ``rotary_percent``, ``rms_norm_eps`` ``megatron.layernorm_epsilon`` (when not megatron-core's 1e-5),
  ``rope_theta`` ``rotary_base``;
- ``rope_scaling`` (or transformers 5's ``rope_parameters``): llama3 with megatron-core's fixed band (low 1, high 4,
  original 8192) and yarn (``search.spec.rope_scaling``: MLA's ``rope_type`` yarn, or standard attention's
  ``position_embedding_type`` yarn, GPT-OSS's, with ``truncate`` false as ``correction_range_round_to_int`` false);
  any other type or band is refused, and so is a YaRN megatron-core would compute otherwise than transformers'
  ``_compute_yarn_parameters`` (partial rotary; MLA with truncate false or mscale_all_dim without mscale);
- sliding windows: ``layer_types`` when given, else each family's rule (Mistral / Mixtral: ``sliding_window`` on
  every layer; Qwen2 / Qwen3: with ``use_sliding_window``, the layers from ``max_window_layers`` on; GPT-OSS:
  alternate layers; Qwen2-MoE: ``layer_types`` only, its ``use_sliding_window`` refused: transformers' releases
  differ on which layers slide); a window of ``w`` keys (HF counts the query itself) is ``window_size``
  ``[w - 1, 0]``.
"""

from __future__ import annotations

from search.io.errors import AcesoError
from search.spec.hf_config import HFConfig
from search.spec.rope_scaling import LLAMA3_BAND, YARN_DEFAULTS, yarn

NORM_EPSILON = 1e-5                    # megatron-core TransformerConfig.layernorm_epsilon
# what "attention_bias": true biases, per model_type (HF's modeling files); absent: the model has no such key
BIAS = {"llama": "qkvo", "qwen3": "qkvo", "qwen3_moe": "qkvo", "deepseek_v3": "mla", "kimi_k2": "mla",
        "glm4_moe": "qkv", "gpt_oss": "all"}
QKV_BIAS_ALWAYS = ("qwen2",)           # Qwen2's q/k/v projections carry a bias, no config key
QKV_BIAS_KEY = ("qwen2_moe",)          # Qwen2-MoE's: qkv_bias (Qwen2MoeConfig, default true; older configs lack it)
QK_NORM_ALWAYS = ("qwen3", "qwen3_moe")
WINDOW_EVERY_LAYER = ("mistral", "mixtral")
WINDOW_FROM_LAYER = ("qwen2", "qwen3", "qwen3_moe")     # use_sliding_window + max_window_layers
_ROPE_TYPES = ("default", "llama3", "yarn")


def llama_style(c, mtype: str, layers: int, mla: bool) -> dict:
    """``ModelSpec`` fields of a Llama-style config ``c`` (``search.spec.hf_config.HFConfig``) of ``mtype``."""
    act = c.str("hidden_act", "silu")
    if act != "silu" and mtype != "gpt_oss":
        raise c.refuse("hidden_act", "aceso's import reads the SwiGLU MLP (silu) of Llama-style models only")
    c.expect("mlp_bias", lambda v: v is False or (v is True and c.cfg.get("attention_bias") is True),
             "an MLP bias without the attention's has no megatron-core setting (add_bias_linear biases every linear)")
    out: dict = {"add_bias_linear": False}
    block: dict = {}
    if mtype in QKV_BIAS_ALWAYS or (mtype in QKV_BIAS_KEY and c.bool("qkv_bias", True)):
        block["add_qkv_bias"] = True
    if c.bool("attention_bias", False):
        kind = BIAS.get(mtype)
        if kind == "qkv":
            block["add_qkv_bias"] = True
        elif kind == "all" or (kind == "qkvo" and c.bool("mlp_bias", False)):
            out["add_bias_linear"] = True
        else:
            raise c.refuse("attention_bias", "HF biases the q, k, v and output projections of this model; "
                           "megatron-core has add_qkv_bias (q, k, v) or add_bias_linear (every linear, the MLP's "
                           "too), not that")
    if mtype in QK_NORM_ALWAYS or c.bool("use_qk_norm", False) or mla:
        block["qk_layernorm"] = True
    eps = c.float("rms_norm_eps", default=NORM_EPSILON)
    if not 0 < eps < 1:
        raise c.bad("rms_norm_eps", eps, "a small positive number (below 1)")
    if eps != NORM_EPSILON:
        block["layernorm_epsilon"] = eps
    base, scaling = rope(c, mla)
    out.update(rotary_base=base, rope_scaling=scaling, megatron=block or None)
    percent = c.float("partial_rotary_factor", default=1.0)
    if not 0 < percent <= 1:
        raise c.bad("partial_rotary_factor", percent, "a fraction in (0, 1]")
    if percent != 1.0:
        out["rotary_percent"] = percent
    if mtype != "gpt_oss":           # GPT-OSS's window is search.spec.hf_moe's (its own defaults)
        out.update(window(c, mtype, layers))
    c.expect("use_mrope", lambda v: v is False, "multimodal RoPE (Qwen2-VL's) is not a megatron-core GPT model's")
    return out


def rope(c, mla: bool) -> tuple[float, dict | None]:
    """``(rotary_base, rope_scaling)``: ``rope_theta`` and ``rope_scaling``, or transformers 5's ``rope_parameters``."""
    params = c.dict("rope_parameters")
    base = c.float("rope_theta", default=10000.0)
    scaling, key = c.dict("rope_scaling"), "rope_scaling"
    if params is not None:
        if "rope_theta" in params:
            base = HFConfig(params, c.source, f"{c.prefix}rope_parameters.").float("rope_theta", default=base)
        if scaling is None:
            scaling, key = {k: v for k, v in params.items() if k != "rope_theta"}, "rope_parameters"
    if not base > 0:
        raise c.bad("rope_theta", base, "a positive number")
    if not scaling:
        return base, None
    sub = HFConfig(scaling, c.source, f"{c.prefix}{key}.")
    kind = sub.str("rope_type") or sub.str("type") or "default"
    if kind not in _ROPE_TYPES:
        raise sub.refuse("rope_type" if "rope_type" in scaling else "type",
                         "megatron-core scales RoPE as Llama 3.1 does (llama3) or with YaRN (yarn), not "
                         f"{kind}; the model is not supported")
    if kind == "default":
        sub.check_all_read("default RoPE")
        return base, None
    factor = sub.float("factor", default=0.0)
    if not factor > 0:
        raise sub.bad("factor", scaling.get("factor"), "a positive number")
    if kind == "llama3":
        for name, want in LLAMA3_BAND.items():
            got = sub.float(name, default=want)
            if got != want:
                raise sub.refuse(name, f"megatron-core 0.16.1's llama3 RoPE scaling fixes it at {want:g} (Llama 3.1's "
                                 "band); this model's scaling is not expressible")
        if mla:
            raise c.refuse(key, "llama3 RoPE scaling with multi-latent attention: megatron-core applies it to standard "
                           "attention only", shown="(type llama3)")
        sub.check_all_read("llama3 RoPE scaling")
        return base, {"type": "llama3", "factor": factor}
    return base, _yarn(c, sub, key, factor, mla)


def _yarn(c, sub, key: str, factor: float, mla: bool) -> dict:
    """HF's YaRN (transformers ``_compute_yarn_parameters``) as megatron-core's: the correction range from
    ``original_max_position_embeddings`` (else the config's ``max_position_embeddings``), ``beta_fast`` / ``beta_slow``
    (32 / 1 where unset or 0), rounded unless ``truncate`` is false; the attention factor
    ``get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)`` when both are set (non-zero), else
    ``get_mscale(factor)``, which is megatron-core's with mscale 1 and mscale_all_dim 0."""
    default_len = c.int("max_position_embeddings", required=False) or YARN_DEFAULTS["original_max_position_embeddings"]
    fields = {"original_max_position_embeddings": sub.int("original_max_position_embeddings", default=default_len)}
    fields.update({k: sub.float(k, default=YARN_DEFAULTS[k]) or YARN_DEFAULTS[k] for k in ("beta_fast", "beta_slow")})
    mscale, all_dim = sub.float("mscale", default=0.0), sub.float("mscale_all_dim", default=0.0)
    if mscale and all_dim:
        fields.update(mscale=mscale, mscale_all_dim=all_dim)
    elif mla and all_dim:       # MLA's softmax scale reads mscale_all_dim, HF's attention factor then ignores it
        raise sub.refuse("mscale_all_dim", "without mscale, HF's YaRN attention factor is get_mscale(factor) while "
                         "multi-latent attention's softmax scale uses mscale_all_dim; megatron-core takes both from "
                         "the same two fields; the model is not expressible", shown=f"({all_dim:g}, no mscale)")
    else:                       # HF: get_mscale(factor) = megatron-core's defaults (mscale 1, mscale_all_dim 0)
        fields.update(mscale=YARN_DEFAULTS["mscale"], mscale_all_dim=YARN_DEFAULTS["mscale_all_dim"])
    truncate = sub.bool("truncate", True)
    if mla and not truncate:
        raise sub.refuse("truncate", "multi-latent attention's YarnRotaryEmbedding always rounds the correction "
                         "range (truncate true); the model is not expressible")
    if not truncate:
        fields["correction_range_round_to_int"] = False
    partial = c.float("partial_rotary_factor", default=1.0)
    if not mla and partial != 1.0:
        raise c.refuse("partial_rotary_factor", f"with {key} yarn: megatron-core's YarnRotaryEmbedding scales every "
                       "head dimension (it ignores rotary_percent); the model is not expressible")
    sub.check_all_read("YaRN RoPE scaling")
    return yarn(factor, **fields)


def window(c, mtype: str, layers: int) -> dict:
    """``window_size`` / ``window_attn_skip_freq`` of the layers HF gives a sliding window (none: ``{}``)."""
    types = layer_types(c, layers, default=None)
    size = c.int("sliding_window", required=False) if mtype in WINDOW_FROM_LAYER + WINDOW_EVERY_LAYER else None
    if mtype == "qwen2_moe":
        c.int("sliding_window", required=False)
        c.int("max_window_layers", required=False, minimum=0)
        if types is None and c.bool("use_sliding_window", False):
            raise c.refuse("use_sliding_window", "transformers' releases slide different Qwen2-MoE layers (the newest: "
                           "even layers below max_window_layers); give layer_types")
    elif mtype in WINDOW_FROM_LAYER:
        use = c.bool("use_sliding_window", False)
        first = c.int("max_window_layers", default=layers, required=False, minimum=0)
        if types is None and use and size is not None:
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    elif mtype in WINDOW_EVERY_LAYER and types is None and size is not None:
        types = ["sliding_attention"] * layers
    if not types or "sliding_attention" not in types:
        return {}
    w = c.int("sliding_window")          # the families without a window do not read it: an unknown field there
    return {"window_size": [w - 1, 0], "window_attn_skip_freq": skip_freq(types)}


def layer_types(c, layers: int, default: list[str] | None) -> list[str] | None:
    types = c.raw("layer_types")
    if types is None:
        return default
    if not isinstance(types, list) or len(types) != layers or \
            not set(types) <= {"sliding_attention", "full_attention"}:
        raise c.bad("layer_types", types, f"{layers} entries of sliding_attention / full_attention")
    return types


def skip_freq(types: list[str]) -> int | list[int] | None:
    """HF ``layer_types`` as megatron-core's ``window_attn_skip_freq``: None when every layer slides, N when it is
    megatron-core's every-N-th-full rule, else a 0/1 list (1 = windowed)."""
    pattern = [int(t == "sliding_attention") for t in types]
    n = len(pattern)
    if all(pattern):
        return None
    for k in range(2, n + 1):
        if pattern == [int((i + 1) % k != 0) for i in range(n)]:
            return k
    return pattern


def refuse_type(c, mtype: str) -> AcesoError | None:
    """The one line for a model type megatron-core 0.16.1 cannot build (None: not one of them)."""
    if mtype in ("gemma", "gemma2", "gemma3", "gemma3_text"):
        return AcesoError(f"{c.source}: model_type {mtype} (Gemma): its layer (norms scaled by 1 + weight, the "
                          "post-attention and post-feed-forward norms, the local/global RoPE bases rope_local_base_freq, "
                          "the scaled embedding) is not megatron-core 0.16.1's GPT layer; aceso plans megatron-core "
                          "models")
    if mtype in ("llama4", "llama4_text"):
        text = c.nested("text_config") if mtype == "llama4" else c
        if text.has("attention_chunk_size"):
            return text.refuse("attention_chunk_size", "Llama 4's chunked local attention is not in megatron-core "
                               "0.16.1, so Megatron-LM cannot train this model")
        return AcesoError(f"{c.source}: model_type {mtype}: Llama 4's layers (no-RoPE layers, the L2 QK norm, the "
                          "router's input scaling) are not read by aceso's import")
    return None
