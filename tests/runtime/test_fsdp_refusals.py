"""What the runtime does not run of Megatron FSDP and activation offload is refused at its entry, one line, before
any process group (``training.engine.check_plan`` -> ``aceso_megatron.preflight.refusal``); before this a Megatron-LM plan
with those fields ran as plain DDP."""

from __future__ import annotations

import pytest

from search.io.errors import AcesoError
from tests.distributed.test_fsdp_plans import plan
from tests.tiny_models import LLAMA


def _check(raw, world):
    from aceso_megatron.model.fast_path import Environment
    from aceso_megatron.training.engine import check_plan

    return check_plan(raw, world, Environment.detect("cpu"))


def _two_stages(raw):
    st = raw["stages"][0]
    half = st["end_unit"] // 2
    return {**raw, "stages": [{**st, "end_unit": half, "recompute": st["recompute"][:half]},
                              {**st, "start_unit": half, "recompute": st["recompute"][half:]}]}


def _tp2(raw, dp=1):
    return {**raw, "stages": [{**raw["stages"][0], "num_gpus": 2 * dp, "tp": 2, "dp": dp}]}


def _moe(raw):
    moe = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 24}
    return {**raw, "model": {**raw["model"], "name": "tiny-llama-moe", "moe": moe},
            "moe": {"token_dispatcher": "allgather", "grouped_gemm": False, "permute_fusion": False}}


@pytest.mark.parametrize("raw, world, needle", [
    # megatron-core's own limit (tests/distributed/test_fsdp_upstream.py): the mesh spans the whole world
    (_two_stages(plan(LLAMA, "optim_grads")), 4, "megatron_fsdp with 2 pipeline stages (1 chunks each): "
     "megatron-core 0.16.1 builds Megatron FSDP's device mesh from the whole world as (dp_cp ep tp)"),
    (plan(LLAMA, "no_shard"), 2, "megatron_fsdp no_shard"),
    # 0.16.1 doubles every gradient at DP x CP 1 (tests/distributed/test_fsdp_upstream.py measures it)
    (_tp2(plan(LLAMA, "optim_grads_params")), 2, "megatron_fsdp optim_grads_params with dp x cp 1: megatron-core "
     "0.16.1 counts every gradient twice"),
    (plan(LLAMA, "optim_grads", dp=1), 1, "megatron_fsdp optim_grads with dp x cp 1"),
    (_moe(plan(LLAMA, "optim_grads_params", tp=2, sp=True)), 4, "megatron_fsdp with an MoE model at tp 2 / etp 2"),
    ({**_moe(plan(LLAMA, "optim_grads_params")), "stages": [{**plan(LLAMA, "optim")["stages"][0], "ep": 2}]}, 2,
     "megatron_fsdp optim_grads_params with expert-DP (num_gpus / (etp x ep)) 1"),
    ({**plan(LLAMA, "optim"), "megatron_fsdp": None, "activation_offload": {"num_layers": 1}}, 2,
     "activation_offload: the aceso runtime keeps activations"),
])
def test_refused_in_one_line(raw, world, needle):
    with pytest.raises(AcesoError) as e:
        _check(raw, world)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("raw, world", [
    (plan(LLAMA, "optim_grads_params"), 2),
    (_tp2(plan(LLAMA, "optim_grads_params", tp=2, sp=True), dp=2), 4),   # tp > 1 with SP runs (test_fsdp_plans)
    (plan(LLAMA, "optim", dp=1), 1),   # optim reduces its unsharded buffer once: right at DP 1 too
    ({**_moe(plan(LLAMA, "optim_grads_params", dp=4, mb=4, gbs=8)),   # EP 2, expert-DP 2 (test_fsdp_plans)
      "stages": [{**plan(LLAMA, "optim", dp=4)["stages"][0], "ep": 2}]}, 4),
])
def test_what_runs_passes_the_entry(raw, world):
    pytest.importorskip("einops")
    assert _check(raw, world).megatron_fsdp.data_parallel_sharding_strategy == \
        raw["megatron_fsdp"]["data_parallel_sharding_strategy"]


def test_the_one_preflight_answers_as_the_entry_does():
    """validate, the search's output check and launch share ``search.targets.preflight.preflight``: it passes the FSDP plans
    the runtime runs (one stage, tp 1 or tp 2 + SP); 2 stages, which megatron-core cannot build in any framework,
    are no plan (``search.settings.fsdp.structural_refusal``, the same line as the entry's)."""
    pytest.importorskip("einops")
    from search.spec.plan import ParallelPlan
    from search.targets.preflight import preflight

    assert preflight(ParallelPlan.model_validate(plan(LLAMA, "optim_grads_params")), "cpu") is True
    assert preflight(ParallelPlan.model_validate(plan(LLAMA, "optim_grads", tp=2, sp=True)), "cpu") is True
    with pytest.raises(ValueError, match="megatron_fsdp with 2 pipeline stages"):   # megatron-core's limit: the plan
        ParallelPlan.model_validate(_two_stages(plan(LLAMA, "optim_grads")))         # itself (search.settings.fsdp)


@pytest.mark.parametrize("flags, needle", [(["--save", "ckpt"], "--save with megatron_fsdp"),
                                           (["--load", "ckpt"], "--load with megatron_fsdp")])
def test_checkpoints_of_fsdp_plans_refused_before_training(tmp_path, flags, needle):
    """``aceso train`` (and ``aceso launch``, before any process) refuses to checkpoint a Megatron FSDP plan: the
    FSDP optimizer's state has only megatron-core's fsdp_dtensor format (the reason is measured on stock
    megatron-core in tests/distributed/test_fsdp_plans.py)."""
    from aceso_megatron.training.args import check_train_args, parse_train_args
    from search.spec.plan import ParallelPlan

    fsdp = ParallelPlan.model_validate(plan(LLAMA, "optim_grads_params"))
    flags = [flags[0], str(tmp_path / flags[1])]
    args = parse_train_args("plan.json", ["--mock-data", "--train-iters", "2", *flags])
    with pytest.raises(AcesoError) as e:
        check_train_args(args, fsdp)
    assert needle in str(e.value) and "fsdp_dtensor" in str(e.value) and "\n" not in str(e.value)
    if flags[0] == "--save":   # the same flags under the plan without FSDP pass
        check_train_args(args, fsdp.model_copy(update={"megatron_fsdp": None}))
