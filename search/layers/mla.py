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
    from ..costmodel.mla_mtp import mla_act_bytes, mla_attention, mla_params_per_rank
    return Row(mla_attention(src, a.b, a.s, a.t, a.cp, a.sp, a.overlap), mla_act_bytes(src, a.b, a.s, a.t, a.sp, a.lp),
               mla_params_per_rank(src.model, a.t))


MLA = register(LayerKind(
    name="attention", symbol="+", role="attention", label="MLA", params=mla_params,
    flops=lambda m, s, keys=None: mla_flops(m, s), price=price_mla,
    variant_of="attention", applies=lambda m: m.mla is not None, row_variant=ATTENTION.row_variant,
    recompute=(*ATTENTION.recompute, "mla_up_proj"),
    megatron_modules={**ATTENTION.megatron_modules, "mla_up_proj": "mla_up_proj"},
    layer_parts=ATTENTION.layer_parts, hybrid_slot="mla_layer"))
