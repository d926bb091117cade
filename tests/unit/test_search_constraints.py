"""Every VPP degree Megatron-LM accepts is in the default space, and the candidate constraints (--tp, --pp, --vpp,
--max-tp, --seq-length) are honoured by all three report lines (uniform, Megatron-LM, heterogeneous)."""

from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.spec.model import ModelSpec
from search.planner.aceso import SearchOptions
from search.planner.api import make_space, plan_all
from search.planner.baseline import uniform_states
from search.planner.primitives import vpp_steps
from search.planner.space import virtual_degrees
from search.spec.presets import load_model
from search.spec.training import TrainingSpec

# Nemotron-4 340B's shape at 96 layers (the published plan: pp 8, 12 virtual stages of one layer)
DEEP = {"name": "deep-96", "family": "gpt", "num_layers": 96, "hidden_size": 1024, "num_attention_heads": 8,
        "ffn_hidden_size": 4096, "seq_length": 1024, "vocab_size": 32000, "params_dtype": "bf16"}


def test_default_degrees_are_every_degree_megatron_accepts():
    model = ModelSpec.model_validate(DEEP)
    assert virtual_degrees(model, "megatron-lm") == tuple(range(1, 49))   # up to one layer per chunk on pp 2
    cl = parse_cluster("8x8-h100")
    tr = TrainingSpec(global_batch_size=64, virtual_stages=None)
    space = make_space(make_cost_model(model, cl, tr), tr, "megatron-lm")
    got = {st.num_chunks for st, _ in uniform_states(space, model) if st.num_stages == 8}
    # --num-layers-per-virtual-pipeline-stage n: n divides 96 / 8 = 12 layers per rank, v = 12 / n
    assert got == {1, 2, 3, 4, 6, 12}
    assert 12 in vpp_steps(space, 8, 1, +1) and 12 in vpp_steps(space, 8, 4, +1)
    assert 1 in vpp_steps(space, 8, 12, -1)


def _lines(plans):
    return [plans.uniform.evaluation, plans.megatron.plans[0], plans.aceso.plans[0]]


def test_constraints_hold_on_every_line():
    model = load_model("gpt-1.3b", num_layers=8)
    cl = parse_cluster("1x8-h100")
    tr = TrainingSpec(global_batch_size=64, tensor_parallel_sizes=[2], pipeline_parallel_sizes=[2, 4],
                      virtual_stages=[1, 2])
    plans = plan_all(make_cost_model(model, cl, tr), tr, SearchOptions(budget_evals=200))
    for e in _lines(plans):
        assert e.fits and e.state.num_stages in (2, 4) and {s.tp for s in e.state.shapes} == {2}
        assert e.state.num_chunks in (1, 2)


def test_cli_seq_length_and_max_tp(tmp_path):
    import json

    from search.cli import main
    from search.spec.plan import load_plan
    out = tmp_path / "p.json"
    assert main(["search", "--model", "gpt-1.3b", "--num-layers", "4", "--cluster", "1x8-h100",
                 "--global-batch-size", "32", "--budget-evals", "100", "--workers", "1", "--seq-length", "1024",
                 "--max-tp", "2", "--pp", "2", "--json", "-o", str(out)]) == 0
    plan = load_plan(out)
    assert plan.model.seq_length == 1024 and plan.num_stages == 2 and all(s.tp <= 2 for s in plan.stages)
    assert json.loads(out.read_text())["model"]["seq_length"] == 1024
