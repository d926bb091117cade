"""The search's final-step stack choices for ``--target megatron-lm`` beyond the dispatcher: megatron-core's native
cross-entropy fusion (every model) and the ``full_iteration`` CUDA graph (drop-and-pad MoE only; refused on dropless
MoE as megatron-core's capture fails there). Each is priced as itself, exported as the flags Megatron-LM takes, and
the exported line reads back to the plan the search priced (one pricing)."""

import pytest

from search.cli.import_cmd import predict
from search.costmodel.stack_cost import cross_entropy
from search.costmodel.types import Features, Shape
from search.megatron.cmdline import megatron_flags
from search.megatron.expressible import megatron_config
from search.megatron.importer import read_megatron
from search.megatron.script import args_line
from search.megatron.versions import release
from search.planner.dispatchers import Dispatchers, graph_candidates
from search.planner.state import Evaluator, State, to_plan
from search.pricing import make_cost_model
from search.settings.moe_plan import MoEPlanSettings
from search.spec.cluster import parse_cluster
from search.spec.presets import load_model
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


@pytest.mark.parametrize("version", ["0.16", "0.19"])
def test_final_step_takes_the_native_loss_fusion_and_exports_it(version):
    """A dense GPT's plan (gpt-1.3b, 4 layers, tp 2 on 8 H100s) without a loss fusion is also priced under
    megatron-core's native fusion; the unfused loss moves 36 + 12 bytes per logit beyond the dt reads
    (``kernels.ce_bytes``: the fp32 copy, max, subtract, exp, sum, divide; the backward's multiply and cast), the
    native one 20 + 12 (``fused_cross_entropy.py``'s three jit kernels), in the same launches: the iteration falls
    by the micro-batches times 16 bytes per logit at the kernels' bandwidth, and the memory stays. Exported for
    core_v0.16.1 and core_v0.19.0 (both take the flags) and read back, the plan prices the same. The uniform
    baseline's refinement (no ``loss_fusion``) and the aceso target (whose runtime runs no fusion) do not offer
    it."""
    m = load_model("gpt-1.3b", num_layers=4)
    cl = parse_cluster("1x8-h100")
    gbs = 16
    cm = make_cost_model(m, cl, TrainingSpec(global_batch_size=gbs, micro_batch_sizes=[1]))
    st = State(4, (Shape(2, 4, 1, True),), (0, m.num_units), Features(True, True, True))
    e = Evaluator(cm, gbs, None, "megatron-lm").evaluate(st, charge=False, exact=True)
    assert e.fits and e.state.features.stack is None
    best = Dispatchers(cm, gbs, "megatron-lm", loss_fusion=True).best(e)
    assert best.state.features.stack is not None and best.state.features.stack.ce_fusion == "native"
    # by hand: 16 fewer forward bytes per logit, s b V / t logits per micro-batch, M micro-batches on one stage
    k = cm.source.kern
    logits = m.seq_length * 1 * m.padded_vocab_size / 2
    dt = 2.0
    assert cross_entropy("native", dt)[:2] == (20.0, 12.0) and k.ce_bytes == (36.0, 12.0)
    per_mb = k.memory((dt + 36.0) * logits) - k.memory((dt + 20.0) * logits)
    assert per_mb > 0 and e.iteration_ms - best.iteration_ms == pytest.approx((gbs // 4) * per_mb, rel=1e-6)
    assert best.max_memory_mb == pytest.approx(e.max_memory_mb, rel=1e-9)
    plan = to_plan(best, m, cl, gbs, "analytic", predicted=False)
    line, back, ms = _round_trip(plan, version)
    assert "--cross-entropy-loss-fusion --cross-entropy-fusion-impl native" in line
    assert {t for t in line.split() if t.startswith("--")} - megatron_flags() == set()
    assert back.settings.stack.cross_entropy_fusion == "native"
    assert ms == pytest.approx(best.iteration_ms, rel=1e-6)
    assert Dispatchers(cm, gbs, "megatron-lm").best(e) is e          # the baseline's refinement: as the user runs it
    assert Dispatchers(cm, gbs, "aceso", loss_fusion=True).best(e) is e


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
