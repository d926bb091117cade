"""The MoE layer's MLP half, ``E``: router, token dispatch, routed experts (at the stage's expert shape ep / etp),
shared expert, combine. It replaces ``-`` in the decoder layers ``MoESpec.is_moe_layer`` names (``moe_layer_freq``).
Counts: ``search.layers.moe_params``; FLOPs: ``search.layers.moe_flops``; time and bytes: ``costmodel.moe_cost`` (its docstring
and docs/moe.md have every term)."""

from __future__ import annotations

from search.layers.moe_flops import moe_flops
from search.layers.moe_params import moe_unit_params
from .dense import _MLP_PARTS
from .kind import LayerKind, Row, register


def price_moe(src, u, a) -> Row:
    from ..costmodel.moe_cost import moe_unit
    cost, act, params, experts = moe_unit(src, a.b, a.s, a.t, a.sp, a.ep, a.etp, a.moe, overlap=a.overlap, lp=a.lp)
    return Row(cost, act[:3], params, experts, transient=act[3])    # transient: the dispatch buffers


MOE = register(LayerKind(
    name="moe", symbol="E", role="mlp", label="MoE", params=moe_unit_params,
    flops=lambda m, s, keys=None: moe_flops(m, s), price=price_moe,
    replaces="mlp", selects=lambda m, stack, layer: stack == "decoder" and m.moe is not None and
    m.moe.is_moe_layer(layer),
    megatron_modules={"selective": "moe_act"},      # the experts' activation function
    layer_parts=_MLP_PARTS, hybrid_slot="moe_layer"))     # megatron-core's MoELayer sits at ``mlp``
