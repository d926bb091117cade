"""The search under megatron-core's EP overlap (``--overlap-moe-expert-parallel-comm``, ``moe.overlap_ep_comm``).

megatron-core refuses the overlap with pipeline stages but no virtual chunks, without ep > 1, and with full
recompute; the plan check says so (``moe_plan.overlap_ep_refusal``). The search must never return such a plan:
before, a Qwen3-30B search under the overlap picked full recompute and failed inside ``to_plan``, and
bench/moe_published.py stopped on a pp 8 x vp 1 candidate of the Qwen3-235B H100 row. The reference is the plan
validator itself: every plan the search returns must build a ``ParallelPlan``."""

import numpy as np
import pytest

from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.costmodel.types import RC_CODE, Shape
from search.settings.moe_plan import MoEPlanSettings
from search.planner.aceso import SearchOptions, search
from search.planner.api import make_space
from search.planner.baseline import best_uniform
from search.planner.state import Evaluator, State, to_plan
from search.spec.presets import load_model
from search.spec.training import TrainingSpec

OVERLAP = MoEPlanSettings(overlap_ep_comm=True)


def _problem(target: str, moe=OVERLAP):
    model = load_model("qwen3-30b-a3b")
    cl = parse_cluster("1x8-h100")
    tr = TrainingSpec(global_batch_size=64, micro_batch_sizes=[1, 2])
    cm = make_cost_model(model, cl, tr)
    return model, cl, tr, cm, make_space(cm, tr, target, moe=moe)


@pytest.mark.parametrize("target", ["aceso", "megatron-lm"])
def test_every_searched_plan_runs_under_the_overlap(target):
    model, cl, tr, cm, space = _problem(target)
    res = search(cm, 64, space, SearchOptions(budget_evals=300, polish_top=1))
    base = best_uniform(cm, 64, space, model)
    evs = [e for e in res.plans if e.fits] + [base.evaluation]
    assert evs
    for e in evs:
        plan = to_plan(e, model, cl, 64, "analytic")        # the plan validator: raises on what megatron refuses
        assert plan.moe.overlap_ep_comm
        assert "full" not in {rc for s in plan.stages for rc in s.all_recompute}
        assert plan.num_stages == 1 or plan.num_virtual_stages > 1


def test_the_space_keeps_out_pipelines_without_chunks():
    *_, space = _problem("aceso")
    *_, plain = _problem("aceso", moe=None)
    s = Shape(1, 4, 1, False, 4, 0)                            # 4 GPUs, ep 4
    n = space.num_units
    f = space.features[0]
    two = State(1 * 4, (s, s), (0, n // 2, n), f)              # pp 2, vp 1
    chunks = State(1 * 4, (s, s), (0, n // 4, n // 2, 3 * n // 4, n), f)    # pp 2, vp 2
    assert plain.legal(two) and plain.legal(chunks)            # without the overlap both are plans
    assert not space.legal(two) and space.legal(chunks)
    one = State(8, (Shape(1, 8, 1, False, 1, 0),), (0, n), f)  # one stage at ep 1: the overlap has no all-to-all
    assert plain.legal(one) and not space.legal(one)


def test_the_evaluator_refuses_full_recompute_under_the_overlap():
    model, cl, tr, cm, space = _problem("aceso")
    st = State(8, (Shape(1, 8, 1, False, 8, 0),), (0, model.num_units), space.features[0])
    n = model.num_units
    full = np.full(n, RC_CODE["full"], np.int8)
    sel = np.full(n, RC_CODE["selective"], np.int8)
    on, off = Evaluator(cm, 64, moe=OVERLAP), Evaluator(cm, 64, moe=MoEPlanSettings())
    assert not np.isfinite(on.stage_with(st, 0, 0, full).cost.time_per_microbatch_ms)
    assert np.isfinite(off.stage_with(st, 0, 0, full).cost.time_per_microbatch_ms)
    assert np.isfinite(on.stage_with(st, 0, 0, sel).cost.time_per_microbatch_ms)     # selective stays a choice


def test_a_stage_that_fits_nowhere_reports_its_least_memory_without_full():
    """With no room at all, the recompute search under the overlap returns no full codes, and memory no more than
    all-none or all-selective (the least it can reach without full), where without the overlap it reports full."""
    from search.planner.recompute import optimize_stage

    model, cl, tr, cm, space = _problem("aceso")
    n = model.num_units
    cm.memory_limit_mb = 1.0
    kw = {"ep": 8, "moe": OVERLAP}
    rc, c = optimize_stage(cm, 0, 1, 0, 0, n, 1, 8, 8, no_full=True, **kw)
    assert not c.fits and RC_CODE["full"] not in set(rc.tolist())
    none = cm.stage_cost(0, 1, 0, 0, n, 1, 8, np.zeros(n, np.int8), 8, **kw)
    sel = cm.stage_cost(0, 1, 0, 0, n, 1, 8, np.full(n, RC_CODE["selective"], np.int8), 8, **kw)
    assert c.memory_mb <= min(none.memory_mb, sel.memory_mb) + 1e-6
    rc_free, _ = optimize_stage(cm, 0, 1, 0, 0, n, 1, 8, 8, **kw)
    assert RC_CODE["full"] in set(rc_free.tolist())


SMALL_MOE = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 8 --ffn-hidden-size 2048 --seq-length 1024 "
             "--max-position-embeddings 1024 --position-embedding-type rope --normalization RMSNorm --swiglu "
             "--untie-embeddings-and-output-weights --disable-bias-linear --num-experts 8 --moe-router-topk 2 "
             "--moe-ffn-hidden-size 512 --micro-batch-size 1 --global-batch-size 16 --bf16 "
             "--tokenizer-type NullTokenizer --vocab-size 31999")


def test_the_heterogeneous_line_is_the_plan_the_runtime_runs_and_starts_from_the_megatron_line(tmp_path, capsys):
    """Issue 32: a host-bound MoE model's Megatron-LM plan uses CUDA graphs and the EP overlap, which the aceso
    runtime does not run. The report's heterogeneous line took that plan (6.05 ms) while -o wrote another (13.39 ms:
    the runtime refused the first); the heterogeneous search never started from it as the runtime runs it. Now
    the line is the plan -o writes, no slower than the Megatron-LM plan priced (by the plan evaluator) without
    what the runtime does not run, and the report says why it is slower than the Megatron-LM line."""
    import json

    from search.cli import main
    from search.cli.search_cmd import find, parse_args
    from search.megatron.importer import read_megatron
    from search.settings.plan_settings import RUNTIME
    from search.planner.report import to_plan as report_plan
    from search.spec.presets import spec_text

    model = read_megatron(SMALL_MOE, cluster=parse_cluster("1x8-h100")).plan.model
    spec = tmp_path / "m.json"
    spec.write_text(spec_text(model, "json", title=model.name))
    argv = ["--model", str(spec), "--cluster", "1x8-h100", "--global-batch-size", "16", "--budget-evals", "60"]
    assert main(["search", *argv, "--json", "-o", str(tmp_path / "p.json")]) == 0
    out = json.loads(capsys.readouterr().out)
    written = json.loads((tmp_path / "p.json").read_text())["predicted"]["iteration_time_ms"]
    het, mlm = out["lines"]["aceso"]["iteration_ms"], out["lines"]["megatron_lm"]["iteration_ms"]
    assert het == pytest.approx(written, abs=1e-3)
    assert het > mlm and "CUDA graphs" in out["aceso_slower"] and "EP overlap" in out["aceso_slower"]
    # the Megatron-LM line's plan without CUDA graphs and the EP overlap, priced as the runtime runs it
    f = find(parse_args(argv), quiet=True)
    e = f.plans.megatron.plans[0]
    plan = report_plan(e, f.model, f.cluster, f.training, f.cm, RUNTIME)
    plan = plan.model_copy(update={"stack": None, "moe": plan.moe.model_copy(update={"overlap_ep_comm": False,
                                                                                   "delay_wgrad": False})})
    assert het <= f.cm.evaluate(plan).iteration_ms + 5e-5          # the report rounds its lines to 4 decimals
