"""The three report lines of one search never get worse down the list (uniform >= Megatron-LM >= heterogeneous),
also under the op-level aceso-compat model, whose per-unit recompute refinement must never replace a Megatron-LM
plan's one setting (the refined plan is no longer expressible and used to be dropped, leaving a slower one)."""

import pytest

from search.spec.cluster import parse_cluster
from search.planner.aceso import SearchOptions
from search.planner.api import plan_all
from search.pricing import cost_model
from search.planner.state import to_plan
from search.planner import megatron_lm
from search.spec.presets import load_model
from search.spec.training import TrainingSpec


@pytest.mark.parametrize("target", ["aceso", "megatron-lm"])
def test_compat_lines_never_get_worse(reference_db, target):
    model = load_model("gpt-1.3b", num_layers=8)
    cl = parse_cluster("1x4-v100", memory_limit_mb=6000)
    tr = TrainingSpec(global_batch_size=64, precision=model.params_dtype, virtual_stages=[1])
    cm = cost_model(model, cl, tr, None, "aceso-compat", str(reference_db / "miniset"))
    plans = plan_all(cm, tr, SearchOptions(budget_evals=300), target=target)
    assert plans.uniform is not None and plans.uniform.fits
    mlm, het = plans.megatron.plans[0], plans.aceso.plans[0]
    assert mlm.fits and het.fits
    assert het.iteration_ms <= mlm.iteration_ms <= plans.uniform.iteration_ms
    assert megatron_lm.problem(to_plan(mlm, model, cl, 64, "aceso-compat")) is None
