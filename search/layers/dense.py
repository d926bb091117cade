"""The dense transformer's kinds: self-attention ``*`` and MLP ``-`` (GPT, Llama, T5) and T5's cross-attention.

Parameter counts follow megatron-core's modules (``GPTModel`` / ``T5Model`` with the local specs): QKV as one linear
of ``h x (heads + 2 groups) kv_channels``, output projection ``heads kv_channels x h``, an MLP of ``h x ffn``
(``h x 2 ffn`` gated) and ``ffn x h``, biases when ``add_bias_linear`` (the QKV bias alone with
``megatron.add_qkv_bias``), one norm per unit (and the Q/K norms of ``megatron.qk_layernorm``). FLOPs follow
Narayanan et al. (SC'21, appendix): 2 per multiply-add, the full score matrix counted. Their time and bytes are the
analytic cost model's (``costmodel.analytic.AnalyticSource.attention`` / ``mlp``, ``costmodel.memory``).
"""

from __future__ import annotations

from search.layers import layer_variants
from search.settings import precision as lowp
from .kind import LayerKind, Row, register

_ATTENTION_PARTS = ("input_layernorm", "self_attention", "self_attn_bda")
_MLP_PARTS = ("pre_mlp_layernorm", "mlp", "mlp_bda")
# selective: the core (or the unfused softmax); attn_dropout: the probability dropout and probs x V only
ATTENTION_RECOMPUTE = ("none", "selective", "full", "attn_dropout")


def _qkv(m) -> tuple[int, int, int]:
    return m.hidden_size, m.num_attention_heads * m.head_dim, m.groups * m.head_dim


def attention_params(m) -> int:
    h, q, kv = _qkv(m)
    return h * (q + 2 * kv) + q * h + (q + 2 * kv if m.qkv_bias else 0) + (h if m.add_bias_linear else 0) + \
        m._norm_params() + m.qk_norm_params() + layer_variants.softmax_offset_params(m)


def cross_attention_params(m) -> int:
    """Q from the decoder, K/V from the encoder output (megatron-core: two linears)."""
    h, q, kv = _qkv(m)
    return h * q + h * 2 * kv + q * h + (q + 2 * kv + h if m.add_bias_linear else 0) + m._norm_params()


def mlp_params(m) -> int:
    h, ffn = m.hidden_size, m.ffn_hidden_size
    up = 2 * ffn if m.gated_mlp else ffn
    return h * up + ffn * h + (up + h if m.add_bias_linear else 0) + m._norm_params()


def attention_flops(m, s: int, keys: int | None = None) -> float:
    h, q, kv = _qkv(m)
    keys = keys or s
    return 2.0 * s * (h * (q + 2 * kv) + q * h) + 2.0 * 2.0 * s * keys * q     # linears, QK^T and PV


def cross_attention_flops(m, s: int, keys: int | None = None) -> float:
    """Q and the output over the decoder's ``s`` tokens, K/V over the encoder's ``keys``."""
    h, q, kv = _qkv(m)
    keys = keys or s
    return 2.0 * s * (h * q + q * h) + 2.0 * keys * h * 2 * kv + 2.0 * 2.0 * s * keys * q


def mlp_flops(m, s: int, keys: int | None = None) -> float:
    ffn = m.ffn_hidden_size
    return 2.0 * s * (m.hidden_size * (2 * ffn if m.gated_mlp else ffn) + ffn * m.hidden_size)


def _quantized(src, act: tuple, second: int, a, names: tuple = (None, None)) -> tuple:
    """Activation bytes of a quantized unit: its linear layers' inputs are kept quantized (the first linear's
    input ``s b h / r`` and the second's ``s b second / t``, ``names``: each in its own recipe with per-module
    overrides); full recompute keeps only the unit input."""
    if not a.lp:
        return act
    r = a.t if a.sp else 1
    r1, r2 = (src.recipe_of(a.lp, n) or "bf16" for n in names)
    if r1 == r2:
        save = lowp.act_saving_bytes(r1, a.s * a.b * (src.model.hidden_size / r + second / a.t), src.dt)
    else:
        save = lowp.act_saving_bytes(r1, a.s * a.b * src.model.hidden_size / r, src.dt) + \
            lowp.act_saving_bytes(r2, a.s * a.b * second / a.t, src.dt)
    return tuple(x if j == 2 else x - save for j, x in enumerate(act))


def _window(m, u) -> bool:      # (an MTP depth's inner layer: the decoder's last, ``layers.mtp.price_mtp``)
    return u.stack in ("decoder", "mtp") and layer_variants.is_window_layer(m, u.layer)


def price_attention(src, u, a) -> Row:
    m = src.model
    window = layer_variants.window_keys(m, u.layer, a.s * a.cp) if _window(m, u) else None
    cost = src.attention(a.b, a.s, a.t, causal=not (m.is_t5 and u.stack == "encoder"), cp=a.cp, sp=a.sp,
                         overlap=a.overlap, window=window, lp=a.lp)
    act = src.attention_act_bytes(m, a.b, a.s, a.t, src.flash, dt=src.dt, sp=a.sp)
    return Row(cost, _quantized(src, act, _qkv(m)[1], a, ATTENTION.linears),
               src.unit_params_per_rank(m, "attention", a.t))


def price_cross_attention(src, u, a) -> Row:
    m = src.model
    cost = src.attention(a.b, a.s, a.t, kv_len=a.s_enc, sp=a.sp, overlap=a.overlap, lp=a.lp)
    act = src.attention_act_bytes(m, a.b, a.s, a.t, src.flash, kv_len=a.s_enc, dt=src.dt, sp=a.sp)
    return Row(cost, _quantized(src, act, _qkv(m)[1], a), src.unit_params_per_rank(m, "cross_attention", a.t))


def price_mlp(src, u, a) -> Row:
    m = src.model
    fused = src.settings.fused_swiglu and src.cluster.gpu.name != "cpu"
    act = src.mlp_act_bytes(m, a.b, a.s, a.t, src.dt, a.sp, fused_swiglu=fused)
    return Row(src.mlp(a.b, a.s, a.t, a.sp, a.overlap, a.lp), _quantized(src, act, m.ffn_hidden_size, a, MLP.linears),
               src.unit_params_per_rank(m, "mlp", a.t))


# ----- what the cost model's other terms read of the units (costmodel.host, optimizers, stack_cost) -------------
def attention_launches(m, quantized: bool, n_local: int = 0, moe=None) -> dict:
    """TE LayerNormLinear (norm, QKV GEMM), fused RoPE (q, k), the fused attention, TE Linear (proj),
    bias-dropout-add: 7, + 3 quantized, + 2 with ``qk_layernorm`` (the Q and K norms: ``memory.qk_norm_elems``)
    (``costmodel.host`` has the counting)."""
    qk = 2 if (m.megatron or {}).get("qk_layernorm") else 0
    return {"attn": 7 + 3 * (1 if quantized else 0) + qk}


def mlp_launches(m, quantized: bool, n_local: int = 0, moe=None) -> dict:
    """TE LayerNormMLP: norm, fc1, activation, fc2, bias-dropout-add: 5, + 3 quantized."""
    return {"mlp": 5 + 3 * (1 if quantized else 0)}


def attention_muon(m, t: int, ep: int = 1, etp: int = 0) -> list:
    """QKV (split into q, k, v per query group) and the output projection (``costmodel.optimizers``)."""
    h, d, g = m.hidden_size, m.head_dim, m.groups
    q = m.num_attention_heads * d
    return [(q / t, h, 1), (g * d / t, h, 2), (h, q / t, 1)]


def mlp_muon(m, t: int, ep: int = 1, etp: int = 0) -> list:
    """fc1 (both gates when gated) and fc2."""
    h, f, up = m.hidden_size, m.ffn_hidden_size, 2 if m.gated_mlp else 1
    return [(up * f / t, h, 1), (h, f / t, 1)]


def attention_linears(m, t: int, ep: int = 1, etp: int = 0) -> tuple:
    """``linear_qkv`` (``attention_muon``'s q, k and v) and ``linear_proj``: weight parameters per rank."""
    q, kv, proj = (r * c * k for r, c, k in attention_muon(m, t))
    return q + kv, proj


def cross_attention_linears(m, t: int, ep: int = 1, etp: int = 0) -> tuple:
    """``linear_q``, ``linear_kv`` and ``linear_proj`` (``attention_muon``'s shards): weight parameters per rank."""
    return tuple(r * c * k for r, c, k in attention_muon(m, t))


def mlp_linears(m, t: int, ep: int = 1, etp: int = 0) -> tuple:
    """``linear_fc1`` and ``linear_fc2`` (``mlp_muon``'s shards): weight parameters per rank."""
    return tuple(r * c * k for r, c, k in mlp_muon(m, t))


def attention_offload(m, module: str, b: float, s: float, t: int, sp: bool, dt: float, ep: int = 1,
                      etp: int = 0) -> float:
    """attn_norm / qkv_linear: the residual stream / the norm output (``dt s b h / r``); core_attn: Q, K and V
    (``dt s b (q + 2 kv) / t``); attn_proj: the core's output (``dt s b q / t``) (``costmodel.stack_cost``)."""
    r, h = (t if sp else 1), m.hidden_size
    q, kv = m.num_attention_heads * m.head_dim, m.groups * m.head_dim
    return {"attn_norm": dt * s * b * h / r, "qkv_linear": dt * s * b * h / r,
            "core_attn": dt * s * b * (q + 2 * kv) / t, "attn_proj": dt * s * b * q / t}.get(module, 0.0)


def mlp_offload(m, module: str, b: float, s: float, t: int, sp: bool, dt: float, ep: int = 1,
                etp: int = 0) -> float:
    """mlp_norm: the residual stream (``dt s b h / r``)."""
    return dt * s * b * m.hidden_size / (t if sp else 1) if module == "mlp_norm" else 0.0


ATTENTION = register(LayerKind(
    name="attention", symbol="*", role="attention", params=attention_params, flops=attention_flops,
    price=price_attention,
    # a sliding-window layer scores s x min(s, window) keys (layer_variants) and is priced as its own row
    keys=lambda m, u, s, s_enc: layer_variants.window_keys(m, u.layer, s) if u.stack in ("decoder", "mtp")
    else None,
    row_variant=_window, recompute=ATTENTION_RECOMPUTE, megatron_modules={"selective": "core_attn"},
    layer_parts=_ATTENTION_PARTS, hybrid_slot="attention_layer", ep_overlap_partner=True,
    launches=attention_launches, muon_shapes=attention_muon, offload_inputs=attention_offload,
    linears=("self_attention.linear_qkv", "self_attention.linear_proj"),   # core_v0.19.0 attention.py
    linear_params=attention_linears,
    te_fused_norm="attn_norm"))     # TE spec: TELayerNormColumnParallelLinear linear_qkv, input_layernorm IdentityOp

CROSS_ATTENTION = register(LayerKind(
    name="cross_attention", symbol=None, role="attention", label="cross-attention", params=cross_attention_params,
    flops=cross_attention_flops, price=price_cross_attention,
    in_layer=lambda m, stack: m.is_t5 and stack == "decoder", keys=lambda m, u, s, s_enc: s_enc,
    recompute=ATTENTION_RECOMPUTE, megatron_modules={"selective": "core_attn"},
    layer_parts=("pre_cross_attn_layernorm", "cross_attention", "cross_attn_bda"),
    launches=attention_launches, muon_shapes=attention_muon,
    linears=("cross_attention.linear_q", "cross_attention.linear_kv", "cross_attention.linear_proj"),
    linear_params=cross_attention_linears))

MLP = register(LayerKind(
    name="mlp", symbol="-", role="mlp", label="MLP", params=mlp_params, flops=mlp_flops, price=price_mlp,
    # selective re-runs the activation function; Megatron-LM's mlp module re-runs the whole MLP: no entry
    layer_parts=_MLP_PARTS, hybrid_slot="mlp_layer", launches=mlp_launches, muon_shapes=mlp_muon,
    offload_inputs=mlp_offload, te_fused_norm="mlp_norm",   # TE spec: the norm in linear_fc1, pre_mlp IdentityOp
    linears=("mlp.linear_fc1", "mlp.linear_fc2"), linear_params=mlp_linears))   # core_v0.19.0 mlp.py
