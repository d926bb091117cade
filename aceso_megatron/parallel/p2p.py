"""Point-to-point communicator between stages of different TP and DP (megatron-core ``p2p_communicator``).

Activations between stages are ``[s, b, h]``, replicated across a stage's TP ranks (no sequence parallelism).
DP replica ``j`` of a stage with DP ``d`` holds samples ``[j*mb/d, (j+1)*mb/d)`` of the pipeline micro-batch
``mb``. For each boundary the routes are fixed up front:

- forward (stage s -> s+1): every rank of s+1 (replica ``j``, TP index ``u``) receives, from each replica ``i``
  of stage s whose samples overlap its own, the overlapping batch slice, sent by TP index ``u % tp_s`` of ``i``.
  DP differences thus split (fan-out) or join (fan-in) along the batch dimension; TP differences are handled by
  sending the replicated activation to every receiving TP rank, spread over the sending TP ranks.
- backward (s+1 -> s): the mirror image for the activation gradients (identical on a stage's TP ranks, because
  megatron-core's column-parallel input all-reduces its gradient).

All messages of one schedule call are posted as ``isend``/``irecv`` and then waited for, so the paired calls of
the 1F1B schedule (``send_forward_recv_backward`` on one side, ``send_backward_recv_forward`` on the other) cannot
deadlock; it works on gloo (CPU) and NCCL. The method names and arguments are those of megatron-core's
``P2PCommunicator`` so ``forward_backward_pipelining_without_interleaving`` can use it unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from search.plan import ParallelPlan

from .layout import RankLayout, StagePosition, sample_range, stage_rank

_FWD_TAG, _BWD_TAG = 0, 1


@dataclass(frozen=True)
class Route:
    src: int
    dst: int
    lo: int  # samples [lo, hi) of the pipeline micro-batch
    hi: int


def boundary_routes(plan: ParallelPlan, boundary: int, backward: bool) -> list[Route]:
    """Routes across the boundary between stage ``boundary`` and ``boundary + 1``."""
    a, b = (boundary + 1, boundary) if backward else (boundary, boundary + 1)
    sa, sb = plan.stages[a], plan.stages[b]
    mb = plan.micro_batch_size
    routes = []
    for j in range(sb.dp):
        rj = sample_range(mb, sb.dp, j)
        for u in range(sb.tp):
            dst = stage_rank(plan, b, j, u)
            for i in range(sa.dp):
                ri = sample_range(mb, sa.dp, i)
                lo, hi = max(ri[0], rj[0]), min(ri[1], rj[1])
                if lo < hi:
                    routes.append(Route(stage_rank(plan, a, i, u % sa.tp), dst, lo, hi))
    return routes


class PlanCommunicator:
    """megatron-core's P2P communicator interface for one rank of a heterogeneous plan."""

    def __init__(self, plan: ParallelPlan, rank: int, config, seq_lens: list[int], device="cpu"):
        """``seq_lens[s]``: sequence length of the activation entering stage ``s`` (T5: encoder + decoder)."""
        self.config = config
        self.device = device
        self.layout = RankLayout.of(plan, rank)
        s = self.layout.stage
        self.pp_group = StagePosition(s, plan.num_stages)
        self.rank = rank
        self.hidden = plan.model.hidden_size
        self.my_range = sample_range(plan.micro_batch_size, self.layout.dp, self.layout.dp_rank)
        self.seq_in = seq_lens[s]
        self.seq_out = seq_lens[s + 1] if s + 1 < plan.num_stages else None
        last = plan.num_stages - 1
        self.recv_fwd = [r for r in boundary_routes(plan, s - 1, False) if r.dst == rank] if s > 0 else []
        self.send_bwd = [r for r in boundary_routes(plan, s - 1, True) if r.src == rank] if s > 0 else []
        self.send_fwd = [r for r in boundary_routes(plan, s, False) if r.src == rank] if s < last else []
        self.recv_bwd = [r for r in boundary_routes(plan, s, True) if r.dst == rank] if s < last else []

    # -- primitives -------------------------------------------------------------------------------------------
    def _post_recvs(self, routes, seq, tag):
        bufs, works = [], []
        for r in routes:
            buf = torch.empty(seq, r.hi - r.lo, self.hidden, dtype=self.config.pipeline_dtype, device=self.device)
            works.append(dist.irecv(buf, src=r.src, tag=tag))
            bufs.append(buf)
        return bufs, works

    def _post_sends(self, routes, tensor, tag):
        works = []
        lo0 = self.my_range[0]
        for r in routes:
            part = tensor.detach()[:, r.lo - lo0:r.hi - lo0].contiguous()
            works.append(dist.isend(part, dst=r.dst, tag=tag))
        return works

    def _exchange(self, send_routes, send_tensor, send_tag, recv_routes, recv_seq, recv_tag, requires_grad):
        bufs, works = self._post_recvs(recv_routes, recv_seq, recv_tag) if recv_routes else ([], [])
        if send_routes and send_tensor is not None:
            works += self._post_sends(send_routes, send_tensor, send_tag)
        for w in works:
            w.wait()
        if not recv_routes:
            return None
        out = bufs[0] if len(bufs) == 1 else torch.cat(bufs, dim=1)
        return out.requires_grad_(requires_grad)

    @staticmethod
    def _one(t):
        return t[0] if isinstance(t, (list, tuple)) else t

    # -- megatron-core P2PCommunicator interface ------------------------------------------------------------------
    # Like megatron-core's, a call given a list of shapes (or a list of tensors) answers with a list.
    @staticmethod
    def _listy(arg) -> bool:
        return isinstance(arg, list) and (len(arg) == 0 or not isinstance(arg[0], int))

    def _wrap(self, result, as_list: bool):
        return [result] if as_list else result

    def recv_forward(self, tensor_shapes, is_first_stage: bool):
        out = None if is_first_stage else self._exchange([], None, 0, self.recv_fwd, self.seq_in, _FWD_TAG, True)
        return self._wrap(out, self._listy(tensor_shapes))

    def recv_backward(self, tensor_shapes, is_last_stage: bool):
        out = None if is_last_stage else self._exchange([], None, 0, self.recv_bwd, self.seq_out, _BWD_TAG, False)
        return self._wrap(out, self._listy(tensor_shapes))

    def send_forward(self, output_tensors, is_last_stage: bool) -> None:
        if not is_last_stage:
            self._exchange(self.send_fwd, self._one(output_tensors), _FWD_TAG, [], 0, 0, False)

    def send_backward(self, input_tensor_grads, is_first_stage: bool) -> None:
        if not is_first_stage:
            self._exchange(self.send_bwd, self._one(input_tensor_grads), _BWD_TAG, [], 0, 0, False)

    def send_forward_recv_backward(self, output_tensors, tensor_shapes, is_last_stage: bool):
        out = None
        if not is_last_stage:
            out = self._exchange(self.send_fwd, self._one(output_tensors), _FWD_TAG,
                                 self.recv_bwd, self.seq_out, _BWD_TAG, False)
        return self._wrap(out, isinstance(output_tensors, list))

    def send_backward_recv_forward(self, input_tensor_grads, tensor_shapes, is_first_stage: bool):
        out = None
        if not is_first_stage:
            out = self._exchange(self.send_bwd, self._one(input_tensor_grads), _BWD_TAG,
                                 self.recv_fwd, self.seq_in, _FWD_TAG, True)
        return self._wrap(out, isinstance(input_tensor_grads, list))
