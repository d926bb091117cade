"""A multi-token prediction depth (DeepSeek-V3; megatron-core's ``MultiTokenPredictionLayer``): ``enorm``,
``hnorm``, ``eh_proj`` (2h -> h), one decoder layer like the model's last, its final norm, output layer and loss.
A whole-layer unit after the decoder's last layer, one per ``mtp_num_layers``; in a hybrid pattern each depth is
``/`` and its inner layer's symbols. Counts: ``search.layers.moe_params.mtp_layer_params``; FLOPs:
``search.layers.moe_flops.mtp_flops``; time and bytes: ``costmodel.mla_mtp.mtp_unit`` from its inner layer's rows.

``mtp_use_repeated_layer`` (megatron-core 0.19 ``MultiTokenPredictionBlock``: one layer built, run at every depth):
the depths after the first are their own row (``shares_weights``) with the same time and activations and no
parameters of their own, so weights, gradients and optimizer state count once and compute per depth."""

from __future__ import annotations

from search.layers.moe_flops import mtp_flops
from search.layers.moe_params import mtp_layer_params
from .dense import mlp_muon
from .kind import LayerKind, Row, mtp_inner_kinds, register


def shares_weights(m, u) -> bool:
    """Whether unit ``u`` is an MTP depth after the first of a model whose depths share one layer's weights."""
    return u.kind == "mtp" and bool(m.mtp_use_repeated_layer) and u.layer > m.decoder_layers


def price_mtp(src, u, a) -> Row:
    m = src.model
    # the inner layer priced as the decoder's last (its sliding window too), in the ``mtp`` stack: its recipe is
    # an MTP depth's (``settings.precision.mtp_quantized``), its module path for per-module precision overrides
    # ``mtp.layers.D.mtp_model_layer.`` (``settings.precision_overrides.unit_prefix``)
    att, ffn = (a.row(type(u)("mtp", m.num_layers - 1, k)) for k in mtp_inner_kinds(m))
    cost, act, params, experts = src.mtp_unit(a.b, a.s, a.t, a.sp, att.cost, att.act, ffn.cost,
                                      (*ffn.act, ffn.transient), att.params, (ffn.params, ffn.expert_params))
    if shares_weights(m, u):
        params = experts = 0.0
    return Row(cost, act[:3], params, experts, transient=act[3])


MTP = register(LayerKind(
    name="mtp", symbol=None, role="layer", label="MTP", params=lambda m: mtp_layer_params(m)[0],
    flops=lambda m, s, keys=None: mtp_flops(m, s), price=price_mtp, repeat=lambda m: m.mtp_num_layers or 0,
    recompute=("none", "full"),           # its inner layer whole
    row_variant=shares_weights,
    hybrid_slot="mtp_block_spec",
    muon_shapes=mlp_muon))                # Muon's step counts an MTP depth as one MLP's weights (as it did)
