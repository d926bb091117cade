"""Multi-latent attention (DeepSeek-V2/V3), ``+``: a variant of ``*`` for models with ``ModelSpec.mla``; its units
keep the name ``attention`` (plans, recompute choices and the runtime's ``self_attention`` slot are the same).
Counts: ``search.layers.moe_params.mla_params``; FLOPs: ``search.layers.moe_flops.mla_flops``; time and bytes:
``costmodel.mla_mtp``."""

from __future__ import annotations

from search.layers.moe_flops import mla_flops
from search.layers.moe_params import mla_params
from .dense import ATTENTION
from .kind import LayerKind, Row, register


def price_mla(src, u, a) -> Row:
    return Row(src.mla_attention(a.b, a.s, a.t, a.cp, a.sp, a.overlap), src.mla_act_bytes(a.b, a.s, a.t, a.sp, a.lp),
               src.mla_params_per_rank(src.model, a.t))


def mla_launches(m, quantized: bool, n_local: int = 0, moe=None) -> dict:
    """2 down projections, 2 latent norms, 2 up projections, RoPE, core, proj, bias-dropout-add: 12, + 5
    quantized (``costmodel.host`` has the counting)."""
    return {"attn": 12 + 5 * (1 if quantized else 0)}


def mla_muon(m, t: int, ep: int = 1, etp: int = 0) -> list:
    """The Q down projection (with ``q_lora_rank``), Q up, KV down, KV up and output projections
    (``costmodel.optimizers``)."""
    h, a, n = m.hidden_size, m.mla, m.num_attention_heads
    qk = a.qk_head_dim + a.qk_pos_emb_head_dim
    down = [(h, a.q_lora_rank, 1)] if a.q_lora_rank else []
    q_up = [(a.q_lora_rank or h, n * qk / t, 1)]
    return down + q_up + [(h, a.kv_lora_rank + a.qk_pos_emb_head_dim, 1),
                          (a.kv_lora_rank, n * (a.qk_head_dim + a.v_head_dim) / t, 1), (n * a.v_head_dim / t, h, 1)]


def mla_linears(m, t: int, ep: int = 1, etp: int = 0) -> tuple:
    """``MLA.linears``' weight parameters per rank (``mla_muon``'s shards): ``linear_q_proj`` without
    ``q_lora_rank``, else ``linear_q_down_proj`` and ``linear_q_up_proj``; the KV down and up and output
    projections."""
    w = [r * c * k for r, c, k in mla_muon(m, t)]
    q = (0.0, w[0], w[1]) if m.mla.q_lora_rank else (w[0], 0.0, 0.0)
    return (*q, *w[-3:])


MLA = register(LayerKind(
    name="attention", symbol="+", role="attention", label="MLA", params=mla_params,
    flops=lambda m, s, keys=None: mla_flops(m, s), price=price_mla,
    variant_of="attention", applies=lambda m: m.mla is not None, row_variant=ATTENTION.row_variant,
    recompute=(*ATTENTION.recompute, "mla_up_proj"),
    megatron_modules={**ATTENTION.megatron_modules, "mla_up_proj": "mla_up_proj"},
    layer_parts=ATTENTION.layer_parts, hybrid_slot="mla_layer", ep_overlap_partner=True, launches=mla_launches,
    muon_shapes=mla_muon, offload_inputs=ATTENTION.offload_inputs, block="mla",
    linears=tuple(f"self_attention.{n}" for n in ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj",
                                                    "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")),
    linear_params=mla_linears))
