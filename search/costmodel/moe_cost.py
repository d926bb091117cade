"""Analytic time, activations and per-rank parameters of the ``moe`` unit (megatron-core 0.16.1 ``MoELayer``).

One MoE layer's MLP half on one rank, per micro-batch, at per-rank batch b, s tokens (the sequence / cp), tp t,
sequence parallelism (required with t > 1: ``search/moe_plan.py``), expert shape ep x etp, h hidden, E experts,
top-k k, expert width f (up = 2f for SwiGLU), element size dt. Tokens entering the layer per rank
``T = b s / t`` (SP shards the sequence over the TP group; ``MoELayer.forward`` takes the SP shard as it is).
``f_i`` = ``moe_imbalance_factor`` (1 when force-balanced; capped by ``moe_expert_capacity_factor`` when tokens are
dropped): the busiest EP rank's share over the even one, which the slowest rank (and so the all-to-all) waits on.

    norm + bias-dropout-add   2 dt T h + (3 dt + 1) T h bytes (as the dense MLP unit)
    router (``TopKRouter``)   GEMM (T, E, h); score + top-k memory bound: T E (dt + 3 x 4 + 1) bytes (read the
                              logits, write and re-read the fp32 scores, write the fp32 probs, the bool routing map)
    permute / unpermute       read T h dt, write T k h dt (+ fp32 probs) each way; ``permute_fusion`` one kernel,
                              unfused (``moe_utils.permute`` with ``fused=False``: argsort + index_select + probs
                              gather) twice the bytes in three launches
    dispatch / combine        alltoall (and flex, priced the same: DeepEP / HybridEP move the same bytes):
                              ``moe_primitives.ep_all_to_all_ms`` of T k (h dt + 4) bytes (tokens + their probs:
                              ``token_dispatch``) and T k h dt back (``token_combine``), over the EP group. Placement
                              (assumed, as megatron-core's expert ``RankGenerator`` orders ranks etp-ep-dp inside a
                              node-aligned stage): EP ranks strided by etp, so ``min(ep, nvlink_size // etp)`` of
                              them share a node.
                              allgather (``MoEAllGatherTokenDispatcher``): all-gather of the T h dt tokens, the fp32
                              probs and the routing map (T E (4 + 1)) over the etp x ep group, a local mask, and a
                              reduce-scatter of the output back.
    ETP (etp > 1, alltoall)   ``dispatch_postprocess`` all-gathers the dispatched tokens over the ETP group (etp T k
                              h dt in all), ``combine_preprocess`` reduce-scatters the expert output back
    experts                   each rank holds E / ep experts, each split over etp; under force balance each rank
                              sends T k / ep token copies to every EP rank, so it receives T k, and after the ETP
                              gather holds ``etp T k`` tokens: ``m_e = etp T k ep / E`` tokens per local expert
                              (x f_i on the busiest rank). fc1 grouped GEMM (E/ep, m_e, up/etp, h), the activation
                              (3 (SwiGLU) or 2 dt m_e f / etp bytes per expert), fc2 (E/ep, m_e, h, f/etp):
                              ``moe_primitives.grouped_gemm_ms``; ``grouped_gemm`` off (``SequentialMLP``): one GEMM
                              per local expert, one after another. Under a low-precision recipe (``lp``: a
                              quantized layer) at the recipe's kernels plus the casts of their inputs, as the dense
                              linears (``AnalyticSource._linears``): TE's GroupedLinear runs the recipe's GEMMs
    fixed                     ``MOE_LAYER_MS`` per micro-batch (a third forward): the host / launch overhead of
                              the layer's many small kernels and the dispatcher's device-to-host sync of the
                              token counts; ONE constant fitted on the published MoE runs (docs/costmodel.md)
    shared expert             ``SharedExpertMLP`` is a dense MLP over the attention TP group (``pg_collection.tp``):
                              all-gather of the SP input, fc1 (b s, up_s/t, h), act, fc2 (b s, h, f_s/t),
                              reduce-scatter, as ``tpcomm.tp_half``. ``shared_expert_overlap``: it runs on its own
                              stream during the dispatch, so the pair costs ``max(dispatch, shared)`` each way
    backward                  every GEMM's two gradient GEMMs, element-wise kernels 1.5x their bytes, the same
                              all-to-all / ETP volumes again (dispatch and combine swap)
    overlap_ep_comm           (``overlap_moe_expert_parallel_comm``: one micro-batch's all-to-all behind the other's
                              compute) exposed = max(0, a2a - the unit's own compute), fwd + bwd together, shared
                              in proportion

Recompute: selective = ``recompute_modules`` ["moe_act"] (the experts' activation re-run: its output, the fc2
input, is not kept); full re-runs the whole unit (its all-to-alls included).
"""

from __future__ import annotations

from .. import precision as lowp
from ..errors import AcesoError
from ..moe_params import _norm, mlp_params, router_params, shared_expert_params
from .memory import _has_hidden_dropout
from .moe_primitives import dispatch_bytes, ep_all_to_all_ms, grouped_gemm_ms
from .types import UNAVAILABLE_MS

PROBS = 4.0          # fp32 router probabilities (megatron-core keeps routing probs in fp32)
# Fitted on the published Megatron-Bridge MoE rows (bench/moe_published.py; docs/costmodel.md "MoE calibration"):
# the fixed time of one MoE layer per micro-batch (forward + backward) beyond the kernels priced above: the host
# and launch overhead of its many small kernels and syncs (router, top-k, aux loss, sort, permute, the dispatcher's
# token-count exchange and device-to-host sync of the split sizes). A third in the forward, two thirds backward.
MOE_LAYER_MS = 5.0


def imbalance(model) -> float:
    """The busiest EP rank's tokens over the even share the cost model prices."""
    e = model.moe
    f = 1.0 if e.moe_router_force_load_balancing else e.moe_imbalance_factor
    return min(f, e.moe_expert_capacity_factor) if e.moe_expert_capacity_factor else f


def ep_members(cluster, ep: int, etp: int) -> int:
    """EP group members per node (stride etp inside a node-aligned stage)."""
    return min(ep, max(1, cluster.nvlink_size // max(etp, 1)))


def tokens_per_expert(model, b: float, s: float, t: int, ep: int, etp: int) -> float:
    """Tokens one local expert computes under force balance: ``etp T k ep / E`` with ``T = b s / t``."""
    e = model.moe
    return etp * (b * s / t) * e.moe_router_topk * ep / e.num_experts


def _experts(src, m_e: float, n_local: int, etp: int, grouped: bool, backward: bool = False,
             lp: bool = False) -> float:
    """fc1 + fc2 of the local experts (grouped GEMM, or one GEMM per expert in sequence). ``lp``: quantized at the
    recipe's low-precision kernels (TE's grouped linear runs the recipe's GEMMs, as the dense linears do) plus the
    casts of their inputs (forward x: m k, backward dy: m n; ``precision.cast_bytes``), as ``_linears``."""
    m = src.model
    k = src.kern_lp if lp else src.kern
    f = m.moe.moe_ffn_hidden_size
    up = 2 * f if m.activation == "swiglu" else f
    h = m.hidden_size
    shapes = ((m_e, up / etp, h), (m_e, h, f / etp))
    if grouped:
        if not backward:
            t = sum(grouped_gemm_ms(k, n_local, *sh) for sh in shapes)
        else:
            t = sum(k.bmm(n_local, *sh, backward=True) for sh in shapes)
    else:
        t = n_local * k.gemm(list(shapes), backward=backward)
    if lp and k is not src.kern:
        n_l = lowp.cast_launches(src.lp)
        t += sum(src.kern.memory(lowp.cast_bytes(src.lp, n_local * mm * (nn if backward else kk), src.dt,
                                                  src.non_tn), n_l)
                 for mm, nn, kk in shapes)
    return t


def _dispatch(src, T: float, ep: int, etp: int, cfg) -> tuple[float, float]:
    """(dispatch, combine) ms of one direction (forward; the backward moves the same volumes)."""
    m, comm, dt = src.model, src.comm, src.dt
    e, h = m.moe, m.hidden_size
    gpn = src.cluster.nvlink_size
    if cfg.token_dispatcher == "allgather":
        n = etp * ep
        if n <= 1:
            return 0.0, 0.0
        inter, members = n > gpn, min(n, gpn)
        full = n * T * (h * dt + e.num_experts * (PROBS + 1))
        return (comm.all_gather(full, n, inter, members),
                comm.reduce_scatter(n * T * h * dt, n, inter, members))
    f = imbalance(m)
    g = ep_members(src.cluster, ep, etp)
    tokens = dispatch_bytes(T, e.moe_router_topk, h, dt)
    d = ep_all_to_all_ms(comm, tokens + T * e.moe_router_topk * PROBS, ep, g, f)
    c = ep_all_to_all_ms(comm, tokens, ep, g, f)
    if etp > 1:        # ETP all-gather after the dispatch, reduce-scatter before the combine
        x = etp * tokens * f
        inter = etp > gpn
        d += comm.all_gather(x, etp, inter)
        c += comm.reduce_scatter(x, etp, inter)
    return d, c


def moe_unit(src, b: float, s: int, t: int, sp: bool, ep: int, etp: int, cfg, overlap: bool = False,
             lp: bool = False):
    """(UnitCost, act bytes (none, selective, full), params per rank, expert params per rank) of one moe unit."""
    from .analytic import UnitCost
    m, dt, k = src.model, src.dt, src.kern
    e, h = m.moe, m.hidden_size
    if t > 1 and not sp:
        raise AcesoError(f"tp ({t}) on an MoE model needs sequence parallelism (megatron-core's MoELayer refuses "
                         "MoE + TP without it); turn sequence_parallel on")
    etp = etp or t
    E, topk = e.num_experts, e.moe_router_topk
    if E % ep:
        raise AcesoError(f"ep ({ep}) must divide num_experts ({E}); use an ep that divides it")
    f, fi = e.moe_ffn_hidden_size, imbalance(m)
    up = 2 * f if m.activation == "swiglu" else f
    T = b * s / t
    n_local = E // ep
    m_e = tokens_per_expert(m, b, s, t, ep, etp) * fi
    # element-wise and router kernels
    ew = 2 * dt * T * h + (3 * dt + 1) * T * h
    score = T * E * (dt + 3 * PROBS + 1)
    perm = (dt * T * h + T * topk * (dt * h + PROBS)) * (1 if cfg.permute_fusion else 2)
    launches = 2 + (2 if cfg.permute_fusion else 6)
    if cfg.token_dispatcher == "allgather":
        perm += dt * T * etp * ep * h * (1 if cfg.permute_fusion else 2)     # the local mask reads all gathered
    act_b = (3 if m.activation == "swiglu" else 2) * dt * m_e * n_local * f / etp
    router = k.gemm([(T, E, h)])
    router_b = k.gemm([(T, E, h)], backward=True)
    ex_f = _experts(src, m_e, n_local, etp, cfg.grouped_gemm, lp=lp)
    ex_b = _experts(src, m_e, n_local, etp, cfg.grouped_gemm, backward=True, lp=lp)
    act_f = k.memory(act_b)
    other_f = router + k.memory(ew + score + perm, launches) + ex_f + act_f + MOE_LAYER_MS / 3
    other_b = router_b + k.memory(1.5 * (ew + score + perm + act_b), launches + 1) + ex_b + 2 * MOE_LAYER_MS / 3
    # the shared expert: a dense MLP half over the attention TP group
    sh_f = sh_b = 0.0
    tpc = None
    fs = e.moe_shared_expert_intermediate_size
    if fs:
        ups = 2 * fs if m.activation == "swiglu" else fs
        col, row = (s * b, ups / t, h), (s * b, h, fs / t)
        tpc = src._half(col, row, b, s, t, sp, overlap)
        sact = (3 if m.activation == "swiglu" else 2) * dt * s * b * fs / t
        sh_f = k.gemm([col, row]) + k.memory(sact)
        sh_b = k.gemm([col, row], backward=True) + k.memory(1.5 * sact)
    d, c = _dispatch(src, T, ep, etp, cfg)
    a2a_f = a2a_b = d + c
    hid_f = hid_b = 0.0
    if fs and cfg.shared_expert_overlap:     # the shared expert beside the dispatch: max(dispatch, shared)
        hid_f, hid_b = min(d, sh_f), min(c, sh_b)
    if cfg.overlap_ep_comm and ep > 1:       # behind the other micro-batch's compute of this unit
        total = a2a_f + a2a_b - hid_f - hid_b
        exposed = max(0.0, total - (other_f + other_b))
        share = exposed / total if total > 0 else 0.0
        hid_f += (a2a_f - hid_f) * (1 - share)
        hid_b += (a2a_b - hid_b) * (1 - share)
    exp_f, exp_b = a2a_f - hid_f, a2a_b - hid_b
    tp_f, tp_b, tp_h, tp_hf = (tpc.fwd, tpc.bwd, tpc.hidden, tpc.hidden_fwd) if tpc else (0.0, 0.0, 0.0, 0.0)
    fwd = other_f + sh_f + exp_f + tp_f
    bwd = other_b + sh_b + exp_b + tp_b
    cost = UnitCost(fwd, bwd, act_f, fwd, tp_f + tp_b, UNAVAILABLE_MS, tp_h, comm_fwd=(tp_f, tp_hf, 0.0, 0.0),
                    ep_comm=exp_f + exp_b, ep_hidden=hid_f + hid_b, ep_fwd=(exp_f, hid_f))
    acts = moe_act_bytes(src, b, s, t, ep, etp, cfg, lp)
    return cost, acts, *moe_params_per_rank(m, t, ep, etp)


def moe_act_bytes(src, b: float, s: int, t: int, ep: int, etp: int, cfg,
                  lp: bool = False) -> tuple[float, float, float, float]:
    """Bytes one moe unit keeps for backward: (none, selective = moe_act, full) and the dispatch transient.

    Kept (T = b s / t tokens, m = etp T k f_i tokens at the experts): the norm input and output (2 dt T h), the
    hidden-dropout mask (T h, with dropout), the router's fp32 probs and scores and the routing map
    (T E (4 + 4 + 1)) and the top-k probs (4 T k), the experts' fc1 input (dt m h), activation input (dt m up /
    etp) and output = fc2 input (dt m f / etp; SwiGLU unfused also the silu output and the linear half, 2 dt m f
    / etp), the expert output the unpermute's probs multiply keeps (dt T k h), and the shared expert's activation
    input and fc2 input (dt b s (up_s + f_s) / t; its fc1 input is the norm output, in SP form). moe_act frees the
    experts' activation output (fc2 input, and the SwiGLU extras); full keeps the unit input (dt T h). The
    transient: the permuted send buffer and (etp > 1) the pre-gather receive buffer, dt T k h each. ``lp`` (a
    quantized unit): the experts' fc1 and fc2 inputs are kept quantized (``precision.act_saving_bytes``), as the
    dense linears' inputs are.
    """
    m, dt = src.model, src.dt
    e, h = m.moe, m.hidden_size
    etp = etp or t
    T = b * s / t
    topk, f = e.moe_router_topk, e.moe_ffn_hidden_size
    up = 2 * f if m.activation == "swiglu" else f
    tok = etp * T * topk * imbalance(m)
    mask = T * h if _has_hidden_dropout(m) else 0.0
    base = 2 * dt * T * h + mask + T * e.num_experts * (2 * PROBS + 1) + PROBS * T * topk
    fc2_in = dt * tok * f / etp
    fused = src.settings.fused_swiglu and src.cluster.gpu.name != "cpu"
    extra = 2 * fc2_in if m.activation == "swiglu" and not fused else 0.0
    experts = dt * tok * h + dt * tok * up / etp + fc2_in + extra + dt * T * topk * h
    fs = e.moe_shared_expert_intermediate_size or 0
    ups = 2 * fs if m.activation == "swiglu" else fs
    shared = dt * s * b * (ups + fs) / t
    none = base + experts + shared
    transient = dt * T * topk * h * (2 if etp > 1 else 1)
    sel = none - fc2_in - extra
    if lp:
        none -= lowp.act_saving_bytes(src.lp, tok * h + tok * f / etp, dt)
        sel -= lowp.act_saving_bytes(src.lp, tok * h, dt)
    return none, sel, dt * T * h, transient


def moe_params_per_rank(model, t: int, ep: int, etp: int) -> tuple[float, float]:
    """(all, expert) parameters of one moe unit on one rank: the norm and router whole (replicated over TP, their
    gradients reduced like the norms'), the shared expert split over the TP group, and E / ep routed experts each
    split over etp."""
    etp = etp or t
    e = model.moe
    expert = e.num_experts // ep * mlp_params(model, e.moe_ffn_hidden_size) / etp
    dense = _norm(model, model.hidden_size) + router_params(model) + shared_expert_params(model) / t
    return dense + expert, expert
