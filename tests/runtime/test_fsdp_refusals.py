"""What the runtime does not run of Megatron FSDP and activation offload is refused at its entry, one line, before
any process group (``training.engine.check_plan`` -> ``training.fsdp.refusal``); before this a Megatron-LM plan
with those fields ran as plain DDP."""

from __future__ import annotations

import pytest

from search.errors import AcesoError
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


def _tp2(raw):
    return {**raw, "stages": [{**raw["stages"][0], "num_gpus": 2, "tp": 2, "dp": 1}]}


@pytest.mark.parametrize("raw, world, needle", [
    (_two_stages(plan(LLAMA, "optim_grads")), 4, "megatron_fsdp with 2 pipeline stages"),
    (plan(LLAMA, "no_shard"), 2, "megatron_fsdp no_shard"),
    (_tp2(plan(LLAMA, "optim_grads_params")), 2, "megatron_fsdp with tp 2"),
    ({**plan(LLAMA, "optim"), "megatron_fsdp": None, "activation_offload": {"num_layers": 1}}, 2,
     "activation_offload: the aceso runtime keeps activations"),
])
def test_refused_in_one_line(raw, world, needle):
    with pytest.raises(AcesoError) as e:
        _check(raw, world)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_one_stage_tp1_fsdp_passes_the_entry():
    pytest.importorskip("einops")
    assert _check(plan(LLAMA, "optim_grads_params"), 2).megatron_fsdp.data_parallel_sharding_strategy == \
        "optim_grads_params"


def test_the_one_preflight_answers_as_the_entry_does():
    """validate, the search's output check and launch share ``search.preflight.preflight``: it passes the FSDP plan
    the runtime runs (one stage, tp 1) and refuses, with the entry's own line, one it does not (2 stages)."""
    pytest.importorskip("einops")
    from search.plan import ParallelPlan
    from search.preflight import preflight

    assert preflight(ParallelPlan.model_validate(plan(LLAMA, "optim_grads_params")), "cpu") is True
    with pytest.raises(AcesoError, match="megatron_fsdp with 2 pipeline stages"):
        preflight(ParallelPlan.model_validate(_two_stages(plan(LLAMA, "optim_grads"))), "cpu")
