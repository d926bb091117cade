"""Which layers of a pipeline stage run in FP8 / FP4 and which stay bf16, decided on CPU without transformer-engine
(the decision, not the kernels).

megatron-core 0.16.1 decides per layer with ``is_first_last_bf16_layer(config, layer_no)`` (``layer_no`` global,
against ``config.num_layers``) inside ``get_fp8_context`` / ``get_fp4_context``. Each stage of a 3-stage plan of an
8-layer model is built as the runtime builds it (``build_stage``) with ``get_fp8_context`` recorded: every unit
asks for its own global layer (build: ``is_init``; forward: each unit), and megatron-core's decision on the
stage's config marks exactly the hand-computed bf16 layers (first 1, last 2: layers 0, 6, 7) of that stage.
Delayed scaling: one context for the chunk (layer -1), none per unit, as ``TransformerBlock``. And the runtime
refuses the plan on CPU before any process group (``check_plan``).
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from search.io.errors import AcesoError
from search.spec.plan import parse_plan, uniform_plan
from search.settings.plan_settings import PlanSettings
from search.settings.precision import LowPrecision, bf16_layer
from tests.tiny_models import LLAMA

MODEL = LLAMA.model_copy(update={"name": "tiny-llama-8", "num_layers": 8})
BF16 = {0, 6, 7}   # first 1 and last 2 of 8 layers, by hand


def _plan(recipe="fp8-tensorwise", start=1, end=2):
    plan = uniform_plan(MODEL, 3, 1, 1, 2, 4)
    return parse_plan({**plan.model_dump(), "settings": PlanSettings(framework="megatron-lm", low_precision=LowPrecision(
        recipe=recipe, bf16_layers_start=start, bf16_layers_end=end)).model_dump()})


@pytest.fixture(scope="module")
def pg():
    from megatron.core import tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    from aceso_megatron.testing import free_port
    from aceso_megatron.testing.reference import init_single_process

    init_single_process(free_port())
    tensor_parallel.get_cuda_rng_tracker().reset()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    return ProcessGroupCollection.use_mpu_process_groups()


@pytest.fixture
def calls(monkeypatch):
    import megatron.core.fp8_utils as fp8_utils

    seen = []

    def record(config, layer_no=-1, is_init=False):
        seen.append((layer_no, is_init))
        return nullcontext()

    monkeypatch.setattr(fp8_utils, "get_fp8_context", record)
    return seen


def _run(plan, s, pg):
    from aceso_megatron.model.stage_model import build_stage

    chunk = build_stage(plan, s, pg, "cpu")
    m = plan.model
    chunk.set_input_tensor(torch.randn(m.seq_length, 2, m.hidden_size))
    tokens = torch.randint(0, m.vocab_size, (2, m.seq_length))
    chunk(input_ids=tokens, position_ids=torch.arange(m.seq_length).expand(2, -1), labels=tokens)
    return chunk


def test_each_stage_asks_for_its_global_layers_and_megatron_marks_the_bf16_ones(pg, calls):
    from aceso_megatron.model.lowprec import bf16_layers

    plan = _plan()
    seen_layers = []
    for s in range(plan.num_stages):
        calls.clear()
        chunk = _run(plan, s, pg)
        units = [u.unit.layer for u in chunk.units]
        assert calls == [(n, True) for n in units] + [(n, False) for n in units], s   # build, then forward
        layers = sorted(set(units))
        seen_layers += layers
        assert chunk.config.num_layers == 8
        assert bf16_layers(chunk.config, layers) == sorted(BF16 & set(layers)), s
        assert [n for n in layers if bf16_layer("fp8-tensorwise", n, 8, 1, 2)] == sorted(BF16 & set(layers))
    assert seen_layers == list(range(8))


def test_delayed_scaling_enters_one_context_per_chunk(pg, calls):
    plan = _plan("fp8-delayed", 0, 0)
    chunk = _run(plan, 1, pg)
    units = [u.unit.layer for u in chunk.units]
    assert calls == [(n, True) for n in units] + [(-1, False)]


def test_a_per_stage_config_would_misplace_them():
    """The control: a stage config with the stage's own layer count (what pipeline_model_parallel_size 1 and a
    local num_layers would give) marks the stage's own last layers bf16, not the model's."""
    from aceso_megatron.model.config import stage_config
    from aceso_megatron.model.lowprec import bf16_layers

    low = _plan().settings.low_precision
    wrong = stage_config(MODEL, 1, "cpu", num_layers=3, low=low)
    assert bf16_layers(wrong, [3, 4, 5]) != sorted(BF16 & {3, 4, 5})


def test_cpu_refuses_before_any_process_group():
    from aceso_megatron.model.fast_path import Environment
    from aceso_megatron.training.engine import check_plan

    with pytest.raises(AcesoError, match=r"settings.low_precision \(fp8-tensorwise\): .* not on CPU"):
        check_plan(_plan(), 3, Environment.detect("cpu"))
