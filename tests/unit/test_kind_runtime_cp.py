"""That the aceso runtime does not run a layer kind's units under context parallelism is one field of the kind's
record (``LayerKind.no_runtime_cp``): the aceso search space keeps cp 1 for a model holding such a kind and the
runtime's pre-flight refuses cp > 1 in one line naming it, while Megatron-LM's space keeps every cp asked for.
Before, the search space tested ``model.mamba`` itself and the runtime had one rule per kind (``mamba_cp``,
``gdn_cp``), so a GDN model was searched with cp > 1 under --target aceso and its plans were refused at launch."""

from __future__ import annotations

from dataclasses import replace

import pytest

from search import layers
from search.layers.kind import without_runtime_cp
from search.io.errors import AcesoError
from search.planner.space import Space
from search.spec.cluster import parse_cluster
from search.spec.model import ModelSpec
from search.spec.training import TrainingSpec
from search.targets.capabilities import plan_refusal
from search.targets.preflight import planner_checks
from tests.hybrid_plans import GDN8, MAMBA8, cut_plan
from tests.unit.test_layer_kinds import PROJ

CPS = [1, 2, 4]
CLUSTER = parse_cluster("2x8-h100")
CP_PRICED = frozenset({"context_parallel"})


def _cps(model, target: str) -> tuple[int, ...]:
    tr = TrainingSpec(global_batch_size=16, context_parallel_sizes=CPS)
    return Space.of(model, CLUSTER, tr, priced=CP_PRICED, target=target).cps


def _proj_model() -> ModelSpec:
    return ModelSpec(name="p", family="gpt", num_layers=2, hidden_size=1024, num_attention_heads=16,
                     ffn_hidden_size=4096, seq_length=512, vocab_size=1024, params_dtype="bf16",
                     add_bias_linear=False, normalization="rmsnorm")


@pytest.fixture
def kind_without_cp():
    """``PROJ`` (an h x h projection in every second layer's MLP place) with ``no_runtime_cp`` set, registered."""
    kind = replace(PROJ, no_runtime_cp="projection layers")
    layers.register(kind)
    yield kind
    layers.unregister(kind)


def test_a_kind_without_runtime_cp_gets_cp_1_in_the_aceso_space_and_every_cp_under_megatron_lm(kind_without_cp):
    m = _proj_model()
    assert [u.kind for u in m.units] == ["attention", "mlp", "attention", "proj"]
    assert without_runtime_cp(m) == (kind_without_cp,)
    assert _cps(m, "aceso") == (1,)
    assert _cps(m, "megatron-lm") == tuple(CPS)


def test_the_same_kind_with_runtime_cp_keeps_every_cp_in_the_aceso_space():
    layers.register(PROJ)
    try:
        m = _proj_model()
        assert without_runtime_cp(m) == ()
        assert _cps(m, "aceso") == tuple(CPS)
    finally:
        layers.unregister(PROJ)


def test_the_runtime_refuses_the_kinds_units_under_cp_in_one_line_naming_them(kind_without_cp):
    m = _proj_model()
    plan = cut_plan(m, [0, 2, 4], 2)
    assert plan_refusal(plan, "aceso", "cuda") is None
    stages = [st.model_copy(update={"cp": 2, "num_gpus": 2}) for st in plan.stages]
    plan = plan.model_copy(update={"stages": stages})
    with pytest.raises(AcesoError) as e:
        planner_checks(plan, "cuda", "runtime")
    assert str(e.value) == ("stages[0].cp (2): the aceso runtime does not run projection layers under context "
                            "parallelism yet; use cp 1, or search with --target megatron-lm and export the plan")
    planner_checks(plan, "cuda", "megatron-lm")        # Megatron-LM runs it


@pytest.mark.parametrize("model, name", [(MAMBA8, "Mamba-2 layers"), (GDN8, "Gated DeltaNet layers")],
                         ids=["mamba", "gdn"])
def test_mamba_and_gdn_say_so_in_their_records_and_the_aceso_space_keeps_cp_1(model, name):
    """Both built-in kinds the runtime does not run under CP: cp 1 in the aceso space (GDN's was searched with
    cp 2 and 4 before), every cp their heads allow under Megatron-LM."""
    assert [k.no_runtime_cp for k in without_runtime_cp(model)] == [name]
    assert _cps(model, "aceso") == (1,)
    assert _cps(model, "megatron-lm") == tuple(CPS)
