"""The optimizer's states per parameter, its step's time and the data-parallel collectives it runs: Adam, Muon and
``dist_muon`` (Megatron-LM ``--optimizer adam|muon|dist_muon``; megatron-core 0.16.1 ``optimizer/muon.py``,
``optimizer/layer_wise_optimizer.py``).

**Adam** (``DistributedOptimizer`` / ``Float16OptimizerWithFloat16Params``): fp32 main weight, m and v, 12 B per
parameter (fp32 training 8), sharded over DP x CP with the distributed optimizer; the step is memory bound
(``evaluate.OPT_BYTES_PER_PARAM``).

**Muon** (``get_megatron_muon_optimizer``): every 2-D weight but the embedding and output layer (``linear_params``;
the router's too) is updated by ``TensorParallelMuon``, the rest (norms, biases, embedding, output) by Adam. A Muon
parameter keeps its fp32 main weight (``Float16OptimizerWithFloat16Params``) and a momentum buffer
(``muon_init_state_fn``: ``zeros_like`` of the fp32 main weight): 8 B. "muon with dist optimizer is not supported":
its states are not sharded, and the DDP all-reduces the gradients. The step, per Muon weight shard of ``m x n``
(``m <= n``; ``muon_tp_mode`` blockwise, megatron-core's default: each TP / ETP rank orthogonalises its own shard;
``muon_split_qkv``: QKV as its q, k and v parts): ``muon_num_ns_steps`` (5) Newton-Schulz iterations
``X <- a X + (b A + c A^2) X``, ``A = X X^T``: ``4 m^2 n + 2 m^3`` FLOPs each at the bf16 GEMM rate
(``muon_fp32_matmul_prec`` medium: bf16 inputs), plus its element-wise passes (read the gradient, momentum and main
weight, write the momentum, main weight and weight: ``MUON_BYTES`` per parameter, memory bound).

**dist_muon** (``LayerWiseDistributedOptimizer``): the same states and work, each parameter whole on one DP x CP
rank (expert parameters on one expert-DP rank; assigned ping-pong by size, so about 1/d of each): states and the
step's work / d. The DDP all-reduces the gradients (every rank keeps the full gradients), and after the step the
updated parameters are all-gathered over the group (``allgather_params``, an ``all_gather`` of the parameter
dtype) -- instead of the distributed optimizer's reduce-scatter and all-gather.

Hand-computed: tests/unit/test_stack_features.py.
"""

from __future__ import annotations

from ..layers import resolve

NS_STEPS = 5                 # megatron-core OptimizerConfig.muon_num_ns_steps
MUON_BYTES = 22.0            # per Muon parameter per step: read grad (4) + momentum (4) + main (4), write momentum (4)
#                              + main (4) + the bf16 weight (2)
MUON_OPT_BYTES = 8.0         # fp32 main weight + momentum
OPTIMIZERS = ("adam", "muon", "dist_muon")


def is_muon(optimizer: str) -> bool:
    return optimizer in ("muon", "dist_muon")


def dp_collectives(optimizer: str, distributed_optimizer: bool) -> tuple[bool, bool]:
    """(gradients reduce-scattered and states sharded, parameters all-gathered after the step) over the DP group:
    Adam with the distributed optimizer (True, True), without (False, False); muon (False, False); dist_muon
    (False, True): the gradients all-reduced, the states sharded layer-wise, the parameters gathered."""
    if optimizer == "dist_muon":
        return False, True
    if optimizer == "muon":
        return False, False
    return distributed_optimizer, distributed_optimizer


def shards_states(optimizer: str, distributed_optimizer: bool) -> bool:
    """Whether the optimizer states (and the gradient copy) are sharded over the DP group."""
    return optimizer == "dist_muon" or (optimizer == "adam" and distributed_optimizer)


def ns_flops(m: float, n: float) -> float:
    """FLOPs of the Newton-Schulz iterations on one ``m x n`` shard (module docstring)."""
    a, b = min(m, n), max(m, n)
    return NS_STEPS * (4.0 * a * a * b + 2.0 * a ** 3)


def muon_matrices(model, kind: str, tp: int, ep: int = 1, etp: int = 0) -> list[tuple[float, float, float]]:
    """The 2-D weight shards one rank's unit of ``kind`` holds, as ``(rows, cols, count)`` (module docstring): its
    layer kind's ``muon_shapes`` (``search/layers/``: attention QKV, split into q, k, v per query group, and
    projection; the MLP's fc1 / fc2; an MoE unit's router, its local experts' fc1 / fc2 over etp, second and
    third, and shared expert; MLA's down, up and output projections). Whatever Muon updates beyond these (nothing
    in these models) is left out."""
    shapes = resolve(model, kind).muon_shapes
    return shapes(model, tp, ep, etp or tp) if shapes is not None else []


def muon_params(mats: list[tuple[float, float, float]]) -> float:
    """Parameters of ``muon_matrices``' shards."""
    return sum(r * c * k for r, c, k in mats)


def step_ms(adam_params: float, muon_params_: float, ns: float, adam_ms_per_param: float, hbm_bytes_per_ms: float,
            gemm_flops_per_ms: float, shard: int = 1) -> float:
    """The step's ms on one rank: Adam's memory-bound pass over ``adam_params``, Muon's element-wise passes over
    ``muon_params_`` and its Newton-Schulz ``ns`` FLOPs at ``gemm_flops_per_ms``, each / ``shard`` (dist_muon and
    the distributed optimizer: the rank's share)."""
    return (adam_params * adam_ms_per_param + muon_params_ * MUON_BYTES / hbm_bytes_per_ms
            + ns / gemm_flops_per_ms) / max(shard, 1)
