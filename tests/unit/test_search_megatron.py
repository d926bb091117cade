"""``--target megatron-lm``: Megatron-LM's recompute settings as unit choices, the expressibility check, the
restricted search against exhaustive enumeration, and the three report lines (uniform >= Megatron-LM >= aceso)."""

import numpy as np
import pytest

from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.spec.plan import ChunkSpec, StageSpec, uniform_plan
from search.planner import megatron_lm
from search.planner.aceso import SearchOptions, search
from search.planner.api import make_space, plan_all
from search.planner.exhaustive import exhaustive_best
from search.planner.state import to_plan
from search.spec.presets import load_model
from search.spec.training import TrainingSpec
from tests.unit.search_helpers import memory_between as _limit


def test_setting_codes_by_hand():
    # the export's recompute settings as the unit codes the planner prices (search.megatron.recompute)
    codes = megatron_lm.codes
    gpt = load_model("gpt-1.3b", num_layers=4)
    spans = ((0, 6), (6, 8))                  # a chunk of 3 layers, a chunk of 1
    assert codes(megatron_lm.block(2), gpt, spans).tolist() == [2, 2, 2, 2, 0, 0] + [2, 2]
    assert codes(megatron_lm.SELECTIVE_SETTING, gpt, spans).tolist() == [1, 0] * 4
    assert codes(megatron_lm.FULL_SETTING, gpt, spans).tolist() == [2] * 8
    t5 = load_model("t5-770m", num_layers=2)
    dec = (t5.layer_starts[-3], t5.layer_starts[-1])   # the last two decoder layers: 3 units each
    assert codes(megatron_lm.block(1), t5, (dec,)).tolist() == [2, 2, 2, 0, 0, 0]
    assert codes(megatron_lm.SELECTIVE_SETTING, t5, (dec,)).tolist() == [1, 1, 0, 1, 1, 0]
    # one T5 chunk holds an encoder and a decoder block: block 1 recomputes the first layer of each
    whole = codes(megatron_lm.block(1), t5, ((0, t5.num_units),)).tolist()
    enc = 2 * t5.num_layers
    assert whole[:enc] == [2, 2] + [0] * (enc - 2) and whole[enc:enc + 3] == [2, 2, 2] and set(whole[enc + 3:]) == {0}


def _plan(model, cluster, **kw):
    return uniform_plan(model, 2, 2, 2, 8, 64, "none", cluster, sequence_parallel=True, **kw)


def test_problem_names_the_stage_and_field():
    model = load_model("gpt-1.3b", num_layers=4)
    cl = parse_cluster("1x8-h100")
    plan = _plan(model, cl)
    assert megatron_lm.problem(plan) is None
    stages = list(plan.stages)
    stages[1] = stages[1].model_copy(update={"tp": 4, "dp": 1})
    assert "stages[1].tp (4) differs" in megatron_lm.problem(plan.model_copy(update={"stages": stages}))
    # (each case below is refused by the export's check, search.megatron.check_expressible)
    cut = [StageSpec(num_gpus=4, tp=2, dp=2, sequence_parallel=True, start_unit=0, end_unit=3,
                     recompute=["none"] * 3),
           StageSpec(num_gpus=4, tp=2, dp=2, sequence_parallel=True, start_unit=3, end_unit=8,
                     recompute=["none"] * 5)]
    assert "stages[1].start_unit (3) cuts layer 1" in megatron_lm.problem(plan.model_copy(update={"stages": cut}))
    odd = [s.model_copy(update={"chunks": [ChunkSpec(start_unit=c.start_unit, end_unit=c.end_unit,
                                                     recompute=["none", "full"] + ["none"] * (c.num_units - 2))
                                           for c in s.chunks]}) for s in plan.stages]
    assert "mixes choices inside layer" in megatron_lm.problem(plan.model_copy(update={"stages": odd}))
    vpp = _plan(model, cl, num_virtual_stages=2)
    assert megatron_lm.problem(vpp) is None and megatron_lm.setting_of(vpp).label == "none"


@pytest.mark.parametrize("layers,cluster,f", [(4, "2x1-h100", 0.3), (4, "4x1-h100", 0.6), (4, "4x1-h100", 0.15),
                                              (6, "4x1-h100", 0.3), (2, "1x4-h100", None)])
def test_megatron_search_equals_exhaustive(layers, cluster, f):
    # GPT-13B layers on one-GPU nodes (no TP): memory forces pipelining, uneven layers and block recompute
    model = load_model("gpt-13b", num_layers=layers)
    cl = parse_cluster(cluster, memory_limit_mb=None if f is None else _limit(model, cluster, 64, f))
    training = TrainingSpec(global_batch_size=64, micro_batch_sizes=[1, 2])
    cm = make_cost_model(model, cl, training)
    space = make_space(cm, training, "megatron-lm")
    want, _, n = exhaustive_best(cm, 64, space)
    res = search(cm, 64, space, SearchOptions(budget_evals=600))
    best = res.plans[0]
    assert np.isfinite(want) and n > 10
    assert best.iteration_ms == pytest.approx(want, rel=1e-12)
    if f is not None:
        assert best.state.num_stages > 1 or best.setting.granularity is not None
    plan = to_plan(best, model, cl, 64, "analytic")
    assert megatron_lm.problem(plan) is None


CASES = [  # model, layers, cluster, limit (see _limit: None = the GPU's memory), global batch, training settings
    ("gpt-1.3b", 8, "1x8-h100", None, 256, {}),
    ("gpt-13b", 6, "4x1-h100", 0.3, 64, {"micro_batch_sizes": [1, 2]}),
    ("gpt-13b", 8, "2x2-h100", 0.5, 64, {"virtual_stages": [2], "micro_batch_sizes": [1, 2]}),
    ("llama3-8b", 8, "1x8-h100", None, 64, {"context_parallel_sizes": [1, 2]}),
]


@pytest.mark.parametrize("name,layers,cluster,f,gbs,extra", CASES)
def test_every_megatron_plan_passes_the_check_and_the_lines_never_get_worse(name, layers, cluster, f, gbs, extra):
    model = load_model(name, num_layers=layers)
    cl = parse_cluster(cluster, memory_limit_mb=None if f is None else _limit(model, cluster, gbs, f))
    training = TrainingSpec(global_batch_size=gbs, **extra)
    cm = make_cost_model(model, cl, training)
    plans = plan_all(cm, training, SearchOptions(budget_evals=400), top_k=3, target="megatron-lm")
    fitting = [e for e in plans.megatron.plans if e.fits]
    assert fitting and plans.megatron.plans[0].fits
    for e in fitting:
        plan = to_plan(e, model, cl, gbs, "analytic")
        assert megatron_lm.problem(plan) is None
        assert cm.evaluate(plan).iteration_ms == pytest.approx(e.iteration_ms, rel=1e-9)
    uniform = plans.uniform.iteration_ms
    mlm, het = plans.megatron.plans[0].iteration_ms, plans.aceso.plans[0].iteration_ms
    assert het <= mlm <= uniform
    if "virtual_stages" in extra:
        assert plans.megatron.plans[0].state.num_chunks == 2


def _hybrid(pattern):
    from search.layers.mamba import Mamba2Spec
    from search.spec.model import ModelSpec
    return ModelSpec(name="h", family="gpt", num_layers=len(pattern), hidden_size=1024, num_attention_heads=16,
                     ffn_hidden_size=4096, seq_length=1024, vocab_size=32000, params_dtype="bf16",
                     add_bias_linear=False, normalization="rmsnorm", position_embedding="rope",
                     hybrid_layer_pattern=pattern,
                     mamba=Mamba2Spec(mamba_state_dim=64, mamba_head_dim=64, mamba_num_groups=8),
                     moe={"num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 512} if "E" in pattern
                     else None)


@pytest.mark.parametrize("pattern,cluster,f,extra", [
    ("M*M-M*M-", "4x1-h100", 0.3, {}),                         # memory forces pipelining and recompute
    ("M*M-M*M-", "1x4-h100", None, {"virtual_stages": [1, 2]}),
    ("ME*EME*E", "1x4-h100", 0.5, {"expert_parallel_sizes": [2]}),   # one ep: exhaustive_best's expert shape
])
def test_megatron_lm_bound_equals_every_cut(pattern, cluster, f, extra):
    """The bench-scale bound (balanced cuts + the search's exact cut refinements, every other dimension enumerated)
    equals the enumeration of every cut of every state on small hybrid models (Mamba-2, attention, MLP / MoE)."""
    from search.planner.exhaustive import megatron_lm_bound
    model = _hybrid(pattern)
    cl = parse_cluster(cluster, memory_limit_mb=None if f is None else _limit(model, cluster, 32, f))
    training = TrainingSpec(global_batch_size=32, micro_batch_sizes=[1, 2], **extra)
    cm = make_cost_model(model, cl, training)
    space = make_space(cm, training, "megatron-lm")
    want, _, n = exhaustive_best(cm, 32, space)
    got, m = megatron_lm_bound(cm, 32, [space])
    assert np.isfinite(want) and n > m > 10
    assert got.iteration_ms == pytest.approx(want, rel=1e-12)
    assert megatron_lm.problem(to_plan(got, model, cl, 32, "analytic")) is None
