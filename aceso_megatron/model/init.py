"""Plan-independent initialisation and TP (un)sharding of parameters.

Every parameter has a canonical name (its name in a plain single-process megatron-core model, see
``GPTStage.canonical_names``). Its full, unsharded value is drawn from a generator seeded with
``(seed, crc32(canonical name))``, with megatron-core's default rules: norms 1, biases 0, other weights
N(0, init_method_std), output projections (``linear_proj``, ``linear_fc2``) N(0, std / sqrt(2 * num_layers)), the
embeddings N(0, embedding_init_method_std) when the model's ``megatron`` block sets it. The modules of a user's
``layer_spec`` follow the same rules by name (a weight whose module name holds "norm" is 1).
A TP rank then takes its shard. The same seed therefore gives the same full model under any plan.

Sharding follows megatron-core's parameter attributes (``tensor_model_parallel``, ``partition_dim``): contiguous
blocks along the partition dim, except packed parameters whose parts are each split over TP: a gated MLP's
``linear_fc1`` (SwiGLU, quick GEGLU; full weight ``[gate; up]``, shard ``t`` ``[gate_t; up_t]``) and those megatron-core marks with
``partition_sizes`` (its local part sizes: Mamba's ``in_proj`` ``[z, x, B, C, dt]`` and ``conv1d`` ``[x, B, C]``).
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.distributed as dist

from search.spec.model import ModelSpec


def _is_glu_fc1(name: str, model: ModelSpec) -> bool:
    """A gated MLP's ``linear_fc1`` (SwiGLU, quick GEGLU: megatron-core's ``gated_linear_unit``), full ``[gate; up]``."""
    return model.gated_mlp and ".linear_fc1." in name


def full_shape(param: torch.Tensor, tp: int) -> list[int]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False) and tp > 1:
        shape[param.partition_dim] *= tp
    return shape


def full_value(name: str, shape: list[int], model: ModelSpec, seed: int, std: float = 0.02) -> torch.Tensor:
    """The canonical full value of parameter ``name``."""
    leaf = name.rsplit(".", 1)[-1]
    if ("norm" in name.rsplit(".", 2)[-2] and leaf == "weight") or leaf == "layer_norm_weight":  # TE fuses norms
        return torch.ones(shape)
    if leaf in ("bias", "layer_norm_bias"):
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.startswith("embedding."):   # megatron-core's embedding_init_method_std (default: init_method_std)
        std = float((model.megatron or {}).get("embedding_init_method_std", std))
    if ".linear_proj." in name or ".linear_fc2." in name:
        num_layers = model.num_layers + (model.num_decoder_layers or 0)
        std = std / math.sqrt(2.0 * num_layers)
    return torch.randn(shape, generator=gen) * std


def _local_parts(param: torch.Tensor, name: str, model: ModelSpec, local: int) -> list[int] | None:
    """The sizes of the parts of a packed TP shard of ``local`` rows along its partition dim (None: one part):
    megatron-core's ``partition_sizes``, or the SwiGLU halves (of the shard itself: under Megatron FSDP the
    parameter is not the TP shard)."""
    sizes = getattr(param, "partition_sizes", None)
    if sizes is not None:
        return list(sizes)
    if _is_glu_fc1(name, model):
        return [local // 2] * 2
    return None


def shard(full: torch.Tensor, param: torch.Tensor, name: str, model: ModelSpec, tp: int, tp_rank: int) -> torch.Tensor:
    """The TP shard ``tp_rank`` of ``full`` for ``param``."""
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim = param.partition_dim
    if parts := _local_parts(param, name, model, full.shape[dim] // tp):
        return torch.cat([p.chunk(tp, dim=dim)[tp_rank] for p in full.split([n * tp for n in parts], dim=dim)],
                         dim=dim)
    return full.chunk(tp, dim=dim)[tp_rank]


def unshard(shards: list[torch.Tensor], param: torch.Tensor, name: str, model: ModelSpec) -> torch.Tensor:
    """Inverse of ``shard``: the full tensor from all TP shards (in TP-rank order)."""
    tp = len(shards)
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return shards[0]
    dim = param.partition_dim
    if parts := _local_parts(param, name, model, shards[0].shape[dim]):
        split = [s.split(parts, dim=dim) for s in shards]
        return torch.cat([s[k] for k in range(len(parts)) for s in split], dim=dim)
    return torch.cat(shards, dim=dim)


@torch.no_grad()
def initialize(module: torch.nn.Module, names: dict[str, str], model: ModelSpec, seed: int, tp: int,
               tp_rank: int, std: float = 0.02, etp: tuple[int, int] = (1, 0)) -> None:
    """Overwrite every parameter of ``module`` with its shard of the canonical full value (routed experts: their
    expert-TP shard, ``etp`` = (degree, rank))."""
    from .moe import is_expert

    for local, p in module.named_parameters():
        canon = names[local]
        t, r = etp if is_expert(canon) else (tp, tp_rank)
        full = full_value(canon, full_shape(p, t), model, seed, std)
        p.copy_(shard(full, p, canon, model, t, r))


def gather_full(tensors: dict[str, torch.Tensor], params: dict[str, torch.Tensor], names: dict[str, str],
                model: ModelSpec, tp_group) -> dict[str, torch.Tensor]:
    """All-gather TP shards of ``tensors`` (keyed by local name) into full tensors keyed by canonical name."""
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    out = {}
    for local, t in tensors.items():
        p = params[local]
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=tp_group)
            t = unshard(parts, p, names[local], model)
        out[names[local]] = t.detach().clone()
    return out
