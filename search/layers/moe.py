"""The MoE layer's MLP half, ``E``: router, token dispatch, routed experts (at the stage's expert shape ep / etp),
shared expert, combine. It replaces ``-`` in the decoder layers ``MoESpec.is_moe_layer`` names (``moe_layer_freq``).
Counts: ``search.layers.moe_params``; FLOPs: ``search.layers.moe_flops``; time and bytes: ``costmodel.moe_cost`` (its docstring
and docs/moe.md have every term)."""

from __future__ import annotations

from search.layers.moe_flops import moe_flops
from search.layers.moe_params import moe_unit_params
from search.layers.moe_spec import AUX_LOSS_TYPES
from .dense import _MLP_PARTS, mlp_offload
from .kind import LayerKind, Row, register

# Host cost of each local expert, in launches at HOST_LAUNCH_MS. Not a count of launches: transformer-engine's
# grouped GEMM (``multi_stream_cublas_gemm``, transformer-engine common/gemm) issues one cuBLAS GEMM per expert
# from C++ on ``num_streams`` = 4 side streams, with one event record and 4 waits before and 4 records and waits
# after, per call (fc1, fc2): 2 GEMM calls per expert and 26 stream calls per layer, each far cheaper than a Python
# op. Priced so (2 per expert), the 26.x MoE rows fit worse at every HOST_LAUNCH_MS of 0.05-0.12 (MAE 9.0% at best
# against 6.6%; the Qwen3-30B micro-batch-1 B200 row, whose exposed host time is mostly these, +42%): the rows ask
# for ~0.3 ms of host time per local expert and layer, which 6 launches at 0.05 ms give. Kept as 6, a fitted
# per-expert host cost (docs/costmodel.md, "The 2026 software stack"); what it is made of is open. Moved mostly to
# the backward (TE 2.14's ``cublas_gemm`` sets up descriptors and queries the heuristic per call, two calls per expert
# GEMM there), the Qwen3-30B micro-batch-4 rows lose the forward wait that prices them, and the 25.x MoE bound breaks
# (same section, "Moved to the backward").
EXPERT_LAUNCHES = 6


def price_moe(src, u, a) -> Row:
    cost, act, params, experts = src.moe_unit(a.b, a.s, a.t, a.sp, a.ep, a.etp, a.moe, overlap=a.overlap, lp=a.lp)
    return Row(cost, act[:3], params, experts, transient=act[3])    # transient: the dispatch buffers


def moe_launches(m, quantized: bool, n_local: int, moe=None) -> dict:
    """Router, dispatcher preprocessing and the rest (permute, all-to-alls, experts' grouped GEMMs, unpermute) by
    part, ``moe`` the plan's ``MoEPlanSettings`` (``costmodel.host`` has the counting)."""
    q = 1 if quantized else 0
    e, s = m.moe, moe
    fused = bool(s and s.router_fusion)
    topk = 7 + (4 if e.moe_router_num_groups else 0) + (2 if e.moe_router_enable_expert_bias else 0)
    lb = e.lb_type
    aux = 11 if lb in AUX_LOSS_TYPES else 0
    router = (1 + (1 if s and s.router_dtype else 0) + (2 if e.moe_router_force_load_balancing else 0)
              + (4 if fused else topk + aux) + (1 if lb == "seq_aux_loss" else 0) + 1)
    if e.moe_shared_expert_intermediate_size:
        router += 5 + 3 * q
    padded = e.moe_pad_expert_input_to_capacity
    perm = 2 if (s is None or s.permute_fusion) else 6
    gemms = EXPERT_LAUNCHES * n_local + (0 if (s is None or s.grouped_gemm) else n_local)
    return {"moe_router": router, "moe_preprocess": 5 if padded else 16, "moe_rest": perm + 7 + gemms + 2 * q}


def moe_muon(m, t: int, ep: int = 1, etp: int = 0) -> list:
    """The router, the local experts' fc1 / fc2 (over etp; second and third; LatentMoE: at the latent width, and
    its fc1 / fc2 latent projections whole on every rank) and the shared expert (``costmodel.optimizers``)."""
    h, e, up = m.hidden_size, m.moe, 2 if m.gated_mlp else 1
    etp = etp or t
    f, n_local, w = e.moe_ffn_hidden_size, e.num_experts / ep, e.moe_latent_size or h
    out = [(e.num_experts, h, 1), (up * f / etp, w, n_local), (w, f / etp, n_local)]
    if e.moe_latent_size:
        out += [(w, h, 1), (h, w, 1)]
    fs = e.moe_shared_expert_intermediate_size
    if fs:
        out += [(up * fs / t, h, 1), (h, fs / t, 1)]
    return out


def moe_linears(m, t: int, ep: int = 1, etp: int = 0) -> tuple:
    """``MOE.linears``' weight parameters per rank (``moe_muon``'s shards but the router, which is no TE linear): the
    local experts' fc1 / fc2, the shared expert's and the latent projections' (0 where the model has none)."""
    w = [r * c * k for r, c, k in moe_muon(m, t, ep, etp)]
    e = m.moe
    latent = w[3:5] if e.moe_latent_size else [0.0, 0.0]
    shared = w[-2:] if e.moe_shared_expert_intermediate_size else [0.0, 0.0]
    return (w[1], w[2], *shared, *latent)


def moe_offload(m, module: str, b: float, s: float, t: int, sp: bool, dt: float, ep: int = 1,
                etp: int = 0) -> float:
    """mlp_norm: the residual stream; expert_fc1: the dispatched tokens (``dt n h``; LatentMoE: ``dt n l``); moe_act:
    the fc1 output
    (``dt n up / etp``), ``n`` the tokens at the rank's experts (``costmodel.stack_cost``)."""
    if module not in ("expert_fc1", "moe_act"):
        return mlp_offload(m, module, b, s, t, sp, dt)
    e = m.moe
    etp = etp or t
    n = etp * (b * s / t) * e.moe_router_topk
    up = (2 if m.gated_mlp else 1) * e.moe_ffn_hidden_size
    return dt * n * ((e.moe_latent_size or m.hidden_size) if module == "expert_fc1" else up / etp)


MOE = register(LayerKind(
    name="moe", symbol="E", role="mlp", label="MoE", params=moe_unit_params,
    flops=lambda m, s, keys=None: moe_flops(m, s), price=price_moe,
    replaces="mlp", selects=lambda m, stack, layer: stack == "decoder" and m.moe is not None and
    m.moe.is_moe_layer(layer),
    megatron_modules={"selective": "moe_act"},      # the experts' activation function
    layer_parts=_MLP_PARTS, hybrid_slot="moe_layer",      # megatron-core's MoELayer sits at ``mlp``
    routed_experts=True, launches=moe_launches, muon_shapes=moe_muon, offload_inputs=moe_offload,
    block="moe",   # core_v0.19.0 moe_layer.py / experts.py (TEGroupedMLP) / shared_experts.py
    linears=("mlp.experts.linear_fc1", "mlp.experts.linear_fc2", "mlp.shared_experts.linear_fc1",
             "mlp.shared_experts.linear_fc2", "mlp.fc1_latent_proj", "mlp.fc2_latent_proj"),
    linear_params=moe_linears))
