"""Each Megatron-LM release's own ``core_transformer_config_from_args`` on the command line of each low-precision plan
exported for it sets exactly the recipe fields the runtime builds its stage configs with
(``aceso_megatron.model.lowprec.config_fields``). Skipped without ``ACESO_MEGATRON_LM`` (test_megatron_lm_oracle.py).
"""

import pytest

from search.spec.plan import uniform_plan
from search.settings.plan_settings import PlanSettings
from search.settings.precision import LowPrecision
from search.spec.presets import load_model
from tests.runtime.test_megatron_lm_oracle import TAGS, _oracle

LOWS = [LowPrecision(recipe="fp8-delayed"), LowPrecision(recipe="fp8-tensorwise", bf16_layers_start=1,
                                                         bf16_layers_end=1),
        LowPrecision(recipe="fp8-blockwise", param_gather=True), LowPrecision(recipe="mxfp8", bf16_layers_end=2),
        LowPrecision(recipe="nvfp4", bf16_layers_start=1, bf16_layers_end=1)]


@pytest.mark.parametrize("tag", TAGS)
def test_megatron_lm_sets_the_runtimes_recipe_fields(tag):
    from aceso_megatron.model.lowprec import config_fields

    model = load_model("llama3-8b", num_layers=4)
    plans = [uniform_plan(model, 1, 2, 4, 4, 16, "none", distributed_optimizer=True).model_copy(update={
        "settings": PlanSettings(framework="megatron-lm", low_precision=low, distributed_optimizer=True)})
        for low in LOWS]
    for low, got in zip(LOWS, _oracle(plans, tag)):
        assert "error" not in got, (low, got)
        assert got["recipe"] == config_fields(low), low


def test_a_param_gather_plan_without_the_distributed_optimizer_is_not_exported():
    """Megatron-LM asserts --fp8-param-gather with the distributed optimizer or FSDP (every release): a plan file with
    it and neither is not expressible (before, its exported line failed validate_args, as this file's recipe test
    showed)."""
    from search.io.errors import AcesoError
    from search.megatron import megatron_config
    model = load_model("llama3-8b", num_layers=4)
    plan = uniform_plan(model, 1, 2, 4, 4, 16, "none").model_copy(update={"settings": PlanSettings(
        framework="megatron-lm", low_precision=LowPrecision(recipe="fp8-blockwise", param_gather=True))})
    with pytest.raises(AcesoError, match="param_gather needs settings.distributed_optimizer"):
        megatron_config(plan)
