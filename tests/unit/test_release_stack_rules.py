"""Megatron-LM's validate_args rules on the stack switches beside the line's other flags (``stack_flags.
release_stack_refusal``), shared by the export and the import: megatron-core's own CUDA graphs with expert
parallelism need ``--moe-pad-experts-for-cuda-graph-inference`` before core_v0.18 (core_v0.16.1 arguments.py:1158,
core_v0.17.1 :1458; gone from core_v0.18.2), and the fine-grained offload needs transformer-engine's layers
(core_v0.16.1 :1222 to core_v0.19.0 :1854). The releases' own validate_args run the same lines in
tests/runtime/test_megatron_lm_oracle.py (with Megatron-LM checkouts)."""

import pytest

from search.io.errors import AcesoError
from search.megatron import megatron_config
from search.megatron.importer import read_megatron
from search.megatron.script import args_line
from search.megatron.versions import release
from search.settings.stack import CudaGraphs, FineGrainedOffload, StackSettings
from search.spec.cluster import parse_cluster
from search.spec.plan import ParallelPlan, uniform_plan
from tests.unit.test_moe_cost import tiny_moe

PAD = "--moe-pad-experts-for-cuda-graph-inference"


def _plan(ep: int = 2, stack: StackSettings | None = None) -> ParallelPlan:
    m = tiny_moe(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    data = uniform_plan(m, 1, 1, 4, 4, 8, cluster=parse_cluster("1x4-h100")).model_dump()
    data["stages"][0]["ep"] = ep
    stack = stack or StackSettings(cuda_graphs=CudaGraphs(impl="local", scope=("full_iteration",)))
    data["settings"]["stack"] = stack.model_dump()
    return ParallelPlan.model_validate(data)


@pytest.mark.parametrize("version,asserted", [("0.16", True), ("0.17", True), ("0.18", False), ("0.19", False)])
def test_local_graphs_with_ep_write_the_inference_pad_where_the_release_asserts_it(version, asserted):
    line = args_line(megatron_config(_plan()), release(version))
    assert (PAD in line) == asserted
    assert read_megatron(line, world_size=4, version=version).plan.stages[0].ep == 2   # read back, nothing ignored
    assert not read_megatron(line, world_size=4, version=version).ignored
    bare = line.replace(" " + PAD, "")
    if asserted:
        with pytest.raises(AcesoError, match=f"asserts '{PAD}"):
            read_megatron(bare, world_size=4, version=version)
    else:
        assert read_megatron(bare, world_size=4, version=version).plan.stages[0].ep == 2


@pytest.mark.parametrize("ep,stack", [
    (1, StackSettings(cuda_graphs=CudaGraphs(impl="local", scope=("full_iteration",)))),      # no EP
    (2, StackSettings(cuda_graphs=CudaGraphs(impl="transformer_engine", scope=("attn",)))),  # TE's graphs
])
def test_the_pad_is_only_for_local_graphs_with_ep(ep, stack):
    assert PAD not in args_line(megatron_config(_plan(ep, stack)), release("0.16"))


def test_the_offload_with_local_layers_is_refused_by_the_import():
    plan = _plan(stack=StackSettings(offload=FineGrainedOffload(modules=("expert_fc1",))))
    line = args_line(megatron_config(plan), release("0.19"))
    assert "--transformer-impl transformer_engine" in line
    read_megatron(line, world_size=4, version="0.19")
    local = line.replace("--transformer-impl transformer_engine", "--transformer-impl local")
    with pytest.raises(AcesoError, match="--fine-grained-activation-offloading with --transformer-impl local"):
        read_megatron(local, world_size=4, version="0.19")
