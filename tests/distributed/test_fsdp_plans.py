"""Megatron FSDP plans on gloo against a single-process stock megatron-core ``GPTModel`` (fp32).

Each plan as in ``test_plans.py``: loss and every gradient after one step (relative <= 1e-5), the losses of 3
clipped optimizer steps and the weights after them. The plans run through megatron-core's own
``FullyShardedDataParallel`` (``aceso_megatron.training.fsdp``; on CPU with ``patches.fsdp_cpu``) and its distributed
optimizer: ``optim_grads_params`` (ZeRO-3: every unit's weights all-gathered per forward and backward),
``optim_grads`` (ZeRO-2) and ``optim``, on a Llama (SwiGLU, RMSNorm, RoPE, untied) and a GPT (GELU,
biases, LayerNorm, tied embeddings), with recompute. The control (ZeRO-2) reduce-scatters without the reduction
(each rank keeps its own micro-batches' gradient shard) and must fail on gradients. Needs einops (megatron-core's FSDP device mesh); skipped without it.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from aceso_megatron.testing import run_plans, spawn
from tests.distributed.test_plans import SEED, STEPS, TC, compare, reference_process  # noqa: F401 (fixture)
from tests.tiny_models import GPT, LLAMA

pytestmark = pytest.mark.skipif(importlib.util.find_spec("einops") is None,
                                reason="megatron-core's FullyShardedDataParallel needs einops")


def plan(model, strategy, dp=2, rc=None, mb=2, gbs=4):
    n = model.num_layers * 2
    return {"model": model.model_dump(), "micro_batch_size": mb, "global_batch_size": gbs,
            "stages": [{"num_gpus": dp, "tp": 1, "dp": dp, "start_unit": 0, "end_unit": n,
                        "recompute": rc or ["none"] * n}],
            "megatron_fsdp": {"data_parallel_sharding_strategy": strategy}}


PLANS = {
    "llama optim_grads_params (ZeRO-3) dp2": plan(LLAMA, "optim_grads_params"),
    "llama optim_grads (ZeRO-2) dp2, 2 micro-batches": plan(LLAMA, "optim_grads", mb=2, gbs=8),
    "gpt optim_grads_params dp2, tied embeddings, recompute full and selective": plan(
        GPT, "optim_grads_params", rc=["full", "full", "none", "selective"]),
    "gpt optim dp2": plan(GPT, "optim"),
}
CONTROL = PLANS["llama optim_grads (ZeRO-2) dp2, 2 micro-batches"]


def _scatter_without_reduction(output, input, op=None, group=None, async_op=False):
    """The control: FSDP's gradient reduce-scatter keeps each rank's own shard unreduced (its micro-batches only)."""
    output.copy_(input.chunk(dist.get_world_size(group))[dist.get_rank(group)])
    return _Done()


class _Done:
    def wait(self) -> None:
        pass


def plans_then_control(rank, world_size, raws, out, control_out, seed, steps, tc) -> None:
    run_plans(rank, world_size, raws, out, seed, steps, tc)
    right = dist.reduce_scatter_tensor
    dist.reduce_scatter_tensor = _scatter_without_reduction
    try:
        run_plans(rank, world_size, [CONTROL], control_out, seed, steps, tc)
    finally:
        dist.reduce_scatter_tensor = right


def test_fsdp_plans_match_single_process(tmp_path, reference_process):  # noqa: F811
    names, raws = zip(*PLANS.items())
    out, control = tmp_path / "results.pt", tmp_path / "control.pt"
    spawn(2, plans_then_control, list(raws), str(out), str(control), SEED, STEPS, TC)
    failures = compare(names, raws, torch.load(out))
    assert not failures, "\n".join(failures)
    wrong = compare(["control"], [CONTROL], torch.load(control))
    assert any(" grad " in f for f in wrong), wrong
