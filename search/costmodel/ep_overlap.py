"""The MoE expert-parallel communication overlap (``--overlap-moe-expert-parallel-comm``) and its delayed weight
gradients (``--delay-wgrad-compute``), priced as megatron-core schedules them.

megatron-core 0.16.1 runs one micro-batch's forward and another's backward together, layer by layer
(``models/common/model_chunk_schedule_plan.py``, ``TransformerLayerSchedulePlan.run``), the communication on its own
stream: for a forward layer of micro-batch A and a backward layer of micro-batch B

    comm stream:  combine_bwd(B) | dispatch_fwd(A) -> dispatch_bwd(B)       | combine_fwd(A)
    comp stream:  attn_fwd(A)    | mlp_bwd(B) -> mlp_dw(B) -> mlp_fwd(A)   | attn_bwd(B) -> attn_dw(B)

each node waiting for what it consumes (``layer_pair_ms``: dispatch_fwd(A) after attn_fwd(A), mlp_bwd(B) after
combine_bwd(B), dispatch_bwd(B) after mlp_bwd(B), mlp_fwd(A) after dispatch_fwd(A), combine_fwd(A) after mlp_fwd(A),
attn_bwd(B) after dispatch_bwd(B)). Without ``delay_wgrad_compute`` the weight gradients are part of mlp_bwd /
attn_bwd (the dispatch backward waits for them too); with it, ``backward_dw`` runs the experts' (and attention's)
weight-gradient GEMMs after the dispatch backward is launched, so that all-to-all hides behind them.

The pair's time against the same work in sequence is what the overlap saves; the communication that runs beside
compute takes SMs from it (NCCL's or DeepEP's / HybridEP's kernels: ``comm.overlap_tax`` per ms hidden, the same
tax as every other overlapped collective). The saving is split over the moe unit's forward and backward in
proportion to their all-to-all (``UnitTable.ep_hidden_ms``: hidden; ``ep_comm_ms``: still exposed).
Hand-computed: tests/unit/test_stack_features.py.
"""

from __future__ import annotations

from typing import NamedTuple


class LayerTimes(NamedTuple):
    """One layer's parts, ms (forward of micro-batch A, backward of micro-batch B)."""

    attn_f: float
    attn_b: float       # the attention backward without its weight gradients when they are delayed
    attn_dw: float      # delayed attention weight gradients (0 without delay_wgrad_compute)
    mlp_f: float        # the moe unit's compute forward (router, experts, shared expert)
    mlp_b: float        # its backward without the delayed weight gradients
    mlp_dw: float       # the experts' delayed weight gradients (0 without delay_wgrad_compute)
    dispatch_f: float
    combine_f: float
    dispatch_b: float
    combine_b: float


def layer_pair_ms(x: LayerTimes, tax: float = 0.0) -> float:
    """The overlapped pair's time (module docstring): the two streams' dependency schedule, plus ``tax`` ms of
    compute per ms of communication running beside it."""
    c_b_end = x.combine_b
    attn_f_end = x.attn_f
    mlp_b_end = max(attn_f_end, c_b_end) + x.mlp_b
    d_f_end = max(c_b_end, attn_f_end) + x.dispatch_f
    dw_end = mlp_b_end + x.mlp_dw
    d_b_end = max(d_f_end, mlp_b_end) + x.dispatch_b
    mlp_f_end = max(dw_end, d_f_end) + x.mlp_f
    c_f_end = max(d_b_end, mlp_f_end) + x.combine_f
    attn_b_end = max(mlp_f_end, d_b_end) + x.attn_b + x.attn_dw
    comm = x.combine_b + x.dispatch_f + x.dispatch_b + x.combine_f
    end = max(attn_b_end, c_f_end)
    comp = x.attn_f + x.attn_b + x.attn_dw + x.mlp_f + x.mlp_b + x.mlp_dw
    hidden = max(0.0, comm + comp - end)          # communication that ran beside compute
    return end + tax * hidden


def sequential_ms(x: LayerTimes) -> float:
    """The same work with nothing overlapped."""
    return sum(x)


def saving_ms(x: LayerTimes, tax: float = 0.0) -> float:
    """What the overlap saves on one layer pair (never more than its communication, never negative)."""
    comm = x.combine_b + x.dispatch_f + x.dispatch_b + x.combine_f
    return min(comm, max(0.0, sequential_ms(x) - layer_pair_ms(x, tax)))
