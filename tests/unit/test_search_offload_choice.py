"""Fine-grained activation offload as a search choice for ``--target megatron-lm`` (``search/planner/fine_offload.py``):
where memory binds, the search returns a plan that offloads, fits and is faster than its best plan without the
offload (prices checked by hand from ``costmodel/offload.py`` / ``stack_cost.py``'s formulas); where megatron-core's
rules forbid it (a release without it, CPU offloading, full recompute, CUDA graphs before 0.18, the runtime target),
the search does not offer it; the plan's Megatron-LM line carries the flags and reads back to the priced plan."""

from unittest import mock

import pytest

from search.costmodel.offload import host_link_gbps
from search.costmodel.types import Features, Shape, StackKey
from search.megatron.config import NO_RECOMPUTE
from search.planner import fine_offload
from search.planner.aceso import SearchOptions
from search.planner.megatron_lm import FULL_SETTING, MOE_ACT_SETTING, SELECTIVE_SETTING
from search.planner.settle import settle
from search.planner.state import Evaluator, to_plan
from search.pricing import cost_model
from search.settings.plan_settings import PlanSettings
from search.spec.cluster import parse_cluster
from search.spec.model import ModelSpec
from search.spec.training import TrainingSpec
from tests.unit.test_moe_cost import tiny_moe
from tests.unit.test_search_stack_choices import _round_trip

# 4 layers of 4096 hidden, 32 heads (MHA), seq 8192, on 8 H100s: at one sequence per rank and tp 1, each
# attention layer saves Q, K and V, dt s b (q + 2 kv) / t = 2 x 8192 x 12288 B = 192 MiB, for its backward
MODEL = ModelSpec(name="tiny-gpt", family="llama", num_layers=4, hidden_size=4096, num_attention_heads=32,
                  ffn_hidden_size=11008, seq_length=8192, vocab_size=32000, activation="swiglu",
                  normalization="rmsnorm", position_embedding="rope", add_bias_linear=False, tied_embeddings=False,
                  params_dtype="bf16")
QKV_MB = 2 * 8192 * (4096 + 2 * 4096) / 2**20      # 192 MiB per layer
GBS = 64
LIMIT_MB = 12200        # the tp-1 plan without recompute needs 12651 MiB: memory binds
TRAINING = TrainingSpec(global_batch_size=GBS, micro_batch_sizes=[1], activation_offload=False, megatron_fsdp=False)


def _search(release: str | None = None, offload: bool = True, limit: float = LIMIT_MB):
    """The Megatron-LM search (``settle``, as ``aceso search`` runs it) on 8 H100s of ``limit`` MiB; ``offload``
    False: with no offload candidate (the search before it was one)."""
    cl = parse_cluster("1x8-h100")
    cm = cost_model(MODEL, cl, TRAINING, PlanSettings(release=release) if release else None)
    cm.memory_limit_mb = limit
    with mock.patch.object(fine_offload, "candidates", fine_offload.candidates if offload else lambda *a, **k: []):
        res, log = settle(cm, TRAINING, "megatron-lm", SearchOptions(budget_evals=200), 1)
    return cm, res.plans[0], log


def test_the_search_offloads_where_memory_binds():
    """Without the offload the search's best plan recomputes (a full-recompute block); with it, the same tp-1 shape
    runs without recompute, offloading ``core_attn`` (Q, K, V): it fits and is faster. By hand: the offload takes
    (L - 1) x 192 MiB off the GPU (one micro-batch in flight at pp 1, the last layer's copy still in flight), and its
    copies add at most 2 L x 192 MiB / (64 GB/s PCIe Gen5 x 0.8) per micro-batch to the time without recompute."""
    cm0, base, _ = _search(offload=False)
    cm, best, log = _search()
    assert base.fits and base.setting.granularity == "full" and base.state.features.stack is None
    sk = best.state.features.stack
    assert best.fits and best.setting == NO_RECOMPUTE and sk.offload_modules == ("core_attn",)
    assert sk.offload_fraction == 1.0 and best.state.shapes == base.state.shapes == (Shape(1, 8, 1, False, 1, 0),)
    assert best.iteration_ms < base.iteration_ms
    assert any("again with offload" in line for line in log)
    cost = best.stages[0].cost
    assert cost.memory_breakdown["fine_grained_offload"] == pytest.approx(-(4 - 1) * QKV_MB)
    # the same state without the offload and without recompute: over the limit by what the offload takes off
    plain = best.state._replace(features=best.state.features._replace(stack=None))
    e = Evaluator(cm, GBS, None, "megatron-lm").evaluate(plain, charge=False, exact=True)
    free = cost_model(MODEL, parse_cluster("1x8-h100"), TRAINING)       # 80 GiB: nothing binds
    none = Evaluator(free, GBS, None, "megatron-lm").evaluate(plain, charge=False, exact=True)
    assert none.setting == NO_RECOMPUTE and e.setting.granularity == "full"    # under the limit: recompute
    assert best.max_memory_mb == pytest.approx(none.max_memory_mb - (4 - 1) * QKV_MB)
    assert none.max_memory_mb > LIMIT_MB >= best.max_memory_mb
    M = GBS // best.state.mbs
    copy_ms = QKV_MB * 2**20 / (host_link_gbps("h100") * 1e6)
    assert host_link_gbps("h100") == pytest.approx(64 * 0.8)
    assert none.iteration_ms <= best.iteration_ms <= none.iteration_ms + M * 2 * 4 * copy_ms + 1e-6
    assert cost.terms["offload_copies"] == pytest.approx(best.iteration_ms - none.iteration_ms, abs=1e-6)


def test_a_release_without_the_offload_is_not_offered_it():
    """megatron-core 0.15 (container 25.11) has no fine-grained offload (0.16.0 brought it): the same memory-bound
    search keeps recomputing; 0.16 (26.02) offers it."""
    cm, best, log = _search("25.11")
    assert fine_offload.candidates(cm, "megatron-lm") == []
    assert best.fits and best.setting.granularity == "full" and best.state.features.stack is None
    assert not any("offload" in line for line in log)
    cm, best, _ = _search("26.02")
    assert best.state.features.stack.offload_modules == ("core_attn",)


def test_the_offered_choices_keep_megatron_cores_rules():
    cl = parse_cluster("1x8-h100")
    cm = cost_model(MODEL, cl, TRAINING)
    # the aceso runtime keeps activations on the GPU: never offered there
    assert fine_offload.candidates(cm, "aceso") == []
    # 0.17: the attention core's inputs, fraction 1 (--activation-offload-fraction is 0.19's)
    assert fine_offload.candidates(cm, "megatron-lm") == [(("core_attn",), 1.0), (("core_attn", "attn_proj"), 1.0)]
    cm19 = cost_model(MODEL, cl, TRAINING, PlanSettings(release="0.19"))
    assert {f for _, f in fine_offload.candidates(cm19, "megatron-lm")} == {0.5, 1.0}
    # MoE: the experts' inputs too, but not with paged stashing (megatron-core refuses both)
    moe = tiny_moe()
    sets = fine_offload.module_sets(moe)
    assert ("expert_fc1", "moe_act") in sets and ("core_attn", "attn_proj", "expert_fc1", "moe_act") in sets
    from search.settings.moe_plan import MoEPlanSettings
    assert fine_offload.module_sets(moe, MoEPlanSettings(paged_stash=True)) == [("core_attn",),
                                                                               ("core_attn", "attn_proj")]
    # recompute: none under full recompute, not core_attn both recomputed and offloaded; moe_act both is allowed
    core, exp = StackKey(offload_modules=("core_attn",), offload_fraction=1.0), \
        StackKey(offload_modules=("moe_act",), offload_fraction=1.0)
    assert not fine_offload.recompute_ok(FULL_SETTING, exp)
    assert not fine_offload.recompute_ok(SELECTIVE_SETTING, core)
    assert fine_offload.recompute_ok(MOE_ACT_SETTING, exp) and fine_offload.recompute_ok(NO_RECOMPUTE, core)
    # CUDA graphs: none before 0.18; from 0.18 transformer_engine graphs holding attn and moe_router, not moe
    te = exp._replace(graphs=frozenset({"attn", "moe_router", "moe_preprocess"}), graph_impl="transformer_engine")
    assert not fine_offload.graphs_ok(te, (0, 17)) and fine_offload.graphs_ok(te, (0, 18))
    assert not fine_offload.graphs_ok(te._replace(graphs=frozenset({"moe_router", "moe_preprocess"})), (0, 19))
    assert not fine_offload.graphs_ok(te._replace(graph_impl="local"), (0, 19))
    # a state with CPU offloading, or with its own offload (a user's setting), gets no variant
    cands = fine_offload.candidates(cm, "megatron-lm")
    assert list(fine_offload.variants(Features(offload_layers=2), cands, (0, 17))) == []
    assert list(fine_offload.variants(Features(stack=exp), cands, (0, 17))) == []
    assert len(list(fine_offload.variants(Features(), cands, (0, 17)))) == 2


def test_the_offloading_plan_exports_and_reads_back_as_priced():
    """The found plan's Megatron-LM line (0.16 and 0.19) carries ``--fine-grained-activation-offloading
    --offload-modules core_attn`` and reads back to the plan the search priced (one pricing)."""
    cm, best, _ = _search()
    plan = to_plan(best, MODEL, parse_cluster("1x8-h100"), GBS, "analytic", predicted=False)
    assert plan.stack.offload.modules == ("core_attn",)
    for version in ("0.16", "0.19"):
        line, back, ms = _round_trip(plan, version)
        words = line.split()
        assert "--fine-grained-activation-offloading" in words
        assert words[words.index("--offload-modules") + 1] == "core_attn"
        assert back.settings.stack.offload.modules == ("core_attn",)
        assert ms == pytest.approx(best.iteration_ms, rel=1e-6)


def test_a_bridge_search_offloads_and_the_runtime_line_does_not():
    """``--target megatron-bridge`` (the recipe's TE loss fusion keeps no fp32 softmax, so memory binds lower): the
    Bridge line offloads ``core_attn`` and its overrides say so; the aceso runtime keeps activations on the GPU, so
    the heterogeneous line never offloads (``api.runtime_state``)."""
    from search.megatron import megatron_config
    from search.megatron.bridge import overrides
    from search.planner.api import plan_all
    cl = parse_cluster("1x8-h100")
    cm = cost_model(MODEL, cl, TRAINING)
    cm.memory_limit_mb = 11400
    plans = plan_all(cm, TRAINING, SearchOptions(budget_evals=200), 1, target="megatron-bridge")
    bridge, het = plans.megatron.plans[0], plans.aceso.plans[0]
    assert bridge.fits and bridge.setting == NO_RECOMPUTE
    assert bridge.state.features.stack.offload_modules == ("core_attn",)
    assert het.state.features.stack is None
    plan = to_plan(bridge, MODEL, cl, GBS, "analytic", predicted=False)
    model = overrides(megatron_config(plan))[1]["model"]
    assert model["fine_grained_activation_offloading"] is True and model["offload_modules"] == ["core_attn"]
