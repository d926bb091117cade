"""Run by tests/runtime/test_gdn_layer.py under megatron-core 0.19 (its Python 3.12 environment): builds megatron-core's
own ``GatedDeltaNet`` on CPU in one gloo process and prints its parameters, and which (tp, cp) its
``TransformerConfig`` refuses for a GDN model. GatedDeltaNet refuses to build without fla (flash-linear-attention,
CUDA kernels) and on a device other than CUDA: for a parameter count only, the module's fla check and kernel are
set to a placeholder (never called: no forward runs), its device to the CPU and its initialisation (a CUDA RNG
tracker) skipped. Input: JSON [{"spec": GDNSpec fields, "hidden": h, "grid": [[tp, cp], ...]}, ...] (every case in
one process: one torch and megatron-core start); output: one JSON line, a list of {"params", "refused"} in order."""

import json
import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    cases = json.loads(sys.stdin.read())
    from megatron.core.ssm.gated_delta_net import common, gdn
    common.HAVE_FLA = True
    gdn.chunk_gated_delta_rule = lambda *a, **k: None
    gdn.GatedDeltaNet.reset_parameters = lambda self: None
    torch.cuda.current_device = lambda: "cpu"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(1, 1)
    print(json.dumps([_case(case, gdn, common) for case in cases]))


def _case(case: dict, gdn, common) -> dict:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    base = dict(num_layers=4, hidden_size=case["hidden"], num_attention_heads=16, use_cpu_initialization=True,
                normalization="RMSNorm", **case["spec"])
    layer = gdn.GatedDeltaNet(TransformerConfig(**base), common.GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear), layer_number=1,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    params = {n: p.numel() for n, p in layer.named_parameters()}
    refused = []
    for tp, cp in case["grid"]:
        try:
            TransformerConfig(**base, experimental_attention_variant="gated_delta_net", linear_attention_freq=4,
                              tensor_model_parallel_size=tp, context_parallel_size=cp)
            refused.append(False)
        except AssertionError:
            refused.append(True)
    return {"params": params, "refused": refused}


if __name__ == "__main__":
    main()
