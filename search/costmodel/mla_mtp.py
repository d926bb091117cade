"""Analytic time, activations and per-rank parameters of MLA attention and of the MTP unit.

**MLA** (megatron-core 0.16.1 ``MLASelfAttention``), per rank at b, s tokens, tp t (r = t with SP, else 1),
heads n, dq = qk_head_dim, dr = qk_pos_emb_head_dim, dv = v_head_dim, ql = q_lora_rank, kvl = kv_lora_rank:

    down projections   ``linear_q_down_proj`` (b s / r, ql, h) and ``linear_kv_down_proj`` (b s / r, kvl + dr, h):
                       ``parallel_mode='duplicated'``, every TP rank holds them whole and runs them on its SP shard
    up projections     q (b s, n (dq + dr) / t, ql) (no q_lora: (b s, n (dq + dr) / t, h)), kv (b s, n (dq + dv) /
                       t, kvl): column-parallel; output (b s, h, n dv / t) row-parallel
    core               flash over 2 s kv b n (dq + dr) / t (Q K^T) + 2 s kv b n dv / t (P V) FLOPs (causal: half),
                       head width dq + dr
    TP collectives     SP: the latents' all-gathers (ql and kvl + dr wide) and the output's reduce-scatter (h wide),
                       priced as ``tpcomm.tp_half`` of the h-wide pair scaled by (ql + kvl + dr + h) / 2h (an
                       approximation: the shape model of the overlap is the dense one)
    element-wise       norm + bias-dropout-add as the dense unit, the latent norms (2 dt b s (ql + kvl) / r),
                       RoPE on q_pe and k_pe (2 dt b s (n + 1) dr / t)
    ring attention     the dense unit's K/V exchange with MLA's per-head K (dq + dr) and V (dv)
    activations        the dense unit's replicated part, the latents (dt b s (ql + kvl + dr) / r and the
                       normalised ql, kvl), Q, K, V for the core (dt b s n (2 (dq + dr) + dv) / t), the output
                       projection input (dt b s n dv / t), the flash log-sum-exp (4 n s b / t); selective drops the
                       core's share as the dense unit does

**MTP** (``MultiTokenPredictionLayer``, one unit per MTP layer, on the last stage): the enorm / hnorm of the
hidden states and of the shifted tokens' embedding, ``eh_proj`` (b s, h / t, 2h) column-parallel with its own TP
collectives (``eh_proj_tp``), one transformer layer like the last decoder layer (its attention unit and its mlp /
moe unit, priced by their own formulas), and its own final norm, logits and loss (``AnalyticSource.head``: the
output layer is the main model's). Recompute none or full (the unit's two inputs kept: 2 dt b s h / r).
"""

from __future__ import annotations

from search.settings import precision as lowp
from ..layers.kind import UnitCost
from .tpcomm import TPComm
from search.layers.moe_params import _norm, mla_params
from .memory import LOSS_KEPT_BYTES, _has_hidden_dropout


def mla_scale(m) -> float:
    a = m.mla
    ql = a.q_lora_rank or m.hidden_size
    return (ql + a.kv_lora_rank + a.qk_pos_emb_head_dim + m.hidden_size) / (2.0 * m.hidden_size)


def mla_attention(src, b: float, s: int, t: int, cp: int = 1, sp: bool = False, overlap: bool = False):
    """UnitCost of one MLA attention unit."""
    m, dt, k = src.model, src.dt, src.kern
    a, h, n = m.mla, m.hidden_size, m.num_attention_heads
    qk, dv = a.qk_head_dim + a.qk_pos_emb_head_dim, a.v_head_dim
    r = t if sp else 1
    sb = s * b
    gemms = [(sb / r, a.kv_lora_rank + a.qk_pos_emb_head_dim, h), (sb, n * (a.qk_head_dim + dv) / t, a.kv_lora_rank),
             (sb, h, n * dv / t)]
    if a.q_lora_rank is None:
        gemms.append((sb, n * qk / t, h))
    else:
        gemms += [(sb / r, a.q_lora_rank, h), (sb, n * qk / t, a.q_lora_rank)]
    ql = a.q_lora_rank or 0
    ew = (2 * dt * sb * h + (3 * dt + 1) * sb * h + 2 * dt * sb * (ql + a.kv_lora_rank)) / r
    ew += 2 * dt * sb * (n + 1) * a.qk_pos_emb_head_dim / t
    kv_len = s * cp
    flops = (2.0 * s * kv_len * b * n * qk + 2.0 * s * kv_len * b * n * dv) / t
    if src.flash:
        core_f = k.flash(0.5 * flops, kv_len / cp, qk, True)
        core_b = k.flash(0.5 * flops, kv_len / cp, qk, True, backward=True)
    else:
        heads = b * n / t
        core_f = k.bmm(heads, s, kv_len, qk) + k.bmm(heads, s, dv, kv_len) + k.memory(2 * dt * heads * s * kv_len)
        core_b = (k.bmm(heads, s, kv_len, qk, backward=True) + k.bmm(heads, s, dv, kv_len, backward=True)
                  + k.memory(3 * dt * heads * s * kv_len))
    chunk = dt * s * b * n * (qk + dv) / t
    ring_f, ring_b, ring_hf, ring_hb = src._cp_ring_parts(b, s, t, cp, core_f, core_b, chunk=chunk)
    tpc = src._half((sb, n * qk / t, h), (sb, h, n * dv / t), b, s, t, sp, overlap)
    sc = mla_scale(m)
    tp_f, tp_b, tp_h, tp_hf = tpc.fwd * sc, tpc.bwd * sc, tpc.hidden * sc, tpc.hidden_fwd * sc
    fwd = k.gemm(gemms) + k.memory(ew, 4) + core_f + ring_f + tp_f
    bwd = k.gemm(gemms, backward=True) + k.memory(1.5 * ew, 4) + core_b + ring_b + tp_b
    # mla_up_proj re-runs the up projections and RoPE (megatron-core's CheckpointWithoutOutput over
    # ``qkv_up_proj_and_rope_apply``; its inputs are the gathered, normalised latents: no TP collective again)
    up = [(sb, n * (a.qk_head_dim + dv) / t, a.kv_lora_rank),
          (sb, n * qk / t, a.q_lora_rank) if a.q_lora_rank is not None else (sb, n * qk / t, h)]
    rec_up = k.gemm(up) + k.memory(2 * dt * sb * (n + 1) * a.qk_pos_emb_head_dim / t, 4)
    return UnitCost(fwd, bwd, core_f + ring_f, fwd, tp_f + tp_b + ring_f + ring_b, float(1e9), tp_h,
                    ring_f + ring_b, ring_hf + ring_hb, (tp_f, tp_hf, ring_f, ring_hf), rec_up=rec_up)


def mla_act_bytes(src, b: float, s: int, t: int, sp: bool = False,
                  lp: bool = False) -> tuple[float, float, float, float, float]:
    """(none, selective, full, attn_dropout = none, mla_up_proj) bytes kept by one MLA attention unit. ``lp`` (a
    quantized unit): its linear layers keep their inputs quantized, as the dense attention's do
    (``analytic._lp_saving``): the down projections' input (b s h / r), the up projections' normalised latents
    (b s (ql + kvl) / r) and the output projection's input (b s n dv / t); full keeps the unit input in bf16.
    mla_up_proj (megatron-core's ``CheckpointWithoutOutput`` over the up projections and RoPE, discarded once the
    core attention has run) keeps none of the core's Q, K and V (dt b s n (2 (dq + dr) + dv) / t): its inputs, the
    latents, are kept anyway; tests/runtime/test_mla_up_proj.py measures it on megatron-core's MLASelfAttention."""
    m, dt = src.model, src.dt
    a, h, n = m.mla, m.hidden_size, m.num_attention_heads
    qk, dv = a.qk_head_dim + a.qk_pos_emb_head_dim, a.v_head_dim
    r = t if sp else 1
    sb = s * b
    mask = sb * h if _has_hidden_dropout(m) else 0.0
    ql = a.q_lora_rank or 0
    latents = dt * sb * (2 * ql + 2 * a.kv_lora_rank + a.qk_pos_emb_head_dim) / r
    split = dt * sb * n * (2 * qk + dv) / t + dt * sb * n * dv / t
    core = 4.0 * n * sb / t if src.flash else (4.0 + dt) * n * s * s * b / t
    none = (2 * dt * sb * h + mask) / r + latents + split + core
    if lp:
        none -= lowp.act_saving_bytes(src.recipe_of(lp) or "bf16", sb * ((h + ql + a.kv_lora_rank) / r + n * dv / t),
                                      dt)
    qkv = dt * sb * n * (2 * qk + dv) / t
    return none, none - core, dt * sb * h / r, none, none - qkv


def mla_params_per_rank(m, t: int) -> float:
    """MLA attention on one TP rank: the duplicated down projections, the latent and input norms and the
    row-parallel bias whole; the up projections and the output projection split."""
    a, h = m.mla, m.hidden_size
    whole = (h * (a.kv_lora_rank + a.qk_pos_emb_head_dim) + (h * a.q_lora_rank if a.q_lora_rank else 0)
             + _norm(m, h) + (h if m.add_bias_linear else 0))
    if (m.megatron or {}).get("qk_layernorm"):
        whole += _norm(m, a.kv_lora_rank) + (_norm(m, a.q_lora_rank) if a.q_lora_rank else 0)
    bias_down = (a.kv_lora_rank + a.qk_pos_emb_head_dim + (a.q_lora_rank or 0)) if m.add_bias_linear else 0
    whole += bias_down
    return (mla_params(m) - whole) / t + whole


def mtp_unit(src, b: float, s: int, t: int, sp: bool, att, att_act, inner, inner_act, att_params: float,
             inner_params: tuple[float, float]):
    """(UnitCost, act bytes (none, selective, full), params, expert params) of one MTP unit, from its inner
    layer's two priced units (``att``, ``inner``: UnitCost; ``*_act``: their byte tuples)."""
    m, dt, k = src.model, src.dt, src.kern
    h = m.hidden_size
    r = t if sp else 1
    sb = s * b
    eh = (sb, h / t, 2 * h)
    norms = 3 * 2 * dt * sb * h / r + dt * sb * h / r      # enorm, hnorm, final norm + the shifted embedding
    tpc = eh_proj_tp(src, b, s, t, sp)
    head_f, head_b = src.head(b, s, t, sp)
    fwd = att.fwd + inner.fwd + k.gemm([eh]) + k.memory(norms, 4) + tpc.fwd + head_f
    bwd = att.bwd + inner.bwd + k.gemm([eh], backward=True) + k.memory(1.5 * norms, 4) + tpc.bwd + head_b
    cost = UnitCost(fwd, bwd, float(1e9), fwd, att.tp_comm + inner.tp_comm + tpc.fwd + tpc.bwd, float(1e9),
                    att.tp_hidden + inner.tp_hidden + tpc.hidden, att.cp_comm, att.cp_hidden,
                    tuple(x + y for x, y in zip(att.comm_fwd, inner.comm_fwd)),
                    ep_comm=inner.ep_comm, ep_hidden=inner.ep_hidden, ep_fwd=inner.ep_fwd)
    sbv = sb * m.padded_vocab_size / t
    own = dt * sb * 2 * h + 2 * dt * sb * h / r + dt * sb * h * (1 + 1 / r) + LOSS_KEPT_BYTES * sbv
    none = att_act[0] + inner_act[0] + own
    transient = inner_act[3] if len(inner_act) > 3 else 0.0
    params = 3 * _norm(m, h) + 2 * h * h / t + att_params + inner_params[0]
    return cost, (none, none, 2 * dt * sb * h / r, transient), params, inner_params[1]


def eh_proj_tp(src, b: float, s: int, t: int, sp: bool) -> TPComm:
    """The TP collectives of one MTP layer's ``eh_proj`` per micro-batch, as megatron-core 0.19.2 runs it
    (transformer/multi_token_prediction.py ``MultiTokenPredictionLayer._concat_embeddings``): a column-parallel
    linear 2h -> h / t (``gather_output=False``) on the concatenated [embedding, hidden] input, then
    ``gather_from_tensor_model_parallel_region`` (an all-gather along the hidden dimension: every rank gets the
    whole h) and, with SP, ``scatter_to_sequence_parallel_region`` (a local slice of the sequence, no
    communication). Not the attention / MLP half's pattern: no reduce-scatter forward, and the gathered input is
    2h wide. With X = dt b s h (the full activation):

        SP     forward   all-gather of the 2h-wide SP input (2X), the hidden all-gather (X)
               backward  the slice's gradient all-gathered along the sequence (X), the column linear's input
                         re-gathered for its weight gradient (2X) and its input gradient reduce-scattered (2X)
        no SP  forward   the hidden all-gather (X)
               backward  the column linear's input-gradient all-reduce (2X)

    The two hidden-dimension / slice collectives are megatron-core's own autograd functions, blocking. The column
    linear's backward ones overlap as a TP half's do (``tpcomm``: ``dgrad``, megatron-core's / TE's async re-gather
    behind the input-gradient GEMM and reduce-scatter / all-reduce behind the weight-gradient GEMM, exposing
    ``max(0, c - g)`` plus the overlap tax; ``none``: exposed; TE's userbuffers (``mtp_eh_proj``) are priced as
    ``dgrad``). Gathers in the activation dtype: the MTP layers of the published recipes run in bf16."""
    if t <= 1:
        return TPComm(0.0, 0.0, 0.0)
    h, comm = src.model.hidden_size, src.comm
    x = src.dt * s * b * h
    mode = src._tp_mode(sp, False)
    _, c_d, c_w = src.kern.gemm_parts(s * b, h / t, 2 * h)
    hidden_ag = comm.all_gather(x, t)
    if sp:
        fwd = comm.all_gather(2 * x, t) + hidden_ag
        overlapped = ((comm.all_gather(2 * x, t), c_d), (comm.reduce_scatter(2 * x, t), c_w))
        bwd = hidden_ag
    else:
        fwd = hidden_ag
        overlapped = ((comm.all_reduce(2 * x, t), c_w),)
        bwd = 0.0
    if mode == "none":
        return TPComm(fwd, bwd + sum(c for c, _ in overlapped), 0.0)
    hid = sum(min(c, g) for c, g in overlapped)
    bwd += sum(max(0.0, c - g) for c, g in overlapped) + src._tax * hid
    return TPComm(fwd, bwd, hid)
