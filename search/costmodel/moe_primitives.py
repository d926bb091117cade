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
"""

from __future__ import annotations

from .comm import ALPHA_INTER_MS, ALPHA_INTRA_MS, CommModel


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
