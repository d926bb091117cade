"""Why Megatron FSDP runs on one pipeline stage only: stock megatron-core 0.16.1 cannot build it with pipeline
parallelism, as Megatron-LM builds it (``parallel_state`` groups, no ``pg_collection``).

Two gloo ranks with megatron-core's own ``initialize_model_parallel``: at pipeline size 2 its
``FullyShardedDataParallel`` fails while building the device mesh (``_get_dp_tp_mesh`` lays
``torch.arange(world_size)`` out as ``(dp_cp ep tp)``: "Shape mismatch, 2 != 1"); the control, the same two ranks
as data parallel 2, builds the mesh its DP group asks for. ``training.fsdp.refusal`` quotes this reason.

And why DP x CP 1 is refused under ``optim_grads`` / ``optim_grads_params``: one rank, the runtime's entry refusal
lifted, megatron-core's FSDP gradients against its DDP's on the same model and micro-batch -- every gradient exactly
twice DDP's (the reduce-scatter output added onto the unsharded bucket it read; with more micro-batches no
multiple at all: measured 2.8-3.4x, 41 % off), while ``optim`` (reduced once, into the buffer) equals DDP's.
megatron-core 0.19 fixed the double count (each strategy equals DDP's there) but not the pipeline mesh.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from aceso_megatron.testing import spawn

pytestmark = pytest.mark.skipif(importlib.util.find_spec("einops") is None,
                                reason="megatron-core's FullyShardedDataParallel needs einops")


def _tiny(config):
    from megatron.core.transformer.module import MegatronModule

    class Tiny(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.w = torch.nn.Parameter(torch.ones(4, 4))

    return Tiny()


def build_under(rank, world_size, pp, out) -> None:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    from megatron.core.transformer import TransformerConfig

    from patches import cpu_mode

    cpu_mode.apply()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, pipeline_dtype=torch.float32)
    ddp = DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                        data_parallel_sharding_strategy="optim_grads_params")
    try:
        if pp > 1:   # as Megatron-LM's get_model wraps a chunk
            mcore_fsdp_adapter.FullyShardedDataParallel(config, ddp, _tiny(config), device=torch.device("cpu"))
            result = "built"
        else:        # the control: the mesh of a world that is all data parallel
            dp = parallel_state.get_data_parallel_group(with_context_parallel=True)
            mesh = mcore_fsdp_adapter._get_dp_tp_mesh(dp, parallel_state.get_tensor_model_parallel_group())
            result = f"mesh {mesh.tolist()}"
    except Exception as e:   # noqa: BLE001 (the test reads what megatron-core raised)
        result = f"{type(e).__name__}: {e}"
    parallel_state.destroy_model_parallel()
    if rank == 0:
        torch.save(result, out)
    dist.barrier()


def test_megatron_fsdp_with_pipeline_stages_fails_in_stock_megatron_core(tmp_path):
    spawn(2, build_under, 2, str(tmp_path / "pp2.pt"))
    pp2 = torch.load(tmp_path / "pp2.pt")
    assert pp2.startswith("EinopsError") and "Shape mismatch, 2 != 1" in pp2, pp2
    spawn(2, build_under, 1, str(tmp_path / "dp2.pt"))
    assert torch.load(tmp_path / "dp2.pt") == "mesh [[0], [1]]"   # dp_cp x tp


def grads_at_dp1(rank, world_size, out) -> None:
    from aceso_megatron.testing import make_batches
    from aceso_megatron.training import engine
    from tests.distributed.test_fsdp_plans import plan
    from tests.tiny_models import LLAMA

    import search.settings.fsdp as plan_rules

    rule = plan_rules.structural_refusal
    plan_rules.structural_refusal = lambda p: None     # the plan rule that quotes this test lifted (the runtime's
    # entry check refuses nothing more of a dense one-stage plan): what megatron-core does at DP 1
    ratios = {}
    try:
        for strategy in (None, "optim", "optim_grads", "optim_grads_params"):
            raw = plan(LLAMA, strategy or "optim", dp=1, gbs=2)   # one micro-batch
            raw["megatron_fsdp"] = {"data_parallel_sharding_strategy": strategy} if strategy else None
            rt = engine.build_runtime(raw, rank, world_size, seed=3)
            rt.forward_backward(iter(make_batches(rt.plan.model, 2, 2, 3)))
            grads = rt.full_grads()
            if strategy is None:
                ddp = grads
            else:   # FSDP's gradient over DDP's, fitted per tensor, and how far from that multiple
                fits = {k: float((g * ddp[k]).sum() / (ddp[k] * ddp[k]).sum()) for k, g in grads.items()}
                off = max(float((grads[k] - fits[k] * ddp[k]).norm() / grads[k].norm()) for k in grads)
                ratios[strategy] = (min(fits.values()), max(fits.values()), off)
    finally:
        plan_rules.structural_refusal = rule
    torch.save(ratios, out)


def test_dp1_fsdp_counts_gradients_twice_in_stock_megatron_core_0_16(tmp_path):
    """0.16.1: twice DDP's gradient under the sharded strategies; fixed in 0.19 (once). The plan rule refusing a
    one-rank sharding group stays: over one rank FSDP shards nothing."""
    from patches.compat import at_least

    spawn(1, grads_at_dp1, str(tmp_path / "r.pt"))
    r = torch.load(tmp_path / "r.pt")
    want = 1 if at_least("0.19") else 2
    for strategy in ("optim_grads", "optim_grads_params"):
        lo, hi, off = r[strategy]
        assert abs(lo - want) < 1e-5 and abs(hi - want) < 1e-5 and off < 1e-5, (strategy, r[strategy])
    lo, hi, off = r["optim"]
    assert abs(lo - 1) < 1e-5 and abs(hi - 1) < 1e-5 and off < 1e-5, r["optim"]
