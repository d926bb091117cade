"""Collective and point-to-point communication times from an alpha-beta (latency-bandwidth) model.

Ring algorithms (Patarasuk & Yuan 2009; NCCL's default for large messages) over ``n`` ranks and a message of ``B``
bytes (the full tensor), with per-step latency ``alpha`` and link bandwidth ``beta`` (bytes/s, one direction):

    all-reduce      T = 2 (n-1) alpha + 2 (n-1)/n * B / beta
    reduce-scatter  T =   (n-1) alpha +   (n-1)/n * B / beta
    all-gather      T =   (n-1) alpha +   (n-1)/n * B / beta      (B = the gathered, full tensor)
    p2p             T =         alpha +           B / beta

A group whose ranks sit on more than one node runs at the network bandwidth per GPU (NCCL rings cross the node
boundary on every GPU's own NIC, so the bus bandwidth is the NIC's), otherwise at the intra-node link bandwidth.
The achievable fraction of the datasheet link bandwidth (``LINK_EFFICIENCY``) and the latencies are typical
nccl-tests numbers: bus bandwidth reaches about 80% of the unidirectional NVLink/IB figure for large messages
(NVIDIA nccl-tests results for DGX A100/H100), and small-message ring latency is a few microseconds per step inside
a node and about 10 us across InfiniBand.

``CommModel`` binds the constants to a ``ClusterSpec``; all functions take bytes and return milliseconds.
A profile database replaces the curves with fitted ones (``profiledb.FittedComm``) behind the same methods.
"""

from __future__ import annotations

from ..cluster import ClusterSpec

LINK_EFFICIENCY = 0.8          # achieved bus bandwidth / datasheet unidirectional bandwidth (nccl-tests)
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

    def _link(self, inter: bool) -> tuple[float, float]:
        return (self.inter_gbps, ALPHA_INTER_MS) if inter else (self.intra_gbps, ALPHA_INTRA_MS)

    def all_reduce(self, nbytes: float, n: int, inter: bool = False) -> float:
        return ring_all_reduce_ms(nbytes, n, *self._link(inter))

    def reduce_scatter(self, nbytes: float, n: int, inter: bool = False) -> float:
        return ring_gather_ms(nbytes, n, *self._link(inter))

    def all_gather(self, nbytes: float, n: int, inter: bool = False) -> float:
        return ring_gather_ms(nbytes, n, *self._link(inter))

    def p2p(self, nbytes: float, inter: bool = False) -> float:
        return p2p_ms(nbytes, *self._link(inter))

    # ----- where ranks sit ----------------------------------------------------------------------------------------
    def spans_nodes(self, first_rank: int, last_rank: int) -> bool:
        return self.cluster.node_of(first_rank) != self.cluster.node_of(last_rank)
