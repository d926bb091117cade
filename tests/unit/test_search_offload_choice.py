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


def test_local_layers_are_not_offered_the_offload_and_do_not_export_it():
    """Priced with unfused attention (megatron-core's local layers: ``--transformer-impl local``), the same
    memory-bound search is not offered the offload, which Megatron-LM asserts off there (core_v0.16.1 to
    core_v0.19.0 ``validate_args``: 'only supported with transformer_engine implementation'), and a plan with it
    priced so is not expressible."""
    from search.megatron.expressible import check_expressible
    cl = parse_cluster("1x8-h100")
    training = TRAINING.model_copy(update={"attention": "unfused"})
    cm = cost_model(MODEL, cl, training)
    cm.memory_limit_mb = LIMIT_MB
    assert fine_offload.candidates(cm, "megatron-lm") == []
    res, _ = settle(cm, training, "megatron-lm", SearchOptions(budget_evals=100), 1)
    assert res.plans[0].state.features.stack is None or not res.plans[0].state.features.stack.offload_modules
    _, best, _ = _search()                 # flash attention: offloads (test above)
    plan = to_plan(best, MODEL, cl, GBS, "analytic", predicted=True)
    assert check_expressible(plan) is None
    unfused = plan.model_copy(update={"predicted": plan.predicted.model_copy(update={"attention": "unfused"})})
    assert "--transformer-impl local" in check_expressible(unfused)


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


def _offload_plan(scope, impl, modules, release, moe_spec=None):
    """The validation error of a tiny MoE plan with these graphs and this offload, priced at ``release`` (None: it
    validates)."""
    import pydantic

    from search.settings.stack import CudaGraphs, FineGrainedOffload, StackSettings
    from search.spec.plan import uniform_plan
    plan = uniform_plan(tiny_moe(**(moe_spec or {})), 1, 1, 4, 4, 8, cluster=parse_cluster("1x4-h100"))
    data = plan.model_dump()
    data["settings"]["release"] = release
    data["settings"]["stack"] = StackSettings(cuda_graphs=CudaGraphs(impl=impl, scope=tuple(scope)),
                                              offload=FineGrainedOffload(modules=tuple(modules))).model_dump()
    try:
        type(plan).model_validate(data)
    except pydantic.ValidationError as e:
        return str(e)
    return None


def test_the_plan_refuses_the_offload_with_graphs_from_its_release():
    """megatron-core's rules on the two together, by release (stack.offload_graphs_refusal; checked against each
    release's own config in tests/runtime/test_stack_rules.py and test_offload_choice_oracle.py): none in 0.16 and
    0.17; core_v0.18.2 transformer_config.py:2351-2372: transformer_engine or full_iteration graphs only, never the
    moe scope, full_iteration only with --fine-grained-offloading-max-inflight-offloads; core_v0.19.0 :2596-2641:
    also local graphs of named scopes when only expert_fc1 / moe_act are offloaded."""
    padded = {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}
    for rel in ("26.04.01", "0.17"):
        assert _offload_plan(["attn"], "local", ["core_attn"], rel) is None
        assert _offload_plan(["attn", "moe"], "transformer_engine", ["expert_fc1"], rel, padded) is None
    why = _offload_plan(["attn"], "local", ["core_attn"], "0.18")
    assert "stack.cuda_graphs.impl local (--cuda-graph-impl local)" in why and "use impl transformer_engine" in why
    assert _offload_plan(["moe_router", "moe_preprocess"], "local", ["moe_act"], "0.18") is not None
    assert _offload_plan(["moe_router", "moe_preprocess"], "local", ["moe_act"], "0.19") is None
    assert "offload only expert_fc1 / moe_act" in _offload_plan(["attn"], "local", ["core_attn"], "0.19")
    assert "whole layers" in _offload_plan([], "local", ["moe_act"], "0.19", padded)
    for rel in ("0.18", "0.19"):
        assert "use scope moe_router" in _offload_plan(["attn", "moe"], "transformer_engine", ["expert_fc1"], rel,
                                                       padded)
        assert "--fine-grained-offloading-max-inflight-offloads" in \
            _offload_plan(["full_iteration"], "local", ["core_attn"], rel, padded)
        assert _offload_plan(["attn", "moe_router", "moe_preprocess"], "transformer_engine", ["core_attn"],
                             rel) is None
    # the search's choice applies the same rule first (fine_offload.graphs_ok)
    sk = StackKey(graphs=frozenset({"attn", "moe_router", "moe"}), graph_impl="transformer_engine",
                  offload_modules=("expert_fc1",), offload_fraction=1.0)
    assert not fine_offload.graphs_ok(sk, (0, 19))


def test_the_import_refuses_expert_offload_inside_a_recomputed_moe_layer_from_0_19():
    """core_v0.19.0 transformer_config.py:1874-1884: ``moe`` in --recompute-modules (selective; --moe-layer-recompute
    appends it) wraps the whole MoE forward in a checkpoint, and offloading expert_fc1 / moe_act inside it is
    refused; 0.18 has no such rule. No plan field says ``moe`` recompute, so the import checks it, one line."""
    from search.io.errors import AcesoError
    from search.megatron.importer import read_megatron
    from tests.unit.test_stack_features import STACK_LINE
    line = STACK_LINE.replace("--overlap-moe-expert-parallel-comm --delay-wgrad-compute ", "") \
        .replace("--cross-entropy-loss-fusion --cross-entropy-fusion-impl te ", "") \
        .replace("--offload-modules core_attn attn_proj", "--offload-modules core_attn attn_proj expert_fc1")
    moe = line + " --recompute-granularity selective --recompute-modules core_attn moe"
    read_megatron(moe, world_size=8, version="0.18")
    with pytest.raises(AcesoError) as e:
        read_megatron(moe, world_size=8, version="0.19")
    assert "--recompute-modules moe with --offload-modules expert_fc1" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(AcesoError, match="--recompute-modules moe with --offload-modules expert_fc1"):
        read_megatron(line + " --moe-layer-recompute", world_size=8, version="0.19")
    read_megatron(moe.replace(" expert_fc1", ""), world_size=8, version="0.19")     # core_attn: not inside the MoE


def test_the_import_notes_what_the_recompute_leaves_the_offload_to_move():
    """megatron-core accepts the offload with full recompute and with core_attn recomputed (no rule in any release),
    so the import reads them, says what moves, and prices them so (stack_cost.moves: nothing under full recompute,
    not the core attention's input where it is recomputed)."""
    from search.megatron.importer import read_megatron
    from tests.unit.test_stack_features import STACK_LINE
    line = STACK_LINE.replace("--overlap-moe-expert-parallel-comm --delay-wgrad-compute ", "") \
        .replace("--cross-entropy-loss-fusion --cross-entropy-fusion-impl te ", "") \
        .replace("--cuda-graph-impl transformer_engine --cuda-graph-scope attn moe_router moe_preprocess ", "")
    full = read_megatron(line + " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
                         world_size=8, version="0.17")
    assert any("with --recompute-granularity full" in n and "priced as moving nothing" in n for n in full.notes)
    sel = read_megatron(line + " --recompute-activations", world_size=8, version="0.17")
    assert any("--offload-modules core_attn with --recompute-modules core_attn" in n for n in sel.notes)
    assert not any("offload" in n for n in read_megatron(line, world_size=8, version="0.17").notes)
