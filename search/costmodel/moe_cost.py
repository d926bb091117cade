"""Analytic time, activations and per-rank parameters of the ``moe`` unit (megatron-core 0.16.1 ``MoELayer``).

One MoE layer's MLP half on one rank, per micro-batch, at per-rank batch b, s tokens (the sequence / cp), tp t,
sequence parallelism (required with t > 1: ``search/settings/moe_plan.py``), expert shape ep x etp, h hidden, E experts,
top-k k, expert width f (up = 2f for the gated SwiGLU and quick-GEGLU), element size dt. Tokens entering the layer
per rank ``T = b s / t`` (SP shards the sequence over the TP group; ``MoELayer.forward`` takes the SP shard as it is).
``f_i`` = ``moe_imbalance_factor`` (1 when force-balanced; capped by ``moe_expert_capacity_factor`` when tokens are
dropped): the busiest EP rank's share over the even one, which the slowest rank (and so the all-to-all) waits on.

    norm + bias-dropout-add   2 dt T h + (3 dt + 1) T h bytes (as the dense MLP unit)
    router (``TopKRouter``)   GEMM (T, E, h); score + top-k memory bound: T E (dt + 3 x 4 + 1) bytes (read the
                              logits, write and re-read the fp32 scores, write the fp32 probs, the bool routing map)
    permute / unpermute       read T h dt, write T k h dt (+ fp32 probs) each way; ``permute_fusion`` one kernel,
                              unfused (``moe_utils.permute`` with ``fused=False``: argsort + index_select + probs
                              gather) twice the bytes in three launches
    dispatch / combine        alltoall: ``moe_primitives.ep_all_to_all_ms`` of T k (h dt + 4) bytes (tokens + their
                              probs: ``token_dispatch``) and T k h dt back (``token_combine``), over the EP
                              group. Placement (assumed, as megatron-core's expert ``RankGenerator`` orders ranks
                              etp-ep-dp inside a node-aligned stage): EP ranks strided by etp, so ``min(ep,
                              nvlink_size // etp)`` of them share a node.
                              flex (``MoEFlexTokenDispatcher``, DeepEP / HybridEP; ``flex_dispatch``): one
                              fused exchange over the etp x ep group, a token once per distinct destination rank
                              and, across nodes, once per distinct destination node (RDMA) fanned out over
                              NVLink there, at the kernels' benchmarked bandwidths
                              (``moe_primitives.flex_all_to_all_ms``); no separate ETP gather; its DeepEP
                              buffer in memory (``flex_buffer_mb``).
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
                              ``moe_primitives.grouped_gemm_ms``; biased experts' fc2 bias and GPT-OSS's clamp
                              (``expert_extra_bytes``); ``grouped_gemm`` off (``SequentialMLP``): one GEMM
                              per local expert, one after another. Under a low-precision recipe (``lp``: a
                              quantized layer) at the recipe's kernels plus the casts of their inputs, as the dense
                              linears (``AnalyticSource._linears``): TE's GroupedLinear runs the recipe's GEMMs,
                              each of inner depth k at (1 + ``GROUPED_K0_LP`` / k) times the tile model (forward k,
                              input gradient n, weight gradient the tokens per expert: ``grouped_gemm_bwd_ms``)
    host                      ``host_layers`` (on the unit table: it needs the layer's attention unit): the
                              dispatcher of a dropless layer copies the token counts to the host and waits for
                              them (megatron-core 0.16.1 ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``
                              before the EP all-to-all; padded to capacity it does not), so the layer's forward
                              is max(device, host); unsynchronised, max over forward + backward; the host time
                              is the layer's kernel launches not captured by a CUDA graph (``host.py``). The
                              launches after the wait hide only behind the unit's forward after the dispatch:
                              ``_before_wait`` (the router, the shared expert unless overlapped, fc1_latent_proj,
                              alltoall's permutation 1, allgather's all-gather) runs before it
    shared expert             ``SharedExpertMLP`` is a dense MLP over the attention TP group (``pg_collection.tp``):
                              all-gather of the SP input, fc1 (b s, up_s/t, h), act, fc2 (b s, h, f_s/t),
                              reduce-scatter, as ``tpcomm.tp_half``. ``shared_expert_overlap``: it runs on its own
                              stream during the dispatch, so the pair costs ``max(dispatch, shared)`` each way
    backward                  every GEMM's two gradient GEMMs, element-wise kernels 1.5x their bytes, the same
                              all-to-all / ETP volumes again (dispatch and combine swap)
    overlap_ep_comm           (``overlap_moe_expert_parallel_comm``: one micro-batch's all-to-all behind the other's
                              compute) priced on the unit table with the layer's attention unit, as megatron-core
                              schedules the pair of layers (``ep_overlap.py``; ``delay_wgrad_compute``: the
                              experts' weight gradients behind the dispatch backward)

LatentMoE (``moe_latent_size`` l, megatron-core 0.19 ``MoELayer``): ``fc1_latent_proj`` (T, l, h) after the router
and ``fc2_latent_proj`` (T, h, l) after the combine, TE linears duplicated over TP on the layer's T tokens (the
``latent`` part; quantized under a low-precision recipe as the dense linears); everything between them runs at
``w = l`` instead of h: permute / unpermute, dispatch / combine (the dispatchers size their buffers by
``moe_latent_size``: megatron-core 0.19 token_dispatcher.py), the ETP gather, the experts' fc1 (m_e, up, w) and fc2
(m_e, w, f), the bias add, the kept fc1 inputs and the transient buffers; fc2_latent_proj keeps its input, dt T l.

Recompute: selective = ``recompute_modules`` ["moe_act"] (the experts' activation re-run: its output, the fc2
input, is not kept); full re-runs the whole unit (its all-to-alls included).
"""

from __future__ import annotations

from search.settings import precision as lowp
from search.io.errors import AcesoError
from ..layers.kind import UnitCost, routed_after
from search.layers.moe_params import (
    _norm, expert_params, expert_width, latent_proj_params, mlp_params, router_params, shared_expert_gate_params,
    shared_expert_params,
)
from .memory import _has_hidden_dropout
from .comm import LINK_EFFICIENCY
from .kernels import GENERATION
from .moe_primitives import (FLEX_NVL_EFF, FLEX_RDMA_EFF, HYBRIDEP_NVL_EFF_BY_SMS, deepep_buffer_bytes,
                             dispatch_bytes, ep_all_to_all_ms, flex_all_to_all_ms, flex_destinations, flex_token_bytes,
                             grouped_gemm_bwd_ms, grouped_gemm_ms)
from .release_constants import value
from .types import UNAVAILABLE_MS

PROBS = 4.0          # fp32 router probabilities (megatron-core keeps routing probs in fp32)


def bias_fc2_bytes(dt: float) -> tuple[float, float]:
    """(forward, backward) bytes per element of the fc2 output that ``TEGroupedMLP._apply_bias`` moves (megatron-core
    0.16.1 moe/experts.py: ``torch.cat([t + b * p for ...]).to(dtype)`` over the local experts' splits, p the fp32
    probs). Forward: b * p written in fp32 (4), t + it (read dt + 4, write 4), the cat (read 4, write 4), the cast
    (read 4, write dt): 24 + 2 dt. Backward (autograd): the cast's (read dt, write 4), the add's gradient of t cast
    back (read 4, write dt), the multiply's two gradients ((g p).sum(0) and (g b).sum(-1): read 4, write 4, reduce
    4, each), the split's cat of t's gradients (read dt, write dt): 32 + 4 dt."""
    return 24.0 + 2.0 * dt, 32.0 + 4.0 * dt


# The clamp of GPT-OSS's quick-GEGLU (``weighted_bias_quick_geglu_impl`` with ``clamp_value``, megatron-core 0.16.1
# fusions/fused_bias_geglu.py): forward the two clamps (read + write dt over m x f each) and the cat of the halves
# (read + write dt over m x 2f): 8 dt per element of m x f; backward each clamp's masked gradient (read the
# gradient and the saved input, write: 3 dt): 6 dt; the cat's backward is views. Bytes per dt per element.
CLAMP_BYTES = (8.0, 6.0)


# Quantized (FP8 / MXFP8) grouped GEMMs: each GEMM of inner depth k costs the tile model's time x (1 + K0 / k),
# a fixed per-tile cost worth K0 of its k loop (TE's GroupedLinear quantizes, scales and, for the weight
# gradient, transposes each expert's operands on its own): ``release_constants.GROUPED_K0_LP``, fitted per release
# on its published MoE rows; bf16 grouped GEMMs take the tile model as it is (a fitted bf16 K0 gains < 0.3 points
# of MAE: not kept).


def syncs(model, settings=None) -> bool:
    """Whether the token dispatcher waits on the device in every forward: megatron-core 0.16.1's dispatchers copy the
    token counts to the host (alltoall: ``_maybe_dtoh_and_synchronize`` before the EP all-to-all; allgather:
    ``.cpu()`` of the local map; flex: the permuted-token count) unless the expert input is padded to capacity
    (``MoESpec.moe_pad_expert_input_to_capacity``, Megatron-LM ``--moe-pad-expert-input-to-capacity``) or, in
    megatron-core 0.19, HybridEP has a per-rank capacity (``MoEPlanSettings.rank_capacity_factor``: the receive
    buffer is sized by it, no host copy)."""
    if settings is not None and settings.rank_capacity_factor is not None:
        return False
    return not model.moe.moe_pad_expert_input_to_capacity


def host_wait_pairs(model) -> tuple[int, ...]:
    """The units whose layer waits on the host (``host_layers``): each routed-experts unit (MoE) whose previous unit
    is its layer's mixer (a kind of role ``attention``: self-attention, MLA, or in a hybrid pattern Mamba-2, ``ME``)."""
    return routed_after(model, lambda k: k.role == "attention")


def host_layers(src, fwd, bwd, rec, ep: int, cfg, scopes: frozenset = frozenset(), lp_of=None, before=None):
    """The host-bound wait of each MoE layer (``host.py``), added to its moe unit's forward in place (and to its
    full recompute, which re-runs the forward); returns the per-unit array of what was added. The layer's device
    time is the unit before (its attention unit, or in a hybrid pattern its Mamba unit: ``ME``) and the moe unit;
    its host time the two units' launches not captured by a CUDA graph of ``scopes``, at the release's
    ``HOST_LAUNCH_MS`` on the cluster's host (``host.launch_ms``). ``before``: each unit's forward ms before the
    dispatcher's wait (``UnitCost.fwd_before_wait``, ``_before_wait``): the launches of the moe unit's rest,
    made after the wait, hide only behind the device time after it, ``fwd - before``."""
    import numpy as np
    from .host import exposed_host_ms, host_launches, launch_ms as host_launch_ms, part_launches
    m = src.model
    units = m.units
    out = np.zeros(len(units))
    launch_ms = host_launch_ms(src.cluster.gpu.name, src.settings.release)
    sync = syncs(m, cfg) and not (cfg is not None and cfg.overlap_ep_comm)
    n_local = m.moe.num_experts // max(ep, 1)
    for i in host_wait_pairs(m):
        u = units[i]
        lp = bool(lp_of(u)) if lp_of else False
        moe = part_launches(m, u.kind, lp, n_local, cfg)
        prev = part_launches(m, units[i - 1].kind, bool(lp_of(units[i - 1])) if lp_of else False, 0)
        parts = {**prev, **moe}
        first = host_launches({"moe_rest": moe["moe_rest"]}, scopes) * launch_ms
        after = fwd[i] - (before[i] if before is not None else 0.0)
        add = exposed_host_ms(host_launches(parts, scopes) * launch_ms, fwd[i - 1] + fwd[i],
                              bwd[i - 1] + bwd[i], sync, first, after)
        fwd[i] += add
        rec[i, 2] += add
        out[i] = add
    return out


def expert_extra_bytes(model, m: float, n_local: int, etp: int, dt: float, grouped: bool) -> list:
    """The experts' element-wise work beyond the fused activation, megatron-core 0.16.1 (``TEGroupedMLP``), for
    ``m`` tokens at this rank's local experts: a list of ((forward, backward) bytes, (forward, backward) launches,
    whether a moe_act recompute re-runs it).

    - fc2 bias (``add_bias_linear`` with grouped GEMM): ``linear_fc2`` has ``skip_bias_add``, and
      ``TEGroupedMLP._apply_bias`` adds the bias per local expert in Python, weighted by the probs: bytes per
      element of the fc2 output (m x h) ``bias_fc2_bytes``; launches 2 per local expert + 2 forward, 6 + 2 backward.
      (fc1's bias is TE GroupedLinear's: the GEMM epilogue, its gradient in the wgrad GEMM; not counted.)
    - clamped quick-GEGLU (``activation_func_clamp_value``, GPT-OSS): ``weighted_bias_quick_geglu_impl``
      (fusions/fused_bias_geglu.py) clamps the gate and linear halves and ``torch.cat``s them before the fused kernel:
      ``CLAMP_BYTES`` per element of m x f / etp, 3 launches forward, 2 backward; inside the activation, so a moe_act
      recompute re-runs it."""
    out = []
    if model.add_bias_linear and grouped:
        fb, bb = bias_fc2_bytes(dt)
        w = expert_width(model)
        out.append(((fb * m * w, bb * m * w), (2 * n_local + 2, 6 * n_local + 2),
                    False))
    if model.activation == "quick_geglu" and model.activation_func_clamp_value is not None:
        f = model.moe.moe_ffn_hidden_size / etp
        out.append(((CLAMP_BYTES[0] * dt * m * f, CLAMP_BYTES[1] * dt * m * f), (3, 2), True))
    return out


def imbalance(model) -> float:
    """The busiest EP rank's tokens over the even share the cost model prices."""
    e = model.moe
    f = 1.0 if e.moe_router_force_load_balancing else e.moe_imbalance_factor
    return min(f, e.moe_expert_capacity_factor) if e.moe_expert_capacity_factor else f


def imbalance_note(model) -> str | None:
    """One line when learned routing is priced as even (``moe_imbalance_factor`` 1, no capacity to bound it): the
    published learned-routing twins of force-balanced runs measured 4-20% lower throughput (docs/moe.md)."""
    e = model.moe
    if e is None or e.moe_router_force_load_balancing or e.moe_imbalance_factor != 1.0 or \
            e.moe_expert_capacity_factor is not None:
        return None
    return ("MoE routing is learned and priced as evenly balanced (moe.moe_imbalance_factor 1); published "
            "learned-routing runs measured 4-20% below their force-balanced twins: set moe_imbalance_factor in a spec "
            "to price your router's imbalance (docs/moe.md, 'Routing and load balance')")


def ep_members(cluster, ep: int, etp: int) -> int:
    """EP group members per node (stride etp inside a node-aligned stage)."""
    return min(ep, max(1, cluster.nvlink_size // max(etp, 1)))


def tokens_per_expert(model, b: float, s: float, t: int, ep: int, etp: int) -> float:
    """Tokens one local expert computes under force balance: ``etp T k ep / E`` with ``T = b s / t``."""
    e = model.moe
    return etp * (b * s / t) * e.moe_router_topk * ep / e.num_experts


_FC = ("mlp.experts.linear_fc1", "mlp.experts.linear_fc2")     # MOE.linears: the routed experts' fc1 and fc2
_LATENT = ("mlp.fc1_latent_proj", "mlp.fc2_latent_proj")       # LatentMoE's projections


def _experts(src, m_e: float, n_local: int, etp: int, grouped: bool, backward: bool = False,
             lp=False) -> float:
    """fc1 + fc2 of the local experts (grouped GEMM, or one GEMM per expert in sequence). ``lp``: quantized at the
    recipe's low-precision kernels (TE's grouped linear runs the recipe's GEMMs, as the dense linears do) plus the
    casts of their inputs (forward x: m k, backward dy: m n; ``precision.cast_bytes``), as ``_linears``."""
    m = src.model
    r1, r2 = (src.recipe_of(lp, n) for n in _FC)
    if r1 != r2:            # per-module recipes: fc1 and fc2 each at its own
        return sum(_experts_one(src, m_e, n_local, etp, grouped, backward, r, i) for i, r in enumerate((r1, r2)))
    return _experts_one(src, m_e, n_local, etp, grouped, backward, r1)


def _experts_one(src, m_e: float, n_local: int, etp: int, grouped: bool, backward: bool, rec: str | None,
                 which: int | None = None) -> float:
    """``_experts`` with one recipe ``rec`` (None: bf16) for fc1 and fc2, or for fc1 / fc2 alone (``which``)."""
    m = src.model
    k = src.kern_of(rec)
    f = m.moe.moe_ffn_hidden_size
    up = 2 * f if m.gated_mlp else f       # SwiGLU and GPT-OSS's quick-GEGLU: fc1 is the gate and linear halves
    h = expert_width(m)
    shapes = ((m_e, up / etp, h), (m_e, h, f / etp))
    shapes = shapes if which is None else (shapes[which],)
    lp = rec is not None
    k0 = value("GROUPED_K0_LP", src.settings.release) if lp and k is not src.kern else 0.0
    if grouped:
        if not backward:
            t = sum(grouped_gemm_ms(k, n_local, *sh, k0) for sh in shapes)
        else:
            t = sum(grouped_gemm_bwd_ms(k, n_local, *sh, k0) for sh in shapes)
    else:
        t = n_local * k.gemm(list(shapes), backward=backward)
    if lp and k is not src.kern:
        n_l = lowp.cast_launches(rec)
        t += sum(src.kern.memory(lowp.cast_bytes(rec, n_local * mm * (nn if backward else kk), src.dt,
                                                  src.non_tn), n_l)
                 for mm, nn, kk in shapes)
    return t


def _dispatch(src, T: float, ep: int, etp: int, cfg) -> tuple[float, float]:
    """(dispatch, combine) ms of one direction (forward; the backward moves the same volumes)."""
    m, comm, dt = src.model, src.comm, src.dt
    e, h = m.moe, expert_width(m)
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
    if cfg.token_dispatcher == "flex":
        return flex_dispatch(src, T, ep, etp, f, cfg.flex_backend, cfg.hybridep_num_sms)
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


def flex_dispatch(src, T: float, ep: int, etp: int, f: float, backend: str = "deepep",
                  hybridep_sms: int | None = None) -> tuple[float, float]:
    """(dispatch, combine) ms of the flex dispatcher (DeepEP / HybridEP, ``MoEFlexTokenDispatcher``): one fused
    exchange over the etp x ep group (``tp_ep_group``; each token goes to every ETP rank of its experts, so there
    is no separate ETP all-gather / reduce-scatter), sent once per distinct destination rank and, across nodes,
    once per distinct destination node, fanned out over NVLink there (``moe_primitives.flex_all_to_all_ms``).
    Group members per node ``min(etp ep, nvlink_size)`` (ETP innermost, EP strided by etp: ``ep_members``).
    HybridEP on Blackwell runs at its published rate for ``hybridep_sms`` (16 or 32, ``HYBRIDEP_NVL_EFF_BY_SMS``),
    else at the release's (its default SM count as calibrated); elsewhere its SM count has no published rate."""
    m, comm, dt = src.model, src.comm, src.dt
    e, h = m.moe, expert_width(m)
    etp = max(etp, 1)
    n = etp * ep
    if n <= 1:
        return 0.0, 0.0
    g_ep = ep_members(src.cluster, ep, etp)          # EP ranks per node
    r_ep, nodes = flex_destinations(e.num_experts, e.moe_router_topk, ep, g_ep, e.moe_router_num_groups,
                                    e.moe_router_group_topk)
    g = min(n, src.cluster.nvlink_size)
    k = e.moe_router_topk
    gen = GENERATION.get(src.cluster.gpu.name)
    nvl = FLEX_NVL_EFF.get(gen, LINK_EFFICIENCY)
    if backend == "hybridep" and gen == "blackwell":    # HybridEP's own kernels: their rate per release
        nvl = (HYBRIDEP_NVL_EFF_BY_SMS[hybridep_sms] if hybridep_sms else
               value("HYBRIDEP_NVL_EFF", src.settings.release))
    eff = {"nvl_eff": nvl, "rdma_eff": FLEX_RDMA_EFF}
    d = flex_all_to_all_ms(comm, T, flex_token_bytes(h, dt, k), r_ep * etp, nodes, n, g, f, **eff)
    c = flex_all_to_all_ms(comm, T, flex_token_bytes(h, dt, k, dispatch=False), r_ep * etp, nodes, n, g, f, **eff)
    return d, c


def flex_buffer_mb(model, moe_settings, ep: int, etp: int, dt: float) -> float:
    """MB of the flex dispatcher's communication buffer on a rank whose stage holds an MoE layer: one DeepEP
    ``Buffer`` per process (``fused_a2a._buffer``, allocated at the first dispatch for the etp x ep group and
    reused by every layer), ``num_nvl_bytes + num_rdma_bytes`` as ``fused_a2a.get_buffer`` sizes it for
    ``hidden_bytes = h x max(dt, 2)`` (``moe_primitives.deepep_buffer_bytes``). 0 for the other dispatchers and
    for a group of one (megatron-core requires etp x ep > 1 for flex). HybridEP's buffer (sized by tokens per
    rank and local experts) is priced as DeepEP's (``MoEPlanSettings.flex_backend`` names it; not priced apart yet)."""
    if model.moe is None or moe_settings is None or moe_settings.token_dispatcher != "flex":
        return 0.0
    n = max(etp, 1) * ep
    if n <= 1:
        return 0.0
    nvl, rdma = deepep_buffer_bytes(n, int(expert_width(model) * max(dt, 2)))
    return (nvl + rdma) / 2 ** 20


def moe_parts(src, b: float, s: int, t: int, sp: bool, ep: int, etp: int, cfg, overlap: bool = False,
              lp: bool = False) -> dict:
    """The moe unit's time by stage, each a (forward, backward) ms pair of one micro-batch (``moe_unit`` sums
    them; ``bench/moe_published.py --breakdown`` prints them): ``router`` (router GEMM, norm, bias-dropout-add,
    score / top-k, permute / unpermute), ``latent`` (LatentMoE's two projections), ``experts`` (the grouped GEMMs and the activation), ``a2a`` (exposed
    dispatch / combine), ``shared`` (the shared expert's compute), ``tp`` (its exposed TP collectives); with
    ``hidden`` = the all-to-all hidden behind compute and ``tpc`` the shared expert's ``tpcomm`` result (None
    without one). The host-bound wait (``host_layers``) is added per layer to the unit table."""
    m, dt, k = src.model, src.dt, src.kern
    e, h = m.moe, m.hidden_size
    if t > 1 and not sp:
        raise AcesoError(f"tp ({t}) on an MoE model needs sequence parallelism (megatron-core's MoELayer refuses "
                         "MoE + TP without it); turn sequence_parallel on")
    etp = etp or t
    E, topk = e.num_experts, e.moe_router_topk
    if E % ep:
        raise AcesoError(f"ep ({ep}) must divide num_experts ({E}); use an ep that divides it")
    f, fi, w = e.moe_ffn_hidden_size, imbalance(m), expert_width(m)
    T = b * s / t
    n_local = E // ep
    m_e = tokens_per_expert(m, b, s, t, ep, etp) * fi
    # element-wise and router kernels
    ew = 2 * dt * T * h + (3 * dt + 1) * T * h
    gate_k, logit_dt, cast = k, dt, 0.0
    if cfg.router_dtype:              # moe_router_dtype: the gating GEMM and logits in fp32 / fp64 (router_gemm)
        gate_k, logit_dt = src.kern_wide(cfg.router_dtype), (4.0 if cfg.router_dtype == "fp32" else 8.0)
        cast = (dt + logit_dt) * T * h     # the input's cast to the router's dtype
    # score / top-k: read the logits, write and re-read the fp32 scores, write the probs and the map;
    # moe_router_fusion (TE's fused router kernels): the scores are not written and re-read
    score = T * E * (logit_dt + (1 if cfg.router_fusion else 3) * PROBS + 1) + cast
    perm = (dt * T * w + T * topk * (dt * w + PROBS)) * (1 if cfg.permute_fusion else 2)
    launches = 2 + (2 if cfg.permute_fusion else 6)
    if cfg.token_dispatcher == "allgather":
        perm += dt * T * etp * ep * w * (1 if cfg.permute_fusion else 2)     # the local mask reads all gathered
    act_b = (3 if m.gated_mlp else 2) * dt * m_e * n_local * f / etp
    ex_extra = expert_extra_bytes(m, m_e * n_local, n_local, etp, dt, cfg.grouped_gemm)
    router_f = gate_k.gemm([(T, E, h)]) + k.memory(ew + score + perm, launches)
    router_b = gate_k.gemm([(T, E, h)], backward=True) + k.memory(1.5 * (ew + score + perm), launches)
    ex_f = _experts(src, m_e, n_local, etp, cfg.grouped_gemm, lp=lp) + k.memory(act_b)
    ex_b = _experts(src, m_e, n_local, etp, cfg.grouped_gemm, backward=True, lp=lp) + k.memory(1.5 * act_b)
    for nbytes, launches, recomputed in ex_extra:
        ex_f += k.memory(nbytes[0], launches[0])
        ex_b += k.memory(nbytes[1], launches[1])
    act_rec = k.memory(act_b) + sum(k.memory(nb[0], ln[0]) for nb, ln, rec in ex_extra if rec)
    lat = ((T, e.moe_latent_size, h), (T, h, e.moe_latent_size)) if e.moe_latent_size else ()
    lat_f, lat_b = src._linears(list(lat), lp, _LATENT) if lat else (0.0, 0.0)
    # the shared expert: a dense MLP half over the attention TP group
    sh_f = sh_b = 0.0
    tpc = None
    fs = e.moe_shared_expert_intermediate_size
    if fs:
        ups = 2 * fs if m.gated_mlp else fs
        col, row = (s * b, ups / t, h), (s * b, h, fs / t)
        tpc = src._half(col, row, b, s, t, sp, overlap)
        sact = (3 if m.gated_mlp else 2) * dt * s * b * fs / t
        sh_f = k.gemm([col, row]) + k.memory(sact)
        sh_b = k.gemm([col, row], backward=True) + k.memory(1.5 * sact)
    d, c = _dispatch(src, T, ep, etp, cfg)
    a2a_f = a2a_b = d + c
    hid_f = hid_b = 0.0
    if fs and cfg.shared_expert_overlap:     # the shared expert beside the dispatch: max(dispatch, shared)
        hid_f, hid_b = min(d, sh_f), min(c, sh_b)
    pre = _before_wait(src, gate_k, T, E, h, score, perm, cfg, lat, lp, sh_f, tpc, d - hid_f)
    # the EP overlap (overlap_ep_comm) needs the layer's attention unit too: ep_overlap.py, on the unit table
    tp_p = (tpc.fwd, tpc.bwd) if tpc else (0.0, 0.0)
    wgrad = _experts_wgrad(src, m_e, n_local, etp, lp) + (k.gemm_parts(*col)[2] + k.gemm_parts(*row)[2] if fs else 0.0)
    return {"router": (router_f, router_b), "latent": (lat_f, lat_b), "experts": (ex_f, ex_b), "a2a": (a2a_f - hid_f, a2a_b - hid_b),
            "shared": (sh_f, sh_b), "tp": tp_p, "hidden": (hid_f, hid_b), "tpc": tpc,
            "act_f": act_rec, "split": (d, c), "wgrad": wgrad, "before_wait": pre}


def _before_wait(src, gate_k, T: float, E: int, h: int, score: float, perm: float, cfg, lat, lp: bool,
                 sh_f: float, tpc, d_exposed: float) -> float:
    """Forward ms of the moe unit before its dispatcher's host wait (``host_layers``: what the device runs before
    the CPU can launch the rest). megatron-core ``MoELayer.forward`` (0.16.1 and 0.19 moe_layer.py
    ``custom_forward``) runs ``shared_experts_compute`` (the shared expert unless ``moe_shared_expert_overlap``),
    ``route`` and ``preprocess`` (LatentMoE's ``fc1_latent_proj``, the dispatcher's ``dispatch_preprocess``) before
    ``dispatch``. Of the ``router`` part: the pre-MLP norm (its 2 dt T h bytes, one launch), the gating GEMM
    and the score / top-k; not the bias-dropout-add. Where the wait is: alltoall before the EP all-to-all, after
    permutation 1 (token_dispatcher.py ``dispatch_preprocess``: ``_maybe_dtoh_and_synchronize("before_permutation_1")``
    copies, the dropless sync point is ``before_ep_alltoall``): half the permute / unpermute bytes and launches;
    flex inside the dispatch, before the exchange (HybridEP sizes its buffers with a CPU sync in
    ``hybrid_ep_dispatch``; DeepEP's dispatch waits on the host for the received counts), the permute fused after
    it; allgather at the ``.cpu()`` of the local map in ``dispatch_postprocess``, after the all-gather (its
    exposed part ``d_exposed`` counts)."""
    k = src.kern
    dt = src.dt
    half = cfg.token_dispatcher == "alltoall"
    perm_launches = 2 if cfg.permute_fusion else 6
    router = gate_k.gemm([(T, E, h)]) + k.memory(2 * dt * T * h + score + (perm / 2 if half else 0.0),
                                                 1 + (perm_launches // 2 if half else 0))
    latent = src._linears([lat[0]], lp, _LATENT[:1])[0] if lat else 0.0
    shared = 0.0 if cfg.shared_expert_overlap else sh_f + (tpc.fwd if tpc else 0.0)
    gathered = d_exposed if cfg.token_dispatcher == "allgather" else 0.0
    return router + latent + shared + gathered


def _experts_wgrad(src, m_e: float, n_local: int, etp: int, lp) -> float:
    """The local experts' weight-gradient grouped GEMMs (``grouped_gemm_bwd_ms``'s second term): what
    ``delay_wgrad_compute`` moves behind the dispatch backward (``ep_overlap.py``); each at its linear's recipe."""
    m = src.model
    f = m.moe.moe_ffn_hidden_size
    up = 2 * f if m.gated_mlp else f
    h = expert_width(m)
    out = 0.0
    for (n, k), name in zip(((up / etp, h), (h, f / etp)), _FC):
        kern = src.kern_of(src.recipe_of(lp, name))
        k0 = value("GROUPED_K0_LP", src.settings.release) if kern is not src.kern else 0.0
        out += grouped_gemm_ms(kern, n_local, k, n, m_e, k0)
    return out


TIME_PARTS = ("router", "latent", "experts", "a2a", "shared", "tp")


def moe_unit(src, b: float, s: int, t: int, sp: bool, ep: int, etp: int, cfg, overlap: bool = False,
             lp: bool = False):
    """(UnitCost, act bytes (none, selective, full), params per rank, expert params per rank) of one moe unit."""
    parts = moe_parts(src, b, s, t, sp, ep, etp, cfg, overlap, lp)
    fwd = sum(parts[n][0] for n in TIME_PARTS)
    bwd = sum(parts[n][1] for n in TIME_PARTS)
    (exp_f, exp_b), (hid_f, hid_b), tpc = parts["a2a"], parts["hidden"], parts["tpc"]
    tp_f, tp_b, tp_h, tp_hf = (tpc.fwd, tpc.bwd, tpc.hidden, tpc.hidden_fwd) if tpc else (0.0, 0.0, 0.0, 0.0)
    cost = UnitCost(fwd, bwd, parts["act_f"], fwd, tp_f + tp_b, UNAVAILABLE_MS, tp_h,
                    comm_fwd=(tp_f, tp_hf, 0.0, 0.0), ep_comm=exp_f + exp_b, ep_hidden=hid_f + hid_b,
                    ep_fwd=(exp_f, hid_f), ep_split=(*parts["split"], parts["wgrad"]),
                    fwd_before_wait=parts["before_wait"])
    acts = moe_act_bytes(src, b, s, t, ep, etp, cfg, lp)
    return cost, acts, *moe_params_per_rank(src.model, t, ep, etp)


def moe_act_bytes(src, b: float, s: int, t: int, ep: int, etp: int, cfg,
                  lp: bool = False) -> tuple[float, float, float, float]:
    """Bytes one moe unit keeps for backward: (none, selective = moe_act, full) and the dispatch transient.

    Kept (T = b s / t tokens, m = etp T k f_i tokens at the experts), as megatron-core 0.16.1's ``MoELayer`` keeps
    them: the norm input and output (2 dt T h; the router's ``RouterGatingLinearFunction`` saves the same norm
    output, in its own dtype), the hidden-dropout mask (T h, with dropout), the router's fp32 probs and scores and
    the routing map (T E (4 + 4 + 1)) and the top-k probs (4 T k), the experts' fc1 input (dt m h, saved by TE's
    ``GroupedLinear``), activation input (dt m up / etp) and the permuted probs it weights by (4 m: the routing
    probs are applied inside the experts' activation, ``TEGroupedMLP.bias_act_func`` / ``weighted_bias_swiglu_impl``
    and ``weighted_bias_quick_geglu_impl``, which save their input and the probs), its output = the fc2 input
    (dt m f / etp; unfused, the probs multiply saves its other operand: gelu, which has no fused weighted kernel,
    its activation output, dt m f / etp, unless ``fused_weighted_squared_relu`` with grouped GEMM on a GPU:
    ``TEGroupedMLP``'s fused squared ReLU saves its input and the probs only; gated on the cpu "GPU" the gate's activation output, the (x_linear +
    offset) copy the gate multiply keeps and the gated product, 3 dt m f / etp: tests/runtime/test_moe_act_memory.py
    measures megatron-core's layer), and the shared
    expert's activation input and fc2 input (dt b s (up_s + f_s) / t; its fc1 input is the norm output, in SP
    form). Nothing after fc2: the token dispatchers call ``unpermute`` without probs, and
    its backward (TE ``moe_unpermute`` or the unfused ``scatter_add``) keeps only the row map, the all-to-alls
    nothing. moe_act frees the experts' activation output (fc2 input, and the unfused extras); full keeps the unit
    input (dt T h). The transient: the permuted send buffer and (etp > 1) the pre-gather receive buffer, dt T k h
    each. ``lp`` (a quantized unit): the experts' fc1 and fc2 inputs are kept quantized
    (``precision.act_saving_bytes``), as the dense linears' inputs are.
    """
    m, dt = src.model, src.dt
    e, h, w = m.moe, m.hidden_size, expert_width(m)
    etp = etp or t
    T = b * s / t
    topk, f = e.moe_router_topk, e.moe_ffn_hidden_size
    up = 2 * f if m.gated_mlp else f
    tok = etp * T * topk * imbalance(m)
    mask = T * h if _has_hidden_dropout(m) else 0.0
    base = 2 * dt * T * h + mask + T * e.num_experts * (2 * PROBS + 1) + PROBS * T * topk
    fc2_in = dt * tok * f / etp
    fused = src.settings.fused_swiglu and src.cluster.gpu.name != "cpu"
    # the unfused activation (gelu always: TEGroupedMLP fuses only the gated ones) keeps what its probs multiply
    # saves, the activation output; gated also the gate's activation output and the (x_linear + offset) copy
    extra = fc2_in if not m.gated_mlp else (3 * fc2_in if not fused else 0.0)
    if m.activation == "squared_relu" and cfg.fused_weighted_squared_relu and cfg.grouped_gemm and \
            src.cluster.gpu.name != "cpu":
        extra = 0.0         # TEGroupedMLP's weighted_squared_relu_impl saves its input and the probs only
    experts = dt * tok * w + dt * tok * up / etp + PROBS * tok + fc2_in + extra
    latent = dt * T * e.moe_latent_size if e.moe_latent_size else 0.0     # fc2_latent_proj's input
    fs = e.moe_shared_expert_intermediate_size or 0
    ups = 2 * fs if m.gated_mlp else fs
    shared = dt * s * b * (ups + fs) / t
    none = base + experts + shared + latent
    transient = dt * T * topk * w * (2 if etp > 1 else 1)
    sel = none - fc2_in - extra
    r1, r2 = (src.recipe_of(lp, n) for n in _FC)
    if r1 == r2 and r1 is not None:
        none -= lowp.act_saving_bytes(r1, tok * w + tok * f / etp, dt)
        sel -= lowp.act_saving_bytes(r1, tok * w, dt)
    elif r1 != r2:          # per-module recipes: each expert linear's input kept in its own
        none -= (lowp.act_saving_bytes(r1 or "bf16", tok * w, dt) +
                 lowp.act_saving_bytes(r2 or "bf16", tok * f / etp, dt))
        sel -= lowp.act_saving_bytes(r1 or "bf16", tok * w, dt)
    return none, sel, dt * T * h, transient


def moe_params_per_rank(model, t: int, ep: int, etp: int) -> tuple[float, float]:
    """(all, expert) parameters of one moe unit on one rank: the norm and router whole (replicated over TP, their
    gradients reduced like the norms'), the shared expert's MLP split over the TP group and its sigmoid gate whole
    (``SharedExpertMLP.gate_weight``, (1, h) on every TP rank), and E / ep routed experts each split over etp;
    LatentMoE's projections whole (TE ``parallel_mode="duplicated"``)."""
    etp = etp or t
    e = model.moe
    expert = e.num_experts // ep * expert_params(model) / etp
    gate = shared_expert_gate_params(model)
    dense = (_norm(model, model.hidden_size) + router_params(model) + latent_proj_params(model)
             + (shared_expert_params(model) - gate) / t + gate)
    return dense + expert, expert
