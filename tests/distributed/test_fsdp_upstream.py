"""Why Megatron FSDP runs on one pipeline stage only: stock megatron-core 0.16.1 cannot build it with pipeline
parallelism, as Megatron-LM builds it (``parallel_state`` groups, no ``pg_collection``).

Two gloo ranks with megatron-core's own ``initialize_model_parallel``: at pipeline size 2 its
``FullyShardedDataParallel`` fails while building the device mesh (``_get_dp_tp_mesh`` lays
``torch.arange(world_size)`` out as ``(dp_cp ep tp)``: "Shape mismatch, 2 != 1"); the control, the same two ranks
as data parallel 2, builds the mesh its DP group asks for. ``training.fsdp.refusal`` quotes this reason.
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
            mesh = mcore_fsdp_adapter._get_dp_tp_mesh(parallel_state.get_data_parallel_group(with_context_parallel=True),
                                                      parallel_state.get_tensor_model_parallel_group())
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
    assert torch.load(tmp_path / "dp2.pt") == "mesh [[0, 1]]"
