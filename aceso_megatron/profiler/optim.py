"""Optimizer-step profiling: the runtime's megatron-core Adam step and gradient clipping, per parameter.

The cost model's optimizer time is analytic (memory-bound Adam at the GPU's HBM bandwidth); on CPU, and with
unfused optimizer kernels, the real step is several times slower. The profiler builds the runtime
(``engine.build_runtime``) for a one-stage, tp 1, dp = world plan of the one-layer model, fills the gradient
buffers with noise, and times ``clip_grad_norm`` and ``optimizer.step()``; dividing by this rank's parameter
count gives microseconds per parameter, which scale to any stage (both are linear in the parameters). The runtime
is released when the probe ends (``training.teardown.release``), as ``aceso train`` releases its own.
"""

from __future__ import annotations

import torch

from search.spec.model import ModelSpec

from .timing import repeat
from .units import one_layer


def probe_raw(model: ModelSpec, world: int) -> dict:
    m = one_layer(model)
    return {"model": m.model_dump(), "micro_batch_size": world, "global_batch_size": world,
                "stages": [{"num_gpus": world, "tp": 1, "dp": world, "start_unit": 0, "end_unit": m.num_units,
                             "recompute": ["none"] * m.num_units}]}


def optimizer_step(model: ModelSpec, world: int, rank: int, device: str, warmup: int, repeats: int) -> dict:
    from ..parallel.grads import clip_grad_norm
    from ..training.engine import build_runtime
    from ..training.teardown import release

    rt = build_runtime(probe_raw(model, world), rank, world, seed=1, device=device)
    try:
        with torch.no_grad():
            for b in rt.model.buffers:
                b.grad_data.normal_(0.0, 1e-3)

        def step(clock):
            clip_grad_norm(rt, 1.0)
            clock.mark()
            rt.optimizer.step()
            clock.mark()

        clip, opt = repeat(step, 2, warmup + 1, repeats, device, rt.groups.world)
        n = sum(p.numel() for p in rt.stage_module.parameters())
    finally:
        release(rt)   # its DDP, buffers and optimizer; the worker's groups stay for the next probe (teardown)
    return {"params": n, "step_us": opt.median_us, "clip_us": clip.median_us,
            "us_per_param": opt.median_us / n, "clip_us_per_param": clip.median_us / n,
            "spread": [round(clip.spread, 4), round(opt.spread, 4)]}
