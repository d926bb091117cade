"""Network micro-benchmarks over ``torch.distributed``: collectives by kind, group size and message size, and
point-to-point time intra and inter node.

Message size = bytes of the full tensor (the cost model's convention, docs/profile-db.md): the all-reduce
tensor, the all-gather *result*, the reduce-scatter *input*, the all-to-all input. Groups are ranks
``[0, n)`` (intra node when ``n`` <= processes per node, inter node otherwise) plus, with several nodes, the
two-rank group ``{0, per_node}`` across nodes; every rank creates every group in the same order
(``new_group`` is collective); ranks outside a group wait at the world barrier. Rank 0's median is recorded.
p2p: ping-pong between rank 0 and its peer (rank 1 intra node, rank ``per_node`` inter node); one send/recv
pair is half the round trip.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm_plan import KINDS, group_key, group_plan  # noqa: F401
from .timing import repeat


class CommBench:
    """Creates the measured groups once; measures one (kind, group, size) or one p2p size per call."""

    def __init__(self, world: int, per_node: int, device: str, dtype: torch.dtype, warmup: int, repeats: int):
        self.world, self.per_node, self.device = world, per_node, device
        self.dtype, self.warmup, self.repeats = dtype, warmup, repeats
        self.rank = dist.get_rank()
        self.groups = {}
        for ranks, inter in group_plan(world, per_node):
            g = dist.new_group(ranks)
            self.groups[group_key(ranks, inter)] = (ranks, inter, g)
            if self.rank in ranks:   # connect now: the first operation on a group pays its setup
                dist.all_reduce(self._buf(4096), group=g)
        dist.barrier()

    def _buf(self, nbytes: int) -> torch.Tensor:
        el = torch.tensor([], dtype=self.dtype).element_size()
        return torch.zeros(max(nbytes // el, 1), dtype=self.dtype, device=self.device)

    def collective(self, kind: str, key: str, nbytes: int) -> float | None:
        """Median microseconds on rank 0 (None elsewhere)."""
        ranks, _, g = self.groups[key]
        n = len(ranks)
        out = None
        if self.rank in ranks:
            per = -(-nbytes // n)
            full = self._buf(per * n)
            part = self._buf(per)
            ops = {
                "all_reduce": lambda: dist.all_reduce(full, group=g),
                "all_gather": lambda: dist.all_gather_into_tensor(full, part, group=g),
                "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full, group=g),
                "all_to_all": lambda: dist.all_to_all_single(self._a2a_out(full), full, group=g),
            }
            op = ops[kind]

            def step(clock):
                op()
                clock.mark()

            (st,) = repeat(step, 1, self.warmup, self.repeats, self.device, g)
            out = st.median_us
        dist.barrier()
        return out if self.rank == 0 else None

    def _a2a_out(self, like: torch.Tensor) -> torch.Tensor:
        o = getattr(self, "_a2a", None)
        if o is None or o.shape != like.shape:
            o = self._a2a = torch.empty_like(like)
        return o

    def p2p_peer(self, inter: bool) -> int | None:
        peer = self.per_node if inter else 1
        if peer >= self.world or (not inter and self.per_node < 2):
            return None
        return peer

    def p2p(self, inter: bool, nbytes: int) -> float | None:
        """One-way send/recv microseconds between rank 0 and its peer (half the ping-pong), on rank 0."""
        peer = self.p2p_peer(inter)
        out = None
        if self.rank in (0, peer):
            buf = self._buf(nbytes)
            other = peer if self.rank == 0 else 0

            def step(clock):
                if self.rank == 0:
                    dist.send(buf, other)
                    dist.recv(buf, other)
                else:
                    dist.recv(buf, other)
                    dist.send(buf, other)
                clock.mark()

            (st,) = repeat(step, 1, self.warmup, self.repeats, self.device, None)
            out = st.median_us / 2
        dist.barrier()
        return out if self.rank == 0 else None
