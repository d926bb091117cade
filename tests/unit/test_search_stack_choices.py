"""The search's final-step CUDA-graph choice ``full_iteration`` for ``--target megatron-lm`` (drop-and-pad MoE only;
refused on dropless MoE, where megatron-core's capture fails): priced as itself, exported as the flags Megatron-LM
takes, and the exported line reads back to the plan the search priced (one pricing)."""

import pytest

from search.cli.import_cmd import predict
from search.costmodel.types import Features, Shape
from search.megatron.expressible import megatron_config
from search.megatron.importer import read_megatron
from search.megatron.script import args_line
from search.megatron.versions import release
from search.planner.dispatchers import Dispatchers, graph_candidates
from search.planner.state import Evaluator, State, to_plan
from search.pricing import make_cost_model
from search.settings.moe_plan import MoEPlanSettings
from search.spec.cluster import parse_cluster
from search.spec.training import TrainingSpec
from tests.unit.test_moe_cost import tiny_moe
from tests.unit.test_stack_features import _graphed

PADDED = {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}


def _round_trip(plan, version: str):
    """The plan exported for Megatron-LM ``version``, read back and priced as the import prices it: (the line, the
    plan read back, its iteration ms)."""
    line = args_line(megatron_config(plan), release(version))
    imp = read_megatron(line, world_size=plan.world_size, cluster=plan.cluster, version=version)
    return line, imp.plan, predict(imp.plan, imp.config.attention).iteration_time_ms


def test_full_iteration_graphs_on_dropless_moe_are_refused():
    """megatron-core (0.16.1 and 0.19) accepts ``--cuda-graph-impl local --cuda-graph-scope full_iteration`` on a
    dropless MoE model, but its capture fails as whole-layer graphs do: the alltoall dispatcher copies the token
    counts to the host and waits on them (``_maybe_dtoh_and_synchronize``: ``d2h_event.synchronize()``, skipped only
    with ``drop_and_pad``) and the grouped experts call ``tokens_per_expert.tolist()``. Drop-and-pad counts are a
    CPU ``torch.full``, and 0.19's per-rank capacity bounds HybridEP's buffers: both captured. Before, the plan's
    rules let full_iteration through on dropless MoE."""
    why = _graphed(("full_iteration",), impl="local")
    assert why is not None and "stack.cuda_graphs.scope full_iteration (the whole iteration) on dropless MoE" in why
    assert _graphed(("full_iteration",), PADDED, impl="local") is None
    bounded = MoEPlanSettings(token_dispatcher="flex", flex_backend="hybridep", rank_capacity_factor=1.5)
    assert _graphed(("full_iteration",), moe=bounded, impl="local") is None
    # the search offers it only where megatron-core captures it
    assert all("full_iteration" not in g.graphs for g in graph_candidates(tiny_moe(), "megatron-lm"))
    assert any("full_iteration" in g.graphs for g in graph_candidates(tiny_moe(**PADDED), "megatron-lm"))


def test_final_step_takes_full_iteration_graphs_on_host_bound_padded_moe():
    """A drop-and-pad tiny MoE at mbs 1 on 8 H100s (ep 8): its layers' launches outlast their kernels, so the
    final step's best variant is the full_iteration graph (no host time per layer, ``host.py``), which also allows
    full recompute; the export writes ``--cuda-graph-impl local --cuda-graph-scope full_iteration`` with the
    ``--no-check-for-nan-in-loss-and-grad`` Megatron-LM's validate_args asserts under it, and the line reads back to
    the plan the search priced."""
    m = tiny_moe(**PADDED)
    cl = parse_cluster("1x8-h100")
    gbs = 16
    cm = make_cost_model(m, cl, TrainingSpec(global_batch_size=gbs, micro_batch_sizes=[1]))
    st = State(8, (Shape(1, 8, 1, False, 8, 1),), (0, m.num_units), Features(True, True, True))
    e = Evaluator(cm, gbs, None, "megatron-lm").evaluate(st, charge=False, exact=True)
    assert e.fits
    best = Dispatchers(cm, gbs, "megatron-lm").best(e)
    stack = best.state.features.stack
    assert stack is not None and stack.graphs == frozenset({"full_iteration"}) and stack.graph_impl == "local"
    assert best.iteration_ms < e.iteration_ms
    plan = to_plan(best, m, cl, gbs, "analytic", predicted=False)
    for version in ("0.16", "0.19"):
        line, back, ms = _round_trip(plan, version)
        assert "--no-check-for-nan-in-loss-and-grad" in line.split()
        assert back.settings.stack.cuda_graphs.scope == ("full_iteration",)
        assert ms == pytest.approx(best.iteration_ms, rel=1e-6)


def test_rank_orders_tied_graph_plans_alike_in_either_input_order():
    """``Evaluation.rank`` is a total order: two plans of the same time whose CUDA-graph scopes hold neither the
    other ({attn} and {moe_router}: frozensets compare by inclusion, so neither was below the other and the sort
    kept the input order) rank the same whichever comes first, by their scope names; one whose scopes hold
    another's ranks after it, as inclusion orders them; a plan without graphs but with a stack of its own (the
    offload alone) ranks among them without a type error."""
    from search.costmodel.types import StackKey
    from search.planner.state import Evaluation
    state = State(1, (Shape(1, 8, 1, False, 1, 0),), (0, 8))

    def plan(graphs, offload=()):
        sk = StackKey(graphs=frozenset(graphs), graph_impl="transformer_engine" if graphs else "",
                      offload_modules=offload, offload_fraction=1.0 if offload else 0.0)
        return Evaluation(state._replace(features=Features(stack=sk)), 100.0, True, [], [100.0], 1000.0)
    a, b, c, d = plan({"moe_router"}), plan({"attn"}), plan((), ("core_attn",)), plan({"attn", "moe_preprocess"})
    for order in ([a, b, c, d], [d, c, b, a], [b, d, c, a], [a, c, d, b]):
        ranked = sorted(order, key=lambda e: e.rank)
        assert [e.state.features.stack for e in ranked] == [x.state.features.stack for x in (c, b, a, d)]
