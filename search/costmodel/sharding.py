"""Megatron FSDP in the cost model: what each sharding strategy keeps per GPU, and its collectives' exposed time.

Memory (megatron-core 0.16.1 ``megatron_fsdp/param_and_grad_buffer.py``, ``_init_each_parameter_group_buffers``),
per parameter of the stage on one GPU, ``d`` = the DP x CP group (``dp_cp_group``), ``w`` / ``g`` the weight and
gradient bytes (2 and 2, or 4 with ``grad_reduce_in_fp32``), ``o`` = 12 (fp32 main weight, Adam m and v):

    no_shard             w     + g     + o
    optim                w     + g     + o / d      (main weights and Adam states sharded: the distributed optimizer)
    optim_grads          w     + g / d + o / d
    optim_grads_params   w / d + g / d + o / d

plus, for the sharded strategies, FSDP's temporary unsharded buffers of the layers in flight (``fsdp_buffer_mb``):
``IN_FLIGHT_LAYERS`` = 2 layers (the one computing and the one prefetched / being reduce-scattered:
``MegatronFSDP`` all-gathers the next FSDP unit while one runs, ``suggested_communication_unit_size`` = twice a
unit's elements) of whole-layer weights (``optim_grads_params``) and of whole-layer gradients (``optim_grads`` and
``optim_grads_params``), ``L`` = the stage's largest layer per rank (parameters after the TP split).

Time per micro-batch (the strategies that shard gradients reduce-scatter them after every backward,
``grad_reduce_every_bprop``; ``optim_grads_params`` re-gathers each layer's weights before its backward, the
weights having been released after its forward), ``n`` = layers of the stage, ``P`` = its parameters per rank:

    forward   optim_grads_params: all-gather of P w bytes in n per-layer buckets behind the forward F
    backward  optim_grads_params: all-gather of P w bytes + reduce-scatter of P g bytes, in n buckets, behind B
              optim_grads: reduce-scatter of P g bytes in n buckets behind B

each overlapped as megatron-core overlaps DDP buckets (``comm.overlapped``: exposed = the last bucket or what does not
fit behind the window; the hidden part taxes the compute, ``comm.overlap_tax``) when ``overlap_grad_reduce`` /
``overlap_param_gather`` are on, else wholly exposed. The exposed parts add to the micro-batch's forward and backward;
``StageCost.comm`` reports them per iteration as ``fsdp_param_gather`` and ``fsdp_grad_reduce``. ``no_shard`` and
``optim`` reduce once per iteration as DDP and the distributed optimizer do (all-reduce; reduce-scatter and the step's
parameter all-gather); ``optim_grads`` gathers the updated weights after the step too; ``optim_grads_params`` does not
(each rank updates its own shard; the next forward gathers it).
"""

from __future__ import annotations

from search.settings.fsdp import shards
from .comm import overlapped

IN_FLIGHT_LAYERS = 2    # layers whose whole weights / gradients FSDP holds at once (one computing, one prefetched)


def state_divisors(strategy: str, dpc: int, distributed_optimizer: bool) -> tuple[int, int, int]:
    """Divisors of the (weight, gradient, optimizer) bytes per parameter: FSDP's strategy, else DDP (optimizer
    sharded with the distributed optimizer)."""
    if not strategy:
        return 1, 1, dpc if distributed_optimizer else 1
    w, g, o = shards(strategy)
    return dpc if w else 1, dpc if g else 1, dpc if o else 1


def fsdp_buffer_mb(strategy: str, dpc: int, layer_params: float, w_bytes: float, g_bytes: float) -> float:
    """MiB of the whole-layer weight and gradient buffers FSDP holds in flight (none without sharding)."""
    if dpc <= 1 or not strategy:
        return 0.0
    w, g, _ = shards(strategy)
    per_layer = (w_bytes if w else 0.0) + (g_bytes if g else 0.0)
    return IN_FLIGHT_LAYERS * layer_params * per_layer / 2**20


def per_micro_batch(strategy: str, dpc: int, nbytes: tuple[float, float], layers: int, fwd: float, bwd: float,
                    gather, reduce, tax: float, overlap_ag: bool, overlap_rs: bool):
    """((exposed fwd, exposed bwd), param-gather (exposed, hidden), grad-reduce (exposed, hidden)) ms of one
    micro-batch. ``nbytes``: the stage's (weight, gradient) bytes per rank, whole; ``gather(b)`` / ``reduce(b)``:
    the all-gather / reduce-scatter ms of a full tensor of ``b`` bytes over the DP x CP group. In the backward the
    reduce-scatters queue behind the all-gathers on the one DP stream: their window is what the gathers leave."""
    zero = (0.0, 0.0)
    if dpc <= 1 or strategy not in ("optim_grads", "optim_grads_params"):
        return zero, zero, zero
    n = max(1, layers)
    w_all, g_all = nbytes
    ag_f = ag_b = zero
    rs_window = bwd
    if strategy == "optim_grads_params":
        ag_f = _hide(n * gather(w_all / n), gather(w_all), n, fwd, tax, overlap_ag)
        ag_b = _hide(n * gather(w_all / n), gather(w_all), n, bwd, tax, overlap_ag)
        rs_window = max(0.0, bwd - ag_b[1])
    rs = _hide(n * reduce(g_all / n), reduce(g_all), n, rs_window, tax, overlap_rs)
    exposed = (ag_f[0], ag_b[0] + rs[0])
    return exposed, (ag_f[0] + ag_b[0], ag_f[1] + ag_b[1]), rs


def _hide(t_bucketed: float, t_single: float, n: int, window: float, tax: float, on: bool) -> tuple[float, float]:
    """(exposed, hidden) of a bucketed collective behind ``window`` ms (``comm.overlapped``, taxed), or exposed."""
    if not on:
        return t_single, 0.0
    exp, hid = overlapped(t_bucketed, t_single, n, window)
    return min(t_single, exp + tax * hid), hid
