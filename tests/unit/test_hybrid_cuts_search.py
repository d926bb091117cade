"""The search's ``Megatron-LM |-pattern`` line (search/planner/hybrid_cuts.py): the cut descent against a brute force
over every unit cut, never slower than its seeds, a plan the export writes, and not offered (one line) where the
release's Megatron-LM has no '|' cuts."""

import pytest

from search.cli import main
from search.megatron.versions import release
from search.spec.presets import load_model


def _evaluator(model, cluster="1x2-h100", gbs=16):
    from search.spec.cluster import parse_cluster
    from search.pricing import make_cost_model
    from search.planner.state import Evaluator
    from search.spec.training import TrainingSpec
    cm = make_cost_model(model, parse_cluster(cluster), TrainingSpec(global_batch_size=gbs))
    return Evaluator(cm, gbs, None, "megatron-lm")


def test_refine_finds_the_brute_force_best_cut_of_two_stages():
    """pp 2, 5 layers (no even split by layers): the descent from the layer cuts lands on the fastest of every
    unit cut, priced one by one (the reference), and never on a slower plan than its seeds."""
    from search.planner.hybrid_cuts import price, refine
    from search.planner.megatron_lm import NONE_SETTING
    from search.planner.state import State
    from search.costmodel.types import Shape
    model = load_model("llama3-8b", num_layers=5)
    ev = _evaluator(model)
    shape = Shape(tp=1, cp=1, dp=1, sp=False)
    seeds = [price(ev, State(1, (shape, shape), (0, cut, 10)), NONE_SETTING) for cut in (4, 6)]
    best, why = refine(ev, seeds, release())
    assert why is None
    brute = min((price(ev, State(1, (shape, shape), (0, cut, 10)), s) for cut in range(1, 10)
                 for s in (NONE_SETTING,)), key=lambda e: e.iteration_ms)
    assert best.iteration_ms <= brute.iteration_ms + 1e-9
    assert best.iteration_ms <= min(s.iteration_ms for s in seeds)


def test_the_search_line_is_a_plan_the_export_writes(tmp_path, capsys):
    import json
    from search.megatron.hybrid_pattern import hybrid_form
    from search.spec.plan import load_plan
    args = ["search", "--model", "llama3-8b", "--num-layers", "5", "--cluster", "1x4-h100", "--global-batch-size",
            "16", "--budget-evals", "200", "--pp", "2", "--json", "--target", "megatron-lm",
            "-o", str(tmp_path / "plan.json")]
    assert main(args) == 0
    lines = json.loads(capsys.readouterr().out)["lines"]
    pat, mlm = lines["megatron_lm_pattern"], lines["megatron_lm"]
    assert pat["iteration_ms"] <= mlm["iteration_ms"]
    flat = pat["hybrid_layer_pattern"].replace("|", "")
    assert flat == "*-" * 5
    written = load_plan(tmp_path / "plan.pattern.json")        # -o writes the line's plan beside the target's
    assert hybrid_form(written).pattern == pat["hybrid_layer_pattern"]
    assert written.predicted.iteration_time_ms == pytest.approx(pat["iteration_ms"], abs=1e-3)
    assert main([*args[:args.index("--json")], "--release", "26.02"]) == 0
    out = capsys.readouterr().out
    assert "Megatron-LM |-pattern not offered: Megatron-LM core_v0.16.1 has no '|'" in out.replace("\n", " ")


def test_a_seed_is_refined_under_its_own_moe_settings():
    """An MoE seed priced with another dispatcher than the evaluator's (the search picks one per plan): the
    refinement prices it as it was, so it is never slower than the seed."""
    from search.costmodel.types import Shape
    from search.settings.moe_plan import MoEPlanSettings
    from search.planner.hybrid_cuts import refine
    from search.planner.megatron_lm import best_setting
    from search.planner.state import Evaluator, State
    model = load_model("mixtral-8x7b", num_layers=3)
    base = _evaluator(model, "1x4-h100")
    other = Evaluator(base.cm, base.gbs, None, "megatron-lm", MoEPlanSettings(token_dispatcher="allgather"))
    shape = Shape(tp=1, dp=2, ep=2)
    seed = best_setting(other, State(2, (shape, shape), (0, 4, 6)), exact=True)
    assert seed.fits
    best, _ = refine(base, [seed], release())
    assert best.iteration_ms <= seed.iteration_ms + 1e-9
    assert best.moe == seed.moe


def test_the_heterogeneous_line_is_never_slower_than_the_pattern_line(capsys):
    """A |-pattern plan (one shape, unit cuts, per-unit recompute) runs on the aceso runtime too: line 4 is never
    slower than line 3 (here, on 4 pipeline stages, the pattern cuts beat every layer cut; unconstrained, the runtime's
    synchronous interleaved p2p makes one stage the best plan, where nothing is cut)."""
    import json
    assert main(["search", "--model", "llama3-70b", "--num-layers", "40", "--cluster", "4x8-h100",
                 "--global-batch-size", "64", "--pp", "4", "--budget-evals", "200", "--workers", "1", "--json"]) == 0
    lines = json.loads(capsys.readouterr().out)["lines"]
    assert lines["megatron_lm_pattern"]["iteration_ms"] < lines["megatron_lm"]["iteration_ms"]
    assert lines["aceso"]["iteration_ms"] <= lines["megatron_lm_pattern"]["iteration_ms"]


def test_the_bench_recipe_rows_are_the_published_configuration():
    """bench/hybrid_cuts.py's RECIPES hold the search to a published configuration's shape, so their uniform line is
    that configuration on the even split and the |-pattern line the same shape cut elsewhere. Reference: Megatron-
    Bridge 69c2088 `_nemotron_3_super_pretrain_64gpu_h100_bf16_config`: 64 H100, TP1 PP2 EP32 ETP1, no VPP, MBS 1,
    GBS 1280, seq 4096, the flex dispatcher, the precision-aware optimizer with fp16 main params and bf16 moments."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import hybrid_cuts
    from search.cli.search_cmd import find, parse_args, settings_from_args

    (cid, gbs, argv), = [r for r in hybrid_cuts.RECIPES if r[0].startswith("nemotron-3-super")]
    args = parse_args([*argv, "--budget-evals", "60"])
    found = find(args, quiet=True)
    assert (found.cluster.num_gpus, found.model.seq_length, found.training.global_batch_size) == (64, 4096, 1280)
    pa = settings_from_args(args, found.training, found.model).precision_aware_optimizer
    assert (pa.main_params_dtype, pa.exp_avg_dtype, pa.exp_avg_sq_dtype) == ("fp16", "bf16", "bf16")
    uni, pattern = found.plans.uniform.evaluation, found.plans.pattern
    for e in (uni, pattern):
        assert e.fits and e.moe.token_dispatcher == "flex"
        assert [(s.tp, s.dp, s.ep, s.expert_tp) for s in e.state.shapes] == [(1, 32, 32, 1)] * 2
        assert e.state.mbs // 32 == 1 and len(e.state.bounds) == 3      # one micro-batch per rank, no VPP
    layers = [b - a for a, b in zip(uni.state.bounds, uni.state.bounds[1:])]
    assert layers == [44, 46]       # 88 layers evenly, the 2 MTP depths on the last stage
    assert pattern.iteration_ms <= uni.iteration_ms
