"""Point-to-point communicator between stages of different TP, DP, CP and sequence parallelism
(megatron-core's ``p2p_communicator``).

Each rank holds a piece of a boundary activation ``[s, b, h]`` (``shards.Holding``: its DP replica's samples,
its CP chunks, its sequence-parallel part). For every boundary the messages are fixed up front
(``boundary_messages``): each rank of the needing stage gets, from the providing stage, every piece of what it
needs -- batch slice x sequence interval -- from a rank that holds it:

- DP differences split (fan-out) or join (fan-in) along the batch dimension;
- a sequence-parallel or context-parallel provider holds only part of the sequence: the needer gets each part
  from the rank holding it (re-sharding along the sequence: SP -> no SP gathers, no SP -> SP scatters,
  TP 2 -> 1 with SP joins, ...);
- a provider without SP holds the same tensor on all its TP ranks: TP index ``u % tp`` of it serves the
  needer's TP index ``u``, spreading the load.

Forward, stage ``a`` provides its output to stage ``b``; backward, stage ``b`` provides the gradient of its input
to ``a`` (identical on a non-SP stage's TP ranks: megatron-core's column-parallel input all-reduces its
gradient, and sequence parallelism reduce-scatters it). All pieces between two ranks travel as one message.

Interleaved plans (virtual stages) run on a ring: model chunk ``k`` on stage ``k % S`` feeds chunk ``k + 1`` on
stage ``(k + 1) % S``, so stage ``S - 1`` sends to stage ``0``. Every chunk of a stage has the stage's shape,
so the messages depend on the stage pair only and any heterogeneous interleaved plan routes chunk to chunk.

All messages of one schedule call are posted as ``isend``/``irecv`` and then waited for, so the paired calls of
the schedules cannot deadlock; it works on gloo (CPU) and NCCL. The method names and arguments are those of
megatron-core's ``P2PCommunicator``, so ``forward_backward_pipelining_without_interleaving`` and
``forward_backward_pipelining_with_interleaving`` use it unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from search.spec.plan import ParallelPlan

from .layout import RankLayout, StagePosition, stage_rank
from .shards import Holding, boundary_segments, holding

_FWD_TAG, _BWD_TAG = 0, 1


@dataclass(frozen=True)
class Piece:
    """Samples ``[b_lo, b_hi)`` x global tokens ``[s_lo, s_hi)`` of a boundary activation."""

    b_lo: int
    b_hi: int
    s_lo: int
    s_hi: int


@dataclass(frozen=True)
class Message:
    src: int
    dst: int
    pieces: tuple[Piece, ...]


def _stage_ranks(plan: ParallelPlan, stage: int) -> list[RankLayout]:
    first = plan.first_rank(stage)
    return [RankLayout.of(plan, r) for r in range(first, first + plan.stages[stage].num_gpus)]


def _pieces(need: Holding, have: Holding) -> list[Piece]:
    lo, hi = max(need.batch[0], have.batch[0]), min(need.batch[1], have.batch[1])
    if lo >= hi:
        return []
    return [Piece(lo, hi, max(a, c), min(b, d)) for a, b in need.seq for c, d in have.seq if max(a, c) < min(b, d)]


def boundary_messages(plan: ParallelPlan, provider: int, needer: int, segments: tuple[int, ...]) -> list[Message]:
    """Messages that give every rank of stage ``needer`` its part of an activation (or gradient) with
    ``segments`` from the ranks of stage ``provider`` (each needed element exactly once)."""
    sp = plan.stages[provider]
    out = []
    for need_lay in _stage_ranks(plan, needer):
        need = holding(plan, need_lay, segments)
        for j in range(sp.dp):
            for c in range(sp.cp):
                tps = range(sp.tp) if sp.sequence_parallel else [need_lay.tp_rank % sp.tp]
                for t in tps:
                    src = stage_rank(plan, provider, j, t, c)
                    pieces = _pieces(need, holding(plan, RankLayout.of(plan, src), segments))
                    if pieces:
                        out.append(Message(src, need_lay.rank, tuple(pieces)))
    return out


def message_numel(m: Message, hidden: int) -> int:
    return sum((p.b_hi - p.b_lo) * (p.s_hi - p.s_lo) for p in m.pieces) * hidden


def pack(m: Message, tensor: torch.Tensor, held: Holding) -> torch.Tensor:
    """The pieces of ``m`` cut from the sender's local ``tensor`` (holding ``held``), as one contiguous tensor."""
    parts = []
    for p in m.pieces:
        s0, s1 = held.local_seq(p.s_lo, p.s_hi)
        parts.append(tensor[s0:s1, p.b_lo - held.batch[0]:p.b_hi - held.batch[0]])
    return parts[0].contiguous() if len(parts) == 1 else torch.cat([x.reshape(-1) for x in parts])


def unpack(messages: list[Message], bufs: list[torch.Tensor], held: Holding, hidden: int) -> torch.Tensor:
    """The receiver's local tensor ``[s, b, h]`` (holding ``held``) from the received buffers."""
    shape = (held.seq_len, held.batch_len, hidden)
    if len(messages) == 1 and len(messages[0].pieces) == 1 and bufs[0].numel() == shape[0] * shape[1] * shape[2]:
        return bufs[0].view(shape)
    out = torch.empty(shape, dtype=bufs[0].dtype, device=bufs[0].device)
    for m, buf in zip(messages, bufs):
        flat, off = buf.reshape(-1), 0
        for p in m.pieces:
            s0, s1 = held.local_seq(p.s_lo, p.s_hi)
            n = (s1 - s0) * (p.b_hi - p.b_lo) * hidden
            out[s0:s1, p.b_lo - held.batch[0]:p.b_hi - held.batch[0]] = flat[off:off + n].view(
                s1 - s0, p.b_hi - p.b_lo, hidden)
            off += n
    return out


class PlanCommunicator:
    """megatron-core's P2P communicator interface for one rank of a heterogeneous plan."""

    def __init__(self, plan: ParallelPlan, rank: int, config, device="cpu"):
        self.config = config
        self.device = device
        self.layout = lay = RankLayout.of(plan, rank)
        S, s, v = plan.num_stages, lay.stage, plan.num_virtual_stages
        self.pp_group = StagePosition(s, S)
        self.virtual_pipeline_model_parallel_size = v if v > 1 else None
        self.rank = rank
        self.hidden = plan.model.hidden_size
        ring = v > 1
        prev = (s - 1) % S if (s > 0 or ring) else None
        nxt = (s + 1) % S if (s < S - 1 or ring) else None
        seg_in = boundary_segments(plan, s)
        seg_out = boundary_segments(plan, nxt) if nxt is not None else None
        self.seq_in = sum(seg_in)
        self.input_holding = holding(plan, lay, seg_in)
        self.output_holding = holding(plan, lay, seg_out) if seg_out is not None else None
        self.recv_fwd = self.send_bwd = self.send_fwd = self.recv_bwd = []
        if prev is not None:
            self.recv_fwd = [m for m in boundary_messages(plan, prev, s, seg_in) if m.dst == rank]
            self.send_bwd = [m for m in boundary_messages(plan, s, prev, seg_in) if m.src == rank]
        if nxt is not None:
            self.send_fwd = [m for m in boundary_messages(plan, s, nxt, seg_out) if m.src == rank]
            self.recv_bwd = [m for m in boundary_messages(plan, nxt, s, seg_out) if m.dst == rank]

    # -- the stage's place (megatron-core 0.19's schedules read it from the communicator) ---------------------------
    @property
    def is_pp_first_stage(self) -> bool:
        return self.pp_group.rank() == 0

    @property
    def is_pp_last_stage(self) -> bool:
        return self.pp_group.rank() == self.pp_group.size() - 1

    @property
    def total_stages(self) -> int:
        return self.pp_group.size()

    @property
    def current_stage(self) -> int:
        return self.pp_group.rank()

    # -- primitives -------------------------------------------------------------------------------------------
    def _post_recvs(self, messages, tag):
        bufs, works = [], []
        for m in messages:
            buf = torch.empty(message_numel(m, self.hidden), dtype=self.config.pipeline_dtype, device=self.device)
            works.append(dist.irecv(buf, src=m.src, tag=tag))
            bufs.append(buf)
        return bufs, works

    def _post_sends(self, messages, tensor, held: Holding, tag):
        t = tensor.detach()
        return [dist.isend(pack(m, t, held), dst=m.dst, tag=tag) for m in messages]

    def _exchange(self, sends: list[tuple], recvs: list[tuple]):
        """Post every send ``(messages, tensor, holding, tag)`` and receive ``(messages, holding, tag, grad)``,
        wait for all, and return the received tensors (None where nothing was asked for)."""
        posted, works = [], []
        for messages, held, tag, grad in recvs:
            bufs, w = self._post_recvs(messages, tag) if messages else ([], [])
            posted.append(bufs)
            works += w
        for messages, tensor, held, tag in sends:
            if messages and tensor is not None:
                works += self._post_sends(messages, tensor, held, tag)
        for w in works:
            w.wait()
        out = []
        for (messages, held, tag, grad), bufs in zip(recvs, posted):
            out.append(unpack(messages, bufs, held, self.hidden).requires_grad_(grad) if messages else None)
        return out

    def _fwd_send(self, t):
        return self.send_fwd, self._one(t), self.output_holding, _FWD_TAG

    def _bwd_send(self, t):
        return self.send_bwd, self._one(t), self.input_holding, _BWD_TAG

    def _fwd_recv(self, on: bool = True):
        return (self.recv_fwd if on else [], self.input_holding, _FWD_TAG, True)

    def _bwd_recv(self, on: bool = True):
        return (self.recv_bwd if on else [], self.output_holding, _BWD_TAG, False)

    @staticmethod
    def _one(t):
        return t[0] if isinstance(t, (list, tuple)) else t

    # -- megatron-core P2PCommunicator interface ------------------------------------------------------------------
    # Like megatron-core's, a call given a list of shapes (or a list of tensors) answers with a list.
    @staticmethod
    def _listy(arg) -> bool:
        return isinstance(arg, list) and (len(arg) == 0 or not isinstance(arg[0], int))

    @staticmethod
    def _wrap(result, as_list: bool):
        return [result] if as_list else result

    def recv_forward(self, tensor_shapes, is_first_stage: bool):
        out = None if is_first_stage else self._exchange([], [self._fwd_recv()])[0]
        return self._wrap(out, self._listy(tensor_shapes))

    def recv_backward(self, tensor_shapes, is_last_stage: bool):
        out = None if is_last_stage else self._exchange([], [self._bwd_recv()])[0]
        return self._wrap(out, self._listy(tensor_shapes))

    def send_forward(self, output_tensors, is_last_stage: bool) -> None:
        if not is_last_stage:
            self._exchange([self._fwd_send(output_tensors)], [])

    def send_backward(self, input_tensor_grads, is_first_stage: bool) -> None:
        if not is_first_stage:
            self._exchange([self._bwd_send(input_tensor_grads)], [])

    def send_forward_recv_backward(self, output_tensors, tensor_shapes, is_last_stage: bool):
        out = None
        if not is_last_stage:
            out = self._exchange([self._fwd_send(output_tensors)], [self._bwd_recv()])[0]
        return self._wrap(out, isinstance(output_tensors, list))

    def send_backward_recv_forward(self, input_tensor_grads, tensor_shapes, is_first_stage: bool):
        out = None
        if not is_first_stage:
            out = self._exchange([self._bwd_send(input_tensor_grads)], [self._fwd_recv()])[0]
        return self._wrap(out, isinstance(input_tensor_grads, list))

    # -- the interleaved schedule's calls (ring neighbours; no overlap_p2p_comm) ----------------------------------
    def send_forward_recv_forward(self, output_tensor, recv_prev: bool, tensor_shape, overlap_p2p_comm=False):
        _no_overlap(overlap_p2p_comm)
        return self._exchange([self._fwd_send(output_tensor)], [self._fwd_recv(recv_prev)])[0]

    def send_backward_recv_backward(self, input_tensor_grad, recv_next: bool, tensor_shape, overlap_p2p_comm=False):
        _no_overlap(overlap_p2p_comm)
        return self._exchange([self._bwd_send(input_tensor_grad)], [self._bwd_recv(recv_next)])[0]

    def send_forward_backward_recv_forward_backward(self, output_tensor, input_tensor_grad, recv_prev: bool,
                                                    recv_next: bool, tensor_shape):
        got = self._exchange([self._fwd_send(output_tensor), self._bwd_send(input_tensor_grad)],
                             [self._fwd_recv(recv_prev), self._bwd_recv(recv_next)])
        return got[0], got[1]


def _no_overlap(flag: bool) -> None:
    if flag:
        raise ValueError("PlanCommunicator does not overlap p2p with compute: leave config.overlap_p2p_comm off")
