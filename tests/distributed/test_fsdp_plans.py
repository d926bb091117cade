"""Megatron FSDP plans on gloo against a single-process stock megatron-core ``GPTModel`` (fp32).

Each plan as in ``test_plans.py``: loss and every gradient after one step (relative <= 1e-5), the losses of 3
clipped optimizer steps and the weights after them. The plans run through megatron-core's own
``FullyShardedDataParallel`` (``aceso_megatron.training.fsdp``; on CPU with ``patches.fsdp_cpu``) and its distributed
optimizer: ``optim_grads_params`` (ZeRO-3: every unit's weights all-gathered per forward and backward),
``optim_grads`` (ZeRO-2) and ``optim``, on a Llama (SwiGLU, RMSNorm, RoPE, untied) and a GPT (GELU,
biases, LayerNorm, tied embeddings), with recompute. The control (ZeRO-2) reduce-scatters without the reduction
(each rank keeps its own micro-batches' gradient shard) and must fail on gradients. The runtime's checkpoint
of an FSDP plan is refused (``fsdp.checkpoint_refusal``) with the reason megatron-core gives here. With TP (4
gloo ranks): tp2 x dp2 under each strategy, with sequence parallelism, recompute and a tied GPT; its control
leaves the SP partial gradients (the norms') on FSDP's shards unsummed over TP and must fail on the norms'
gradients. MoE (4 gloo ranks,
dp 4, EP 2, expert-DP 2) under ``optim_grads_params`` and ``optim_grads``, alltoall and allgather, against the stock
MoE model; its control leaves the expert-DP reduce-scatter unreduced and must fail on the expert gradients only.
Needs einops
(megatron-core's FSDP device mesh); skipped without it.
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


def plan(model, strategy, dp=2, rc=None, mb=2, gbs=4, tp=1, sp=False):
    n = model.num_layers * 2
    return {"model": model.model_dump(), "micro_batch_size": mb, "global_batch_size": gbs,
            "stages": [{"num_gpus": tp * dp, "tp": tp, "dp": dp, "start_unit": 0, "end_unit": n,
                        "sequence_parallel": sp, "recompute": rc or ["none"] * n}],
            "megatron_fsdp": {"data_parallel_sharding_strategy": strategy}}


PLANS = {
    "llama optim_grads_params (ZeRO-3) dp2": plan(LLAMA, "optim_grads_params"),
    "llama optim_grads (ZeRO-2) dp2, 2 micro-batches": plan(LLAMA, "optim_grads", mb=2, gbs=8),
    "gpt optim_grads_params dp2, tied embeddings, recompute full and selective": plan(
        GPT, "optim_grads_params", rc=["full", "full", "none", "selective"]),
    "gpt optim dp2": plan(GPT, "optim"),
}
CONTROL = PLANS["llama optim_grads (ZeRO-2) dp2, 2 micro-batches"]
# TP inside FSDP (4 gloo ranks): each TP rank's FSDP shards its TP-local weights over DP; with SP the norms' partial
# gradients are summed over TP on the local shards (parallel.grads.grad_of)
TP_PLANS = {
    "llama tp2 x dp2 optim_grads_params (ZeRO-3)": plan(LLAMA, "optim_grads_params", tp=2),
    "llama tp2 + SP x dp2 optim_grads_params, recompute": plan(
        LLAMA, "optim_grads_params", tp=2, sp=True, rc=["selective", "none", "full", "none"]),
    "gpt tp2 + SP x dp2 optim_grads (ZeRO-2), tied embeddings, 2 micro-batches": plan(
        GPT, "optim_grads", tp=2, sp=True, gbs=8),
    "gpt tp2 + SP x dp2 optim": plan(GPT, "optim", tp=2, sp=True),
}
TP_CONTROL = TP_PLANS["llama tp2 + SP x dp2 optim_grads_params, recompute"]


def _scatter_without_reduction(output, input, op=None, group=None, async_op=False):
    """The control: FSDP's gradient reduce-scatter keeps each rank's own shard unreduced (its micro-batches only)."""
    output.copy_(input.chunk(dist.get_world_size(group))[dist.get_rank(group)])
    return _Done()


class _Done:
    def wait(self) -> None:
        pass


def checkpoint_format_error(raw, seed, tc) -> str:
    """What megatron-core's FSDP optimizer says when the runtime's checkpoint asks it for its state
    (``training.checkpoint.sharded_state_dict``: the ``fully_reshardable`` format): the reason
    ``fsdp.checkpoint_refusal`` quotes."""
    from aceso_megatron.training import checkpoint
    from aceso_megatron.training.engine import build_runtime

    rt = build_runtime(raw, dist.get_rank(), dist.get_world_size(), seed=seed, train_config=tc)
    try:
        checkpoint.sharded_state_dict(rt)
    except NotImplementedError as e:
        return f"NotImplementedError: {e}"
    return "no error"


def plans_then_control(rank, world_size, raws, out, control_out, seed, steps, tc) -> None:
    run_plans(rank, world_size, raws, out, seed, steps, tc)
    said = checkpoint_format_error(raws[0], seed, tc)
    if rank == 0:
        torch.save(said, out + ".ckpt")
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
    said = torch.load(str(out) + ".ckpt")
    assert said == "NotImplementedError: sharding_type fully_reshardable is not supported with Megatron FSDP.", said


def tp_plans_then_control(rank, world_size, raws, out, control_out, seed, steps, tc) -> None:
    """The TP plans, then the control: the SP partial gradients of FSDP's shards left unsummed over TP."""
    from aceso_megatron.parallel import grads

    run_plans(rank, world_size, raws, out, seed, steps, tc)
    right = grads.grad_of
    grads.grad_of = lambda p: None if getattr(p, "__fsdp_param__", False) else right(p)
    try:
        run_plans(rank, world_size, [TP_CONTROL], control_out, seed, steps, tc)
    finally:
        grads.grad_of = right


def test_fsdp_tp_plans_match_single_process(tmp_path, reference_process):  # noqa: F811
    names, raws = zip(*TP_PLANS.items())
    out, control = tmp_path / "results.pt", tmp_path / "control.pt"
    spawn(4, tp_plans_then_control, list(raws), str(out), str(control), SEED, STEPS, TC)
    failures = compare(names, raws, torch.load(out))
    assert not failures, "\n".join(failures)
    wrong = compare(["control"], [TP_CONTROL], torch.load(control))
    assert any(" grad " in f and "layernorm" in f for f in wrong), wrong


def _moe_plan(strategy, dispatcher="alltoall"):
    from tests.distributed.test_moe_plans import LLAMA_MOE, plan as moe_plan, st

    raw = moe_plan(LLAMA_MOE, st(1, 4, 0, 4, ep=2), mb=4, gbs=8, dispatcher=dispatcher)
    return {**raw, "megatron_fsdp": {"data_parallel_sharding_strategy": strategy}}


# MoE inside FSDP (4 gloo ranks, dp 4, EP 2, expert-DP 2): the experts' FSDP buffers sharded over expert-DP
MOE_PLANS = {
    "llama MoE dp4 EP 2 (expert-DP 2) optim_grads_params, alltoall": _moe_plan("optim_grads_params"),
    "llama MoE dp4 EP 2 (expert-DP 2) optim_grads, allgather": _moe_plan("optim_grads", "allgather"),
}
MOE_CONTROL = MOE_PLANS["llama MoE dp4 EP 2 (expert-DP 2) optim_grads_params, alltoall"]


def moe_plans_then_control(rank, world_size, raws, out, control_out, seed, steps, tc) -> None:
    """The MoE plans, then the control: reduce-scatters over a 2-rank group (only the expert-DP group here; the
    dense buffers reduce over dp 4) keep each rank's own shard unreduced."""
    run_plans(rank, world_size, raws, out, seed, steps, tc)
    right = dist.reduce_scatter_tensor

    def on_expert_dp_unreduced(output, input, op=None, group=None, async_op=False):
        if dist.get_world_size(group) == 2:
            return _scatter_without_reduction(output, input, op, group, async_op)
        return right(output, input, op=op, group=group, async_op=async_op)

    dist.reduce_scatter_tensor = on_expert_dp_unreduced
    try:
        run_plans(rank, world_size, [MOE_CONTROL], control_out, seed, steps, tc)
    finally:
        dist.reduce_scatter_tensor = right


def test_fsdp_moe_plans_match_single_process(tmp_path, reference_process):  # noqa: F811
    names, raws = zip(*MOE_PLANS.items())
    out, control = tmp_path / "results.pt", tmp_path / "control.pt"
    spawn(4, moe_plans_then_control, list(raws), str(out), str(control), SEED, STEPS, TC)
    failures = compare(names, raws, torch.load(out))
    assert not failures, "\n".join(failures)
    wrong = [f for f in compare(["control"], [MOE_CONTROL], torch.load(control)) if " grad " in f]
    assert wrong and all(".experts." in f for f in wrong), wrong   # the experts' gradients only
