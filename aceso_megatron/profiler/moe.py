"""The MoE part of unit profiling: the probe model, and the moe unit's extra columns (expert shape, expert weight
bytes, the forward split into megatron-core ``MoELayer``'s parts).

An MoE model's moe unit is measured by ``units.TPBench`` like any unit (fwd / bwd / recompute / bytes of the
runtime's own ``UnitLayer`` holding megatron-core 0.16.1's ``MoELayer``: router, token dispatcher, experts, shared
expert), built by the runtime at the probe stage's expert shape (``ep`` from ``aceso profile --ep``, etp = tp,
the dispatcher of ``PROBE_SETTINGS``; grouped GEMM and permute fusion as ``model.moe.fast_fields`` picks them for
the device, the same function a run uses). The unit's time includes its dispatch and combine all-to-alls over
the stage's EP group, measured with every EP rank running it at once.

``moe_columns`` adds what the cost model and a reader of the database need besides: ``ep``, ``etp``,
``dispatcher`` (the lookup key of the row with ``tp``), ``grouped_gemm`` and ``permute_fusion`` (what ran),
``expert_weight_bytes`` (the routed experts' parameters on one rank: their gradients reduce over expert-DP) and
``parts_fwd_us``: the medians of one forward split at ``MoELayer``'s own methods (``route`` + ``preprocess`` =
router, ``dispatch``, ``routed_experts_compute`` = experts, ``combine`` + ``postprocess`` = combine,
``shared_experts_compute`` = shared expert, the rest of the unit = the norm and residual), each bracketed by a
device synchronisation (so on a GPU their sum exceeds the unsynchronised ``fwd_us`` a little). The backward is
not split: autograd runs it as one graph.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from search.spec.model import ModelSpec
from search.settings.moe_plan import MoEPlanSettings

# what the probe plan runs: megatron-core's default dispatcher; grouped GEMM / permute fusion wherever the device
# has them (model.moe.fast_fields turns them off on CPU)
PROBE_SETTINGS = MoEPlanSettings(token_dispatcher="alltoall")
PARTS = {"router": ("route", "preprocess"), "dispatch": ("dispatch",), "experts": ("routed_experts_compute",),
         "combine": ("combine", "postprocess"), "shared_expert": ("shared_experts_compute",)}


def probe_model(model: ModelSpec) -> ModelSpec:
    """One MoE layer (and a dense one first where the model has dense layers too): every unit kind once."""
    dense = any(u.kind == "mlp" for u in model.units)
    moe = {**model.moe.model_dump(), "moe_layer_freq": [0, 1] if dense else 1, "first_k_dense_layers": 0}
    return ModelSpec.model_validate({**model.model_dump(), "num_layers": 2 if dense else 1, "moe": moe})


def moe_layer(unit_module: torch.nn.Module):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return next(m for m in unit_module.modules() if isinstance(m, MoELayer))


def moe_columns(bench, unit_module: torch.nn.Module, fwd) -> dict:
    """The moe unit's extra columns (module docstring) from the unit as built and its forward callable."""
    from .units import param_bytes

    layer = moe_layer(unit_module)
    cfg = layer.config
    experts = [p for n, p in unit_module.named_parameters() if ".experts." in n and "shared_experts" not in n]
    return {"ep": int(cfg.expert_model_parallel_size), "etp": int(cfg.expert_tensor_parallel_size or bench.tp),
            "dispatcher": cfg.moe_token_dispatcher_type, "grouped_gemm": bool(cfg.moe_grouped_gemm),
            "permute_fusion": bool(cfg.moe_permute_fusion), "expert_weight_bytes": float(param_bytes(experts)),
            "parts_fwd_us": time_parts(layer, fwd, bench.s.device, bench.s.warmup, bench.s.repeats,
                                       bench.groups.world)}


def time_parts(layer, fwd, device: str, warmup: int, repeats: int, group) -> dict[str, float]:
    """Median microseconds of each part of ``fwd()`` (one forward of the unit holding ``layer``)."""
    cuda = device == "cuda"
    acc: dict[str, float] = {}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def wrap(part, method):
        def timed(*a, **k):
            sync()
            t0 = time.perf_counter()
            out = method(*a, **k)
            sync()
            acc[part] = acc.get(part, 0.0) + 1e6 * (time.perf_counter() - t0)
            return out
        return timed

    names = [(part, name) for part, ns in PARTS.items() for name in ns
             if part != "shared_expert" or layer.use_shared_expert]
    for part, name in names:      # instance attributes shadow the class's methods until deleted below
        setattr(layer, name, wrap(part, getattr(layer, name)))
    samples: list[dict[str, float]] = []
    try:
        for i in range(warmup + repeats):
            dist.barrier(group=group)
            acc.clear()
            sync()
            t0 = time.perf_counter()
            out = fwd()
            sync()
            total = 1e6 * (time.perf_counter() - t0)
            del out
            if i >= warmup:
                samples.append({**acc, "norm_residual": max(total - sum(acc.values()), 0.0)})
    finally:
        for _, name in names:
            if name in layer.__dict__:
                delattr(layer, name)
    return {k: round(float(np.median([s.get(k, 0.0) for s in samples])), 3) for k in samples[0]}
