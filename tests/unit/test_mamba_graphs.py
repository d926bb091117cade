"""The CUDA-graph scope ``mamba`` priced as itself (issue 34 "CUDA graphs by impl and scope", issue 36): megatron-core
0.16.1 / 0.19 graph the whole ``MambaLayer`` (``_layer_is_graphable``, transformer/cuda_graphs.py; the docstring of
search/settings/stack.py has the sources), so a graphed Mamba layer's forward launches are one graph replay, and the
graph pins its static input, output and output-gradient buffers per micro-batch in flight, as the attention's
graph does (search/costmodel/host.py). Hand-computed on small hybrid models; the export, the Bridge YAML and the
search carry the scope."""

import pytest

from search.costmodel.host import GRAPH_BUFFERS, GRAPH_LAUNCH, host_launches, part_launches
from search.costmodel.memory import MB
from tests.unit.test_hybrid_model_spec import _model
from tests.unit.test_stack_features import _launch_by_hand, _table

ME = dict(hidden_size=256, num_attention_heads=4, ffn_hidden_size=512, seq_length=256,
          moe={"num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 64})


def test_a_mamba_graph_replays_the_layers_17_launches_as_one():
    parts = {"mamba": 17, "moe_router": 9, "moe_preprocess": 16, "moe_rest": 21}
    assert host_launches(parts, frozenset()) == 63
    assert host_launches(parts, frozenset({"attn"})) == 63                    # an ME layer has no attention
    assert host_launches(parts, frozenset({"mamba"})) == GRAPH_LAUNCH + 9 + 16 + 21
    assert host_launches(parts, frozenset({"mamba", "moe_router", "moe_preprocess"})) == 3 * GRAPH_LAUNCH + 21
    assert host_launches(parts, frozenset({"attn", "mlp", "moe", "layer"})) == 4 * GRAPH_LAUNCH   # whole layers


@pytest.mark.parametrize("graphs,launches", [(frozenset(), 17 + 9 + 16 + 21),
                                             (frozenset({"mamba"}), 1 + 9 + 16 + 21),
                                             (frozenset({"attn", "moe_router", "moe_preprocess"}), 17 + 1 + 1 + 21),
                                             (frozenset({"attn", "mamba", "moe_router", "moe_preprocess"}),
                                              1 + 1 + 1 + 21)])
def test_the_moe_layer_after_a_graphed_mamba_layer_waits_less_by_hand(graphs, launches):
    """Nemotron-3's ``ME`` layer (tests/unit/test_stack_features.py's hybrid case): the dispatcher's host sync
    exposes the Mamba and MoE units' launches against their device forward, or the experts' 21 against the moe
    unit's; a ``mamba`` graph leaves one launch of the Mamba unit's 17 (the recipes' attn mamba moe_router
    moe_preprocess: 1 + 1 + 1 + 21). The device times do not change."""
    m = _model("ME", **ME)
    launch = _launch_by_hand("h100")                        # _table's cluster: 1x8-h100
    _, t0 = _table(m)
    dev_moe = t0.fwd_ms[1] - t0.host_ms[1]
    _, t = _table(m, graphs=graphs)
    assert t.fwd_ms[0] == pytest.approx(t0.fwd_ms[0], rel=1e-12)
    want = max(launches * launch - (t.fwd_ms[0] + dev_moe), 21 * launch - dev_moe)
    assert want > 0                                         # the case under test: host-bound
    assert t.host_ms[1] == pytest.approx(want, rel=1e-9)
    assert t.fwd_ms[1] == pytest.approx(dev_moe + want, rel=1e-9)


def test_mamba_graph_buffers_by_hand():
    """GRAPH_BUFFERS (3) tensors of dt s b h per graphed unit and micro-batch: 'MEM*E', s 1024, b 1, h 1024,
    bf16, tp 1: each Mamba unit 3 x 2 x 1024 x 1024 B = 6 MiB under ``mamba``, none under attn moe_router
    (their units 6 MiB each); whole layers pin every unit's."""
    m = _model("MEM*E")
    assert [u.kind for u in m.units] == ["mamba", "moe", "mamba", "attention", "moe"]
    per_unit = GRAPH_BUFFERS * 2 * 1024 * 1 * 1024 / MB
    assert per_unit == 6.0
    for graphs, captured in ((frozenset({"mamba"}), [1, 0, 1, 0, 0]),
                             (frozenset({"attn", "moe_router", "moe_preprocess"}), [0, 1, 0, 1, 1]),
                             (frozenset({"attn", "mamba", "moe_router", "moe_preprocess"}), [1, 1, 1, 1, 1])):
        _, t = _table(m, graphs=graphs)
        assert list(t.graph_mb) == pytest.approx([per_unit * c for c in captured]), graphs


def test_a_graphed_mamba_plans_stage_holds_the_buffers_per_micro_batch_in_flight():
    """The stage's ``cuda_graphs`` memory term (search/costmodel/stack_cost.py): 2 Mamba units x 6 MiB x 1 micro-batch
    in flight (one stage), the plan's stack as read from --cuda-graph-modules mamba."""
    from search.costmodel.types import Features
    from search.pricing import make_cost_model
    from search.settings.moe_plan import MoEPlanSettings
    from search.settings.stack import CudaGraphs, StackSettings
    from search.spec.cluster import parse_cluster
    from search.spec.plan import uniform_plan
    from search.spec.training import TrainingSpec
    m = _model("MEM*E")
    cl = parse_cluster("1x4-h100")
    plan = uniform_plan(m, 1, 1, 4, 4, 8, cluster=cl)
    st = StackSettings(cuda_graphs=CudaGraphs(impl="transformer_engine", scope=("mamba",)))
    plan = plan.model_copy(update={"moe": MoEPlanSettings(),
                                   "settings": plan.settings.model_copy(update={"stack": st})})
    cm = make_cost_model(m, cl, TrainingSpec(global_batch_size=8))
    feats = Features.of_plan(plan)
    assert feats.stack.graphs == frozenset({"mamba"})
    sc = cm.stage_cost(0, 1, 0, 0, m.num_units, 1, 4, [0] * m.num_units, 4, features=feats, ep=1, etp=1,
                       moe=plan.moe)
    assert sc.memory_breakdown["cuda_graphs"] == pytest.approx(2 * 6.0)


def test_the_stack_rules_on_every_graph_hold_for_mamba():
    """megatron-core has no rule of its own for ``mamba`` (0.16.1 / 0.19 ``TransformerConfig.__post_init__``); those
    on every graph refuse it: full recompute without ``full_iteration``, CPU offloading. On a model without Mamba
    layers it captures nothing (accepted)."""
    from search.settings.stack import CudaGraphs, StackSettings, refusal
    from search.spec.plan import ActivationOffload, uniform_plan
    from search.spec.cluster import parse_cluster
    m = _model("M*M-")
    cl = parse_cluster("1x4-h100")

    def plan_with(rc="none", offload=None):
        p = uniform_plan(m, 1, 1, 4, 4, 8, cluster=cl)
        st = StackSettings(cuda_graphs=CudaGraphs(impl="transformer_engine", scope=("mamba",)))
        stages = [s.model_copy(update={"chunks": [c.model_copy(update={"recompute": [rc] * len(c.recompute)})
                                                  for c in s.chunks]}) for s in p.stages]
        return p.model_copy(update={"settings": p.settings.model_copy(update={"stack": st}), "stages": stages,
                                    "activation_offload": offload})
    assert refusal(plan_with()) is None
    assert "full recompute" in refusal(plan_with("full"))
    assert "activation_offload" in refusal(plan_with(offload=ActivationOffload(num_layers=1)))


def test_the_search_offers_mamba_graphs_on_hybrid_moe_models():
    """The megatron-lm target's graph candidates (search/planner/dispatchers.py): each MoE scope also with mamba
    where the model has Mamba layers (the Nemotron-3 recipes' attn mamba moe_router moe_preprocess among them);
    none on a model without them."""
    from search.planner.dispatchers import graph_candidates
    from search.spec.presets import load_model
    got = {g.graphs for g in graph_candidates(load_model("nemotron-3-nano"), "megatron-lm")}
    assert frozenset({"attn", "mamba", "moe_router", "moe_preprocess"}) in got
    assert frozenset({"mamba", "moe_router", "moe_preprocess"}) in got
    assert frozenset({"attn", "moe_router", "moe_preprocess"}) in got
    assert not any("mamba" in g for g in
                   {g.graphs for g in graph_candidates(load_model("qwen3-30b-a3b", num_layers=4), "megatron-lm")})
    assert graph_candidates(load_model("nemotron-3-nano"), "aceso") == []


def _graphed_nano(scope):
    from search.settings.stack import CudaGraphs, StackSettings
    from search.spec.presets import load_model
    from tests.hybrid_plans import cut_plan
    plan = cut_plan(load_model("nemotron-3-nano"), [0, 5, 30, 52], 3, tp=2, sp=True, gbs=12)
    st = StackSettings(cuda_graphs=CudaGraphs(impl="transformer_engine", scope=scope))
    return plan.model_copy(update={"settings": plan.settings.model_copy(update={"stack": st})})


@pytest.mark.parametrize("version,flag", [("0.17", "--cuda-graph-scope"), ("0.18", "--cuda-graph-modules"),
                                          ("0.19", "--cuda-graph-modules")])
def test_the_hybrid_script_writes_each_releases_flag_and_reads_back(version, flag):
    """Megatron-LM's parser of each release reads these lines: tests/runtime/test_mamba_graph_oracle.py."""
    from search.megatron.hybrid_pattern import args_line, hybrid_form, write_script
    from search.megatron.importer import read_megatron
    from search.megatron.versions import release
    scope = ("attn", "mamba", "moe_router", "moe_preprocess")
    plan = _graphed_nano(scope)
    form = hybrid_form(plan, release(version))
    assert f" {flag} attn mamba moe_router moe_preprocess " in args_line(form)
    imp = read_megatron(write_script(plan, form, "p.json"), version=version)
    assert imp.plan.settings.stack == plan.settings.stack and imp.ignored == []


@pytest.mark.parametrize("pipes", [False, True])
def test_the_bridge_yaml_states_the_scope_and_reads_back(pipes, tmp_path):
    from search.cli import main
    from search.spec.plan import load_plan
    plan = _graphed_nano(("mamba",))
    path, yaml, back = tmp_path / "p.json", tmp_path / "o.yaml", tmp_path / "b.json"
    path.write_text(plan.to_json())
    assert main(["export", str(path), "--to", "megatron-bridge", "-o", str(yaml)]
                + (["--hybrid-pattern"] if pipes else [])) == 0
    assert "  cuda_graph_scope: [mamba]\n" in yaml.read_text()
    assert main(["import", str(yaml), "--from", "megatron-bridge", "-o", str(back)]) == 0
    assert load_plan(str(back)).settings.stack == plan.settings.stack
