"""The runtime's side of the low-precision recipes (``aceso_megatron.model.lowprec``), torch-free.

``config_fields``: for each recipe the ``TransformerConfig`` fields written out by hand from Megatron-LM
core_v0.16.1 (``--fp8-format`` is the dest of ``fp8``, ``--fp8-param-gather`` sets ``fp8_param`` in
``core_transformer_config_from_args``, every other recipe field keeps its dataclass default). ``refusal``: CPU,
CUDA without transformer-engine, an old transformer-engine, a GPU without the recipe's tensor cores, one line each.
"""

from __future__ import annotations

import pytest

from aceso_megatron.model.fast_path import Environment, refusal
from aceso_megatron.model.lowprec import config_fields
from search.spec.plan import ParallelPlan
from search.settings.plan_settings import PlanSettings
from search.settings.precision import LowPrecision
from tests.unit.test_fast_path import GPT, stage

# Megatron-LM's values of the recipe fields the export never writes (transformer_config.py dataclass defaults)
UNWRITTEN = {"fp8_margin": 0, "fp8_interval": 1, "fp8_amax_history_len": 1, "fp8_amax_compute_algo": "most_recent",
             "fp8_wgrad": True, "fp8_dot_product_attention": False, "fp8_multi_head_attention": False}
FP8_OFF = {"fp8": None, "fp8_recipe": "delayed", "fp8_param": False}
FP4_OFF = {"fp4": None, "fp4_recipe": "nvfp4", "fp4_param": False}
NO_BF16 = {"first_last_layers_bf16": False, "num_layers_at_start_in_bf16": 1, "num_layers_at_end_in_bf16": 1}

EXPECTED = {
    "fp8-delayed": {**UNWRITTEN, **FP4_OFF, **NO_BF16, "fp8": "hybrid", "fp8_recipe": "delayed", "fp8_param": False},
    "fp8-tensorwise": {**UNWRITTEN, **FP4_OFF, **NO_BF16, "fp8": "hybrid", "fp8_recipe": "tensorwise",
                       "fp8_param": False},
    "fp8-blockwise": {**UNWRITTEN, **FP4_OFF, **NO_BF16, "fp8": "e4m3", "fp8_recipe": "blockwise", "fp8_param": False},
    "mxfp8": {**UNWRITTEN, **FP4_OFF, **NO_BF16, "fp8": "e4m3", "fp8_recipe": "mxfp8", "fp8_param": False},
    "nvfp4": {**UNWRITTEN, **FP8_OFF, **NO_BF16, "fp4": "e2m1", "fp4_recipe": "nvfp4", "fp4_param": False},
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_recipe_sets_megatron_lms_fields(name):
    assert config_fields(LowPrecision(recipe=name)) == EXPECTED[name]


def test_param_gather_and_bf16_layers():
    got = config_fields(LowPrecision(recipe="mxfp8", param_gather=True, bf16_layers_start=1, bf16_layers_end=2))
    assert got == {**EXPECTED["mxfp8"], "fp8_param": True, "first_last_layers_bf16": True,
                   "num_layers_at_start_in_bf16": 1, "num_layers_at_end_in_bf16": 2}
    got = config_fields(LowPrecision(recipe="nvfp4", param_gather=True, bf16_layers_end=3))
    assert got == {**EXPECTED["nvfp4"], "fp4_param": True, "first_last_layers_bf16": True,
                   "num_layers_at_start_in_bf16": 0, "num_layers_at_end_in_bf16": 3}


def test_no_recipe_is_megatron_cores_defaults():
    assert config_fields(None) == {**UNWRITTEN, **FP8_OFF, **FP4_OFF, **NO_BF16}


def _plan(recipe="fp8-tensorwise", dtype="bf16", **low):
    model = GPT.model_copy(update={"params_dtype": dtype})
    return ParallelPlan.model_validate({
        "model": model.model_dump(), "micro_batch_size": 4, "global_batch_size": 8, "stages": [stage(1, 1, 0, 4)],
        "settings": PlanSettings(framework="megatron-lm",
                                 low_precision=LowPrecision(recipe=recipe, **low)).model_dump()})


H100_TE = Environment(cuda=True, te_version="2.8.0", compute_capability=(9, 0))
B200_TE = Environment(cuda=True, te_version="2.8.0", compute_capability=(10, 0))


@pytest.mark.parametrize("env, plan, needle", [
    (Environment(cuda=False), _plan(), "not on CPU"),
    (Environment(cuda=True, compute_capability=(9, 0)), _plan(), "not importable here"),
    (Environment(cuda=True, te_version="2.1.0", compute_capability=(9, 0)), _plan(), "transformer-engine >= 2.2"),
    (Environment(cuda=True, te_version="2.6.0", compute_capability=(10, 0)), _plan("nvfp4"), ">= 2.7"),
    (Environment(cuda=True, te_version="2.8.0", compute_capability=(8, 0)), _plan(), "compute capability 8.9"),
    (H100_TE, _plan("mxfp8"), "compute capability 10.0 (this GPU: 9.0)"),
    (H100_TE, _plan("nvfp4"), "FP4 tensor cores"),
    (H100_TE, _plan(dtype="fp32"), "params_dtype fp32"),
    (H100_TE, _plan(param_gather=True), "param_gather"),
])
def test_refused_in_one_line(env, plan, needle):
    msg = refusal(env, plan)
    assert msg is not None and needle in msg and "\n" not in msg and msg.startswith("settings.low_precision (")


@pytest.mark.parametrize("env, recipe", [(H100_TE, "fp8-tensorwise"), (H100_TE, "fp8-blockwise"),
                                         (H100_TE, "fp8-delayed"), (B200_TE, "mxfp8"), (B200_TE, "nvfp4")])
def test_runs_where_transformer_engine_and_the_tensor_cores_are(env, recipe):
    assert refusal(env, _plan(recipe)) is None
