"""Cost primitives of an MoE layer: expert-parallel all-to-all and grouped-GEMM time (issue 22, part 5).

The pure formulas the MoE cost model (``moe_cost.py``) is built on, each tested against hand-computed cases
(tests/unit/test_moe_primitives.py).

**Dispatch / combine all-to-all** (megatron-core's alltoall token dispatcher). Each EP rank sends
``B = tokens x topk x h x dt`` bytes per direction (one copy of a token per routed expert). Under force-balanced
routing the copies spread evenly over the ``ep`` ranks: ``B / ep`` stays on the rank, ``B (g - 1) / ep`` goes to the
other ``g - 1`` group members in its node over NVLink, ``B (ep - g) / ep`` leaves the node through the GPU's own NIC
(one NIC per GPU, as ``comm.py`` assumes). The two paths run concurrently (NCCL posts every send/recv of the
all-to-all in one group), so

    T = alpha + f x max(B (g - 1) / ep / bw_intra, B (ep - g) / ep / bw_inter)

with ``alpha`` the latency of the slowest link kind crossed (``comm.ALPHA_INTRA_MS`` / ``ALPHA_INTER_MS``, one per
call: the sends are grouped, not sequential), the bandwidths ``comm.CommModel``'s (datasheet x ``LINK_EFFICIENCY``)
and ``f`` the imbalance factor (the busiest rank's tokens over the even share; 1 when force-balanced). An NVL72 rack
is one 72-GPU node in ``ClusterSpec`` terms, so an EP group inside it never takes the network term.

**Grouped GEMM** (``--moe-grouped-gemm``: one kernel for all local experts, CUTLASS grouped GEMM / TE GroupedLinear,
whose persistent scheduler deals the tiles of every group over the SMs together). Its time is ``ShapeKernels``' GEMM
model (NVIDIA DU-09799-001 tile and wave quantization, roofline against HBM, kernels.py) applied to ``groups`` GEMMs
of ``(tokens_per_expert, n, k)`` in one launch: a small per-expert batch wastes most of each 128-row output tile
(``tile_util = m / 128`` for ``m < 128``) and, once its intensity ``2 m n k / (dt (m k + k n + m n))`` falls below
peak / HBM bandwidth, is bound by reading every expert's weights from HBM. Efficiency = ``2 groups m n k / peak`` over that time.
A quantized grouped GEMM (FP8 / MXFP8: TE's GroupedLinear quantizing each expert's operands) adds a fixed cost per
output tile worth ``k0`` of its k loop, ``x (1 + k0 / k)`` with k each GEMM's own inner depth (the weight gradient's
is the tokens per expert): ``moe_cost.GROUPED_K0_LP``, fitted (docs/costmodel.md "MoE calibration").

**Flex dispatch / combine** (``--moe-token-dispatcher-type flex``: DeepEP's normal kernels, HybridEP; megatron-core
0.16.1 ``MoEFlexTokenDispatcher`` over the etp x ep group, ``fused_a2a.py``). A token is sent once per distinct
destination *rank* (DeepEP ``is_token_in_rank``; not once per routed expert), and across nodes once per distinct
destination *node*: DeepEP's internode kernels (``csrc/kernels/legacy/internode.cu``) put it over RDMA to the GPU of
the same local index in each destination node, which forwards it over NVLink to the node's destination ranks
(combine: the reverse, reduced in the node before the RDMA send). HybridEP does the same with the NVLink domain
(an NVL72 rack) as the node. Under balanced routing (``hit_probability``: a token's k experts uniform over the
experts, or, with group-limited routing, M of G groups uniform, k / M experts in each) with R the
expected distinct destination ranks and D the expected distinct destination nodes of a token, over N nodes of g
group members each, one rank of T tokens of ``b`` bytes moves

    NIC (RDMA)   T D (N - 1) / N b       (the destination nodes other than its own)
    NVLink       T R (g - 1) / g b       (as forwarder: the node's share of every peer's tokens, to its g - 1 peers)

concurrently (DeepEP pipelines RDMA and NVLink chunks), so ``T = alpha + f max(NIC / bw_inter, NVLink /
bw_intra)``: ``flex_all_to_all_ms``. The bandwidths are the kernels' own, from their published benchmarks
(``FLEX_NVL_EFF``, ``FLEX_RDMA_EFF``: achieved fraction of the datasheet link, applied as ``comm.CommModel``'s
bandwidth x eff / ``LINK_EFFICIENCY`` so a calibrated link scales them too).
"""

from __future__ import annotations

from math import comb

from .comm import ALPHA_INTER_MS, ALPHA_INTRA_MS, LINK_EFFICIENCY, CommModel

# Achieved fraction of the datasheet unidirectional link bandwidth of the flex kernels, per GPU generation
# (docs/costmodel.md "flex"), from the published kernel benchmarks, as bytes over the link (a rank's copies to
# itself taken out of the benchmarks' received bytes, x (n - 1) / n):
# - NVLink, Hopper: DeepEP V1 normal intranode kernels, H800 EP 8, 153 GB/s dispatch / 158 combine received
#   (deepseek-ai/DeepEP docs/legacy.md "Performance"; tests/legacy/test_intranode.py counts recv_x bytes) x 7/8
#   over H800's 200 GB/s: 0.67 (dispatch; combine 0.69).
# - NVLink, Blackwell: HybridEP on GB200 NVL72, 16 SMs (megatron-core's moe_hybridep_num_sms default), BF16,
#   Torch API, 8-36 ranks (DeepEP hybrid-ep branch docs/README_Hybrid-EP.md): dispatch 550 / 473 / 442 / 486 /
#   470, combine 538 / 474 / 444 / 423 / 418 GB/s, x (n - 1) / n over 900 GB/s: median 0.49 (0.45-0.53); its B200
#   8-rank row (536 / 531) gives 0.52.
# - RDMA: DeepEP V1 normal internode kernels, H800 + CX7 400 Gb/s (50 GB/s), EP 32 over 4 nodes: 58 GB/s dispatch
#   (57 combine) of RDMA tokens counted once per destination node *including its own* (test_internode.py
#   ``num_rdma_token_sent``) x 3/4 remote: 0.87 (EP 64 over 8 nodes: 51 x 7/8 / 50 = 0.89).
# Other generations (no benchmark in the sources): the link model's LINK_EFFICIENCY.
FLEX_NVL_EFF = {"hopper": 0.67, "blackwell": 0.49}
FLEX_RDMA_EFF = 0.87
# HybridEP at its own default SM count, 32 (deepseek-ai/DeepEP hybrid-ep ``HybridEPBuffer.__init__``:
# ``num_sms_dispatch_api = num_sms_combine_api = 32``), which megatron-core 0.17+ leaves it (``moe_flex_dispatcher_num_sms``
# None: "each backend uses its own default"; 0.16 passed ``moe_hybridep_num_sms`` = 16) and Megatron-Bridge's performance
# recipes set (``_benchmark_common``: ``moe_hybridep_num_sms = 32``). Its GB200 NVL72 benchmark at 32 SMs, BF16, Torch
# API, 8 / 16 / 24 / 32 / 36 ranks (docs/README_Hybrid-EP.md): dispatch 545.71 / 523.48 / 507.32 / 484.22 / 479.02,
# combine 568.94 / 521.55 / 483.76 / 464.54 / 447.89 GB/s, x (n - 1) / n over 900 GB/s: median 0.53 (0.48-0.55)
HYBRIDEP_32SM_NVL = {8: (545.71, 568.94), 16: (523.48, 521.55), 24: (507.32, 483.76), 32: (484.22, 464.54),
                     36: (479.02, 447.89)}
HYBRIDEP_32SM_NVL_EFF = 0.53
# HybridEP's NVLink rate on Blackwell by its SM count (``settings.moe.hybridep_num_sms``): the two published benchmarks
# above (16 SMs: FLEX_NVL_EFF's Blackwell row; 32 SMs); no other SM count has a published number
HYBRIDEP_NVL_EFF_BY_SMS = {16: FLEX_NVL_EFF["blackwell"], 32: HYBRIDEP_32SM_NVL_EFF}


def dispatch_bytes(tokens: float, topk: int, hidden: int, dt: float) -> float:
    """Bytes one EP rank sends in one dispatch (and receives back in one combine)."""
    return tokens * topk * hidden * dt


def ep_all_to_all_ms(comm: CommModel, nbytes: float, ep: int, members_per_node: int,
                     imbalance: float = 1.0) -> float:
    """One dispatch (or combine) all-to-all over an EP group of ``ep`` ranks, ``members_per_node`` of them in each
    node (``ep`` when the group fits in one node); ``nbytes`` = ``dispatch_bytes`` of one rank."""
    if ep <= 1 or nbytes <= 0:
        return 0.0
    g = min(max(members_per_node, 1), ep)
    t_intra = nbytes * (g - 1) / ep / (comm.intra_gbps * 1e6)
    t_inter = nbytes * (ep - g) / ep / (comm.inter_gbps * 1e6) if ep > g else 0.0
    alpha = ALPHA_INTER_MS if ep > g else ALPHA_INTRA_MS
    return alpha + imbalance * max(t_intra, t_inter)


def ep_group_all_to_all_ms(comm: CommModel, nbytes: float, first_rank: int, stride: int, ep: int,
                           imbalance: float = 1.0) -> float:
    """``ep_all_to_all_ms`` for the group ``first_rank + i * stride`` (i < ep) placed on ``comm``'s cluster."""
    members = comm.members_per_node(first_rank, stride, ep)
    return ep_all_to_all_ms(comm, nbytes, ep, members, imbalance)


def grouped_gemm_ms(kernels, groups: int, tokens_per_expert: float, n: int, k: int, k0: float = 0.0) -> float:
    """Forward time of one grouped GEMM: ``groups`` experts, each ``(tokens_per_expert x k) @ (k x n)``
    (``kernels``: a ``ShapeKernels``), each output tile's fixed cost worth ``k0`` of its k loop: ``bmm x (1 + k0 /
    k)`` (``moe_cost.GROUPED_K0_LP`` for quantized experts, 0 in bf16)."""
    if groups <= 0 or tokens_per_expert <= 0:
        return 0.0
    return kernels.bmm(groups, tokens_per_expert, n, k) * (1 + k0 / k)


def grouped_gemm_bwd_ms(kernels, groups: int, tokens_per_expert: float, n: int, k: int, k0: float = 0.0) -> float:
    """Backward of that grouped GEMM: the input gradient ``(m, k, n)`` (inner n) and the weight gradient
    ``(k, n, m)`` (inner m = the tokens per expert), each with its own ``1 + k0 / inner``."""
    if groups <= 0 or tokens_per_expert <= 0:
        return 0.0
    m = tokens_per_expert
    return kernels.bmm(groups, m, k, n) * (1 + k0 / n) + kernels.bmm(groups, k, n, m) * (1 + k0 / m)


def grouped_gemm_efficiency(kernels, groups: int, tokens_per_expert: float, n: int, k: int) -> float:
    """Achieved fraction of the dtype's peak of that grouped GEMM."""
    t = grouped_gemm_ms(kernels, groups, tokens_per_expert, n, k)
    return 2.0 * groups * tokens_per_expert * n * k / kernels.peak / t if t else 0.0


def _miss(pool: int, block: int, k: int) -> float:
    """P(none of k distinct experts drawn uniformly from ``pool`` falls in a given ``block`` of them)."""
    if block >= pool:
        return 0.0
    return comb(pool - block, k) / comb(pool, k) if pool - block >= k else 0.0


def hit_probability(num_experts: int, topk: int, block: int, groups: int | None = None,
                    group_topk: int | None = None) -> float:
    """P(a token's top-k experts include at least one of an aligned block of ``block`` consecutive experts: one EP
    rank's local experts, or one node's), under balanced routing (router scores i.i.d. over the experts).

    Plain top-k: the k experts uniform over the E: ``1 - C(E - block, k) / C(E, k)``. Group-limited routing
    (megatron-core 0.16.1 ``moe_utils.group_limited_topk``: ``moe_router_num_groups`` G groups of E / G consecutive
    experts, the ``moe_router_group_topk`` M groups of the largest sum of their top-(k / M) scores chosen, then the
    top-k among their experts): the M groups uniform over the G, each holding k / M of the token's experts (its
    top k / M are what chose it), uniform inside it. A block of q whole groups is hit when one of them is chosen:
    ``1 - C(G - q, M) / C(G, M)``; a block inside one group: ``M / G x (1 - C(E / G - block, k / M) / C(E / G,
    k / M))``. Checked against a simulation of megatron-core's selection on random scores
    (tests/unit/test_flex_dispatch.py: within 0.01). A block that neither holds whole groups nor fits in one, or k
    not a multiple of M, is priced as plain top-k over the M groups' experts (and the G / M group share)."""
    E, k = num_experts, topk
    if block <= 0:
        return 0.0
    if block >= E:
        return 1.0
    if not groups or groups <= 1 or not group_topk or group_topk >= groups:
        return 1.0 - _miss(E, block, k)
    G, M, gs = groups, group_topk, num_experts // groups
    if k % M == 0 and block % gs == 0:
        q = block // gs
        return 1.0 - (comb(G - q, M) / comb(G, M) if G - q >= M else 0.0)
    if k % M == 0 and gs % block == 0:
        return M / G * (1.0 - _miss(gs, block, k // M))
    if gs % block == 0:
        return M / G * (1.0 - _miss(M * gs, block, k))
    return 1.0 - _miss(E, block, k)


def flex_destinations(num_experts: int, topk: int, ep: int, ep_per_node: int, groups: int | None = None,
                      group_topk: int | None = None) -> tuple[float, float]:
    """(R, D): expected distinct destination EP ranks and distinct destination nodes of one token, ``ep`` ranks of
    ``num_experts / ep`` consecutive experts each, ``ep_per_node`` of them in each node."""
    per_rank = num_experts // ep
    g = min(max(ep_per_node, 1), ep)
    nodes = ep // g
    R = ep * hit_probability(num_experts, topk, per_rank, groups, group_topk)
    D = nodes * hit_probability(num_experts, topk, per_rank * g, groups, group_topk)
    return R, D


def flex_token_bytes(hidden: int, dt: float, topk: int, dispatch: bool = True) -> float:
    """Bytes DeepEP moves per token: the hidden state and, in dispatch, its ``SourceMeta`` (8 bytes) and the top-k
    indices and weights (int32 + fp32 each), aligned to 16 bytes (``internode.cu`` ``get_num_bytes_per_token``);
    combine moves the hidden state."""
    if not dispatch:
        return hidden * dt
    raw = hidden * dt + 8 + topk * 8
    return -(-raw // 16) * 16


def flex_all_to_all_ms(comm: CommModel, tokens: float, token_bytes: float, dest_ranks: float, dest_nodes: float,
                       group: int, members_per_node: int, imbalance: float = 1.0, nvl_eff: float = LINK_EFFICIENCY,
                       rdma_eff: float = LINK_EFFICIENCY) -> float:
    """One flex dispatch (or combine) over ``group`` ranks (etp x ep), ``members_per_node`` of them per node, for one
    rank's ``tokens`` of ``token_bytes``, each to ``dest_ranks`` distinct ranks in ``dest_nodes`` distinct nodes
    (expected; ``flex_destinations``); the links at ``nvl_eff`` / ``rdma_eff`` of their datasheet bandwidth
    (``FLEX_NVL_EFF``, ``FLEX_RDMA_EFF``) where ``comm`` has them at ``LINK_EFFICIENCY``."""
    if group <= 1 or tokens <= 0:
        return 0.0
    g = min(max(members_per_node, 1), group)
    nodes = group // g
    nvl = tokens * dest_ranks * (g - 1) / g * token_bytes
    rdma = tokens * dest_nodes * (nodes - 1) / nodes * token_bytes if nodes > 1 else 0.0
    intra = comm.intra_gbps * nvl_eff / LINK_EFFICIENCY
    inter = comm.inter_gbps * rdma_eff / LINK_EFFICIENCY
    t = max(nvl / (intra * 1e6), rdma / (inter * 1e6) if rdma else 0.0)
    return (ALPHA_INTER_MS if nodes > 1 else ALPHA_INTRA_MS) + imbalance * t


# DeepEP's recommended configs (deep_ep ``Buffer.get_dispatch_config`` / ``get_combine_config``, legacy buffer,
# deepseek-ai/DeepEP dd758ca deep_ep/buffers/legacy.py): group size -> (NVL recv tokens, RDMA recv tokens) per
# channel, the larger of the dispatch and combine configs (both have the same recv sizes).
DEEPEP_RECV_TOKENS = {2: (256, 128), 4: (256, 128), 8: (256, 128), 16: (288, 128), 24: (288, 128), 32: (288, 128),
                      48: (288, 128), 64: (288, 128), 96: (480, 128), 128: (560, 128), 144: (720, 128),
                      160: (720, 128)}
DEEPEP_NVL_PEERS = 8         # LEGACY_NUM_MAX_NVL_PEERS (csrc/kernels/legacy/compiled.cuh)


def deepep_buffer_bytes(group: int, hidden_bytes: int, num_sms: int = 20) -> tuple[int, int]:
    """(num_nvl_bytes, num_rdma_bytes) megatron-core 0.16.1's ``fused_a2a.get_buffer`` allocates for a group of
    ``group`` ranks and ``hidden_bytes`` = h x max(element size, 2): DeepEP's ``Config.get_nvl_buffer_size_hint`` /
    ``get_rdma_buffer_size_hint`` (csrc/legacy/config.hpp) at ``num_sms`` (``moe_deepep_num_sms``, default 20:
    num_sms / 2 channels), max-topk 128, max-scales 128, 8-byte top-k indices, 8-byte ``SourceMeta``. A group size
    DeepEP has no config for takes the next larger one's (DeepEP itself asserts)."""
    keys = sorted(DEEPEP_RECV_TOKENS)
    key = next((k for k in keys if k >= group), keys[-1])
    nvl_tok, rdma_tok = DEEPEP_RECV_TOKENS[key]
    ch = num_sms // 2
    nvl_r = min(group, DEEPEP_NVL_PEERS)
    rdma_r = max(group // DEEPEP_NVL_PEERS, 1)
    per_tok = hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4
    nvl = ch * nvl_r * (2 * rdma_r + 3) * 4 + ch * nvl_r * nvl_tok * per_tok
    nvl = -(-nvl // 128) * 128
    if group <= DEEPEP_NVL_PEERS:
        return nvl, 0
    rdma = ch * rdma_r * (DEEPEP_NVL_PEERS * 2 + 2) * 2 * 4 + ch * rdma_r * rdma_tok * 2 * (per_tok + 16)
    return nvl, -(-rdma // 128) * 128
