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
across nodes at ``members`` NICs' bandwidth, capped by the intra-node links and by the channels (a ring channel
crosses the boundary on one NIC; ``NCCL_CTAS`` channels) (``members = 1``: the v1 model; a DP group of a tp-8 stage
has one member per 8-GPU node, a tp-1 stage's has eight, a tp-2 stage's on an NVL72 rack of 64 has 32).
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

Latency of a ring across NVLink domains (NCCL's own tuning model, ``src/graph/tuning.cc`` ``ncclTopoTuneModel``,
NVIDIA/nccl master of 2026-06): a ring of ``n`` ranks on ``N`` domains takes ``nsteps`` steps (``2 (n-1)`` for an
all-reduce, ``n-1`` for a reduce-scatter or all-gather), of which only ``nInterSteps`` cross the network (``2 (N-1)``
and ``N-1``); the others run at the intra-domain latency. ``domains`` (the NVLink domains the group spans) prices a
group that way; without it every step of an inter-node ring is a network step (one rank per node, the v1 model).

In-network reductions (``CommModel(nvls=..., sharp=...)``, used for the data-parallel collectives with
``in_network=True``), priced as NCCL's tuner prices its algorithms and taken where faster than the ring (NCCL picks
the fastest algorithm per call):
    NVLS (NVLink SHARP, NVSwitch multicast; a group inside one NVLink domain): all-reduce bus bandwidth 2 x
        ``NVLS_EFFICIENCY`` of the ring's (each rank sends and receives the buffer once: 85% on Hopper, 74% on
        Blackwell, tuning.cc ``nvlsEfficiency``); reduce-scatter / all-gather move as many bytes as the ring, at
        that efficiency (no bandwidth gain, NCCL uses them for their latency); latency ``NVLS_LATENCY_MS`` (25 us,
        tuning.cc hwLatencies NVLINK/NVLS/Simple) instead of a step per rank.
    SHARP (InfiniBand in-switch reduction, NCCL CollNet with the SHARP plugin; megatron-core ``use_sharp`` turns it
        on for the DP x CP group, ``parallel_state.py``): all-reduce sends and receives the buffer once per NIC
        instead of ``2 (n-1)/n`` of it (tuning.cc: CollNetDirect algorithm bandwidth = half its bus bandwidth,
        x 0.85 on Hopper and later, x 0.9 of the network); reduce-scatter / all-gather as the ring (CollNet needs a
        NIC per GPU for them and moves the same bytes); latency ``SHARP_LATENCY_MS`` (CollNetDirect: 2 x 3.7 us
        NVLink + 31 us network).
NVIDIA's own stacks run with NVLS off (NeMo's executors and the MLPerf Training configs set ``NCCL_NVLS_ENABLE=0``,
"needed to save memory"; megatron-core's ``use_sharp`` defaults off), so both are off unless a plan says so.
"""

from __future__ import annotations

from search.spec.cluster import ClusterSpec

LINK_EFFICIENCY = 0.8          # achieved bus bandwidth / datasheet unidirectional bandwidth (nccl-tests)
NCCL_CTAS = 16                 # thread blocks (one SM each) an NCCL collective occupies (one per channel)
ALPHA_INTRA_MS = 0.003         # per ring step inside a node (NVLink/PCIe), ms
ALPHA_INTER_MS = 0.010         # per ring step across nodes (InfiniBand), ms
NVLS_EFFICIENCY = {"hopper": 0.85, "blackwell": 0.74}   # NCCL tuning.cc nvlsEfficiency (no NVLS before Hopper)
NVLS_LATENCY_MS = 0.025        # NCCL tuning.cc hwLatencies[NVLINK][NVLS][Simple], us -> ms
SHARP_LATENCY_MS = 0.0384      # CollNetDirect: 2 x 3.7 us (NVLink) + 31 us (network), tuning.cc
SHARP_EFFICIENCY = 0.85 * 0.9  # CollNetDirect bus bandwidth x 0.85 (compute capability >= 9.0) x 0.9 network


def ring_latency_ms(steps: int, inter_steps: int, alpha_ms: float, alpha_inter_ms: float) -> float:
    """NCCL's ring latency: ``inter_steps`` of the ``steps`` at the network latency, the rest at ``alpha_ms``."""
    inter_steps = min(inter_steps, steps)
    return (steps - inter_steps) * alpha_ms + inter_steps * alpha_inter_ms


def ring_all_reduce_ms(nbytes: float, n: int, gbps: float, alpha_ms: float, inter_steps: int | None = None,
                       alpha_inter_ms: float | None = None) -> float:
    """Ring all-reduce; ``inter_steps`` of its ``2 (n-1)`` steps at ``alpha_inter_ms`` (default: none)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    lat = ring_latency_ms(2 * (n - 1), inter_steps or 0, alpha_ms, alpha_inter_ms or alpha_ms)
    return lat + 2.0 * (n - 1) / n * nbytes / (gbps * 1e6)


def ring_gather_ms(nbytes: float, n: int, gbps: float, alpha_ms: float, inter_steps: int | None = None,
                   alpha_inter_ms: float | None = None) -> float:
    """Reduce-scatter or all-gather of a full tensor of ``nbytes``; ``inter_steps`` of its ``n-1`` steps at
    ``alpha_inter_ms`` (default: none)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    lat = ring_latency_ms(n - 1, inter_steps or 0, alpha_ms, alpha_inter_ms or alpha_ms)
    return lat + (n - 1) / n * nbytes / (gbps * 1e6)


def p2p_ms(nbytes: float, gbps: float, alpha_ms: float) -> float:
    if nbytes <= 0:
        return 0.0
    return alpha_ms + nbytes / (gbps * 1e6)


class CommModel:
    """Alpha-beta collectives on one cluster. ``inter`` selects the network instead of the intra-node links;
    ``domains`` (how many NVLink domains the group spans) prices an inter-node ring's latency as NCCL does (module
    docstring); ``in_network`` lets a call use NVLS / SHARP where this model has them on."""

    def __init__(self, cluster: ClusterSpec, efficiency: float = LINK_EFFICIENCY, nvls: bool = False,
                 sharp: bool = False):
        from .kernels import GENERATION
        self.cluster = cluster
        self.intra_gbps = cluster.intra_node_gbps * efficiency
        self.inter_gbps = cluster.inter_node_gbps * efficiency
        self.nvls = NVLS_EFFICIENCY.get(GENERATION.get(cluster.gpu.name, ""), 0.0) if nvls else 0.0
        self.sharp = sharp

    def _link(self, inter: bool, members: int = 1) -> tuple[float, float]:
        if inter:   # one NIC per ring channel crossing the domain boundary: at most NCCL_CTAS of them
            return min(self.inter_gbps * min(max(members, 1), NCCL_CTAS), self.intra_gbps), ALPHA_INTER_MS
        return self.intra_gbps, ALPHA_INTRA_MS

    def _ring(self, nbytes: float, n: int, inter: bool, members: int, domains: int | None, allreduce: bool) -> float:
        gbps, alpha = self._link(inter, members)
        if not inter:
            f = ring_all_reduce_ms if allreduce else ring_gather_ms
            return f(nbytes, n, gbps, alpha)
        crossings = (domains or n) - 1              # NCCL: nInterSteps = (N-1) per pass of the ring
        f, steps = (ring_all_reduce_ms, 2 * crossings) if allreduce else (ring_gather_ms, crossings)
        return f(nbytes, n, gbps, ALPHA_INTRA_MS, steps, ALPHA_INTER_MS)

    def _in_network(self, nbytes: float, n: int, inter: bool, members: int, allreduce: bool) -> float | None:
        """NVLS inside a domain / SHARP across domains (module docstring); None where neither is on."""
        if n <= 1 or nbytes <= 0:
            return None
        gbps, _ = self._link(inter, members)
        if not inter and self.nvls:
            lat, eff = NVLS_LATENCY_MS, self.nvls
        elif inter and self.sharp:
            lat, eff = SHARP_LATENCY_MS, SHARP_EFFICIENCY
        else:
            return None
        # each rank sends (and receives) the buffer once: all-reduce B, reduce-scatter / all-gather (n-1)/n B
        return lat + (1.0 if allreduce else (n - 1) / n) * nbytes / (gbps * eff * 1e6)

    def _best(self, nbytes, n, inter, members, domains, allreduce, in_network) -> float:
        t = self._ring(nbytes, n, inter, members, domains, allreduce)
        alt = self._in_network(nbytes, n, inter, members, allreduce) if in_network else None
        return t if alt is None else min(t, alt)

    def all_reduce(self, nbytes: float, n: int, inter: bool = False, members: int = 1, domains: int | None = None,
                   in_network: bool = False) -> float:
        return self._best(nbytes, n, inter, members, domains, True, in_network)

    def reduce_scatter(self, nbytes: float, n: int, inter: bool = False, members: int = 1,
                       domains: int | None = None, in_network: bool = False) -> float:
        return self._best(nbytes, n, inter, members, domains, False, in_network)

    def all_gather(self, nbytes: float, n: int, inter: bool = False, members: int = 1, domains: int | None = None,
                   in_network: bool = False) -> float:
        return self._best(nbytes, n, inter, members, domains, False, in_network)

    def p2p(self, nbytes: float, inter: bool = False) -> float:
        return p2p_ms(nbytes, *self._link(inter))

    # ----- where ranks sit ----------------------------------------------------------------------------------------
    def spans_nodes(self, first_rank: int, last_rank: int) -> bool:
        """Whether the ranks leave one NVLink domain (a node, unless ``ClusterSpec.nvlink_domain`` says more)."""
        return self.cluster.domain_of(first_rank) != self.cluster.domain_of(last_rank)

    def members_per_node(self, first_rank: int, stride: int, count: int) -> int:
        """Fewest members per node of the group ``first_rank + i * stride`` (i < count)."""
        return self.placement([first_rank + i * stride for i in range(count)])[1]

    def placement(self, ranks: list[int]) -> tuple[int, int]:
        """(NVLink domains the group ``ranks`` spans, fewest of its members in one domain). Across domains a ring's
        channels leave each domain on the NICs of any of its members (NCCL treats an NVL72 rack as one node,
        multi-node NVLink), so a rack's trays pool their NICs."""
        domains: dict[int, int] = {}
        for r in ranks:
            d = self.cluster.domain_of(r)
            domains[d] = domains.get(d, 0) + 1
        return len(domains), min(domains.values())


def overlap_tax(gpu: str) -> float:
    """Fraction of the GPU's SMs an NCCL collective takes from the compute it overlaps: at most all of them (the
    ``cpu`` preset's 8 nominal "SMs" gave 2, so hiding a transfer cost twice exposing it)."""
    from .kernels import arch
    return min(1.0, NCCL_CTAS / arch(gpu).sms)


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
