"""Collective and point-to-point communication times from an alpha-beta (latency-bandwidth) model.

Ring algorithms (Patarasuk & Yuan 2009; NCCL's default for large messages) over ``n`` ranks and a message of ``B``
bytes (the full tensor), with per-step latency ``alpha`` and link bandwidth ``beta`` (bytes/s, one direction):

    all-reduce      T = 2 (n-1) alpha + 2 (n-1)/n * B / beta
    reduce-scatter  T =   (n-1) alpha +   (n-1)/n * B / beta
    all-gather      T =   (n-1) alpha +   (n-1)/n * B / beta      (B = the gathered, full tensor)
    p2p             T =         alpha +           B / beta

A group whose ranks sit in more than one NVLink domain (a node, or ``ClusterSpec.nvlink_domain`` GPUs: an NVL72
rack of trays of 4) runs at the network bandwidth, otherwise at the NVLink bandwidth. Across nodes NCCL runs one ring channel per member of the group in a node, each crossing the node boundary
on that member's own NIC (DGX systems have one NIC per GPU): a group with ``members`` ranks per node moves data
across nodes at ``members`` NICs' bandwidth, capped by the intra-node links (``members = 1``: the v1 model; a DP
group of a tp-8 stage has one member per 8-GPU node, a tp-1 stage's has eight).
The achievable fraction of the datasheet link bandwidth (``LINK_EFFICIENCY``) and the latencies are typical
nccl-tests numbers: bus bandwidth reaches about 80% of the unidirectional NVLink/IB figure for large messages
(NVIDIA nccl-tests results for DGX A100/H100), and small-message ring latency is a few microseconds per step inside
a node and about 10 us across InfiniBand.

Communication hidden behind compute is not free: NCCL runs each collective on one thread block per channel
(``NCCL_CTAS``, 16: NCCL's channel count for large messages on NVLink/IB systems), so the compute it overlaps
runs on the remaining SMs; a cost model charges ``hidden x NCCL_CTAS / SMs`` to the compute it hides behind
(``overlap_tax``).

``CommModel`` binds the constants to a ``ClusterSpec``; all functions take bytes and return milliseconds.
A profile database replaces the curves with fitted ones (``profiledb.FittedComm``) behind the same methods.
"""

from __future__ import annotations

from ..cluster import ClusterSpec

LINK_EFFICIENCY = 0.8          # achieved bus bandwidth / datasheet unidirectional bandwidth (nccl-tests)
NCCL_CTAS = 16                 # thread blocks (one SM each) an NCCL collective occupies (one per channel)
ALPHA_INTRA_MS = 0.003         # per ring step inside a node (NVLink/PCIe), ms
ALPHA_INTER_MS = 0.010         # per ring step across nodes (InfiniBand), ms


def ring_all_reduce_ms(nbytes: float, n: int, gbps: float, alpha_ms: float) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * alpha_ms + 2.0 * (n - 1) / n * nbytes / (gbps * 1e6)


def ring_gather_ms(nbytes: float, n: int, gbps: float, alpha_ms: float) -> float:
    """Reduce-scatter or all-gather of a full tensor of ``nbytes``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * alpha_ms + (n - 1) / n * nbytes / (gbps * 1e6)


def p2p_ms(nbytes: float, gbps: float, alpha_ms: float) -> float:
    if nbytes <= 0:
        return 0.0
    return alpha_ms + nbytes / (gbps * 1e6)


class CommModel:
    """Alpha-beta collectives on one cluster. ``inter`` selects the network instead of the intra-node links."""

    def __init__(self, cluster: ClusterSpec, efficiency: float = LINK_EFFICIENCY):
        self.cluster = cluster
        self.intra_gbps = cluster.intra_node_gbps * efficiency
        self.inter_gbps = cluster.inter_node_gbps * efficiency

    def _link(self, inter: bool, members: int = 1) -> tuple[float, float]:
        if inter:
            return min(self.inter_gbps * max(members, 1), self.intra_gbps), ALPHA_INTER_MS
        return self.intra_gbps, ALPHA_INTRA_MS

    def all_reduce(self, nbytes: float, n: int, inter: bool = False, members: int = 1) -> float:
        return ring_all_reduce_ms(nbytes, n, *self._link(inter, members))

    def reduce_scatter(self, nbytes: float, n: int, inter: bool = False, members: int = 1) -> float:
        return ring_gather_ms(nbytes, n, *self._link(inter, members))

    def all_gather(self, nbytes: float, n: int, inter: bool = False, members: int = 1) -> float:
        return ring_gather_ms(nbytes, n, *self._link(inter, members))

    def p2p(self, nbytes: float, inter: bool = False) -> float:
        return p2p_ms(nbytes, *self._link(inter))

    # ----- where ranks sit ----------------------------------------------------------------------------------------
    def spans_nodes(self, first_rank: int, last_rank: int) -> bool:
        """Whether the ranks leave one NVLink domain (a node, unless ``ClusterSpec.nvlink_domain`` says more)."""
        return self.cluster.domain_of(first_rank) != self.cluster.domain_of(last_rank)

    def members_per_node(self, first_rank: int, stride: int, count: int) -> int:
        """Fewest members per node of the group ``first_rank + i * stride`` (i < count)."""
        nodes: dict[int, int] = {}
        for i in range(count):
            node = self.cluster.node_of(first_rank + i * stride)
            nodes[node] = nodes.get(node, 0) + 1
        return min(nodes.values())


def overlap_tax(gpu: str) -> float:
    """Fraction of the GPU's SMs an NCCL collective takes from the compute it overlaps."""
    from .kernels import ARCH
    arch = ARCH.get(gpu)
    return NCCL_CTAS / arch.sms if arch else 0.0


def overlapped(t_bucketed: float, t_single: float, num_buckets: int, window: float) -> tuple[float, float]:
    """(exposed, hidden) ms of a bucketed collective overlapped with compute (megatron-core DDP overlap_grad_reduce
    / overlap_param_gather).

    ``num_buckets`` buckets are produced at a uniform rate over ``window`` ms of compute (the backward of the last
    micro-batch for gradients, the first forward for parameters) and communicated one after another, each taking
    ``c = t_bucketed / n``. Bucket i is ready at ``(i + 1) W / n``; when ``c <= W / n`` only the last bucket is
    exposed, otherwise the collectives queue up: exposed = ``max(c, t_bucketed - W (n - 1) / n)``. Overlap never
    exposes more than the unbucketed collective ``t_single`` (the bound only binds when the window is shorter
    than the buckets' extra latencies).
    """
    if t_bucketed <= 0:
        return 0.0, 0.0
    n = max(1, num_buckets)
    exposed = min(t_single, max(t_bucketed / n, t_bucketed - window * (n - 1) / n))
    return exposed, max(0.0, t_bucketed - exposed)
