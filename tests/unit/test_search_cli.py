"""`aceso search` / `aceso baseline`: determinism (byte-identical plans), validity, the three report lines,
--target megatron-lm, the feature switches, Ctrl-C, infeasible exit 2."""

import contextlib
import json

import pytest

from search.cli import main
from search.spec.plan import load_plan
from search.planner import megatron_lm
from search.planner.aceso import SearchOptions, search
from search.planner.synthetic import tiny_problem

ARGS = ["--model", "gpt-1.3b", "--num-layers", "4", "--cluster", "1x4-h100", "--global-batch-size", "64",
        "--budget-evals", "300"]


def test_two_runs_write_identical_bytes_whatever_the_workers(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["search", *ARGS, "--workers", "1", "--json", "-o", str(a)]) == 0
    assert main(["search", *ARGS, "--workers", "2", "--json", "-o", str(b)]) == 0
    assert a.read_bytes() == b.read_bytes()


def test_written_plan_validates_fits_and_matches_the_cost_model(tmp_path, capsys):
    from search.pricing import make_cost_model
    from search.spec.training import TrainingSpec
    out, trace = tmp_path / "plan.json", tmp_path / "trace.json"
    assert main(["search", *ARGS, "--top-k", "2", "--trace", str(trace), "--json", "-o", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    plan = load_plan(out)
    assert plan.cluster is not None and plan.world_size == 4 and plan.predicted is not None
    cm = make_cost_model(plan.model, plan.cluster, TrainingSpec(global_batch_size=64, precision="fp16"))
    cost = cm.evaluate(plan)
    assert cost.fits
    assert cost.iteration_ms == pytest.approx(plan.predicted.iteration_time_ms, rel=1e-6)
    assert summary["speedup"] >= 1.0  # never worse than the uniform baseline (it is one of the starts)
    assert (tmp_path / "plan.top2.json").exists()
    moves = json.loads(trace.read_text())
    assert moves and all(m["fits_after"] for m in moves if m["fits_before"])
    assert all(m["time_after_ms"] <= m["time_before_ms"] for m in moves if m["fits_before"])
    assert all(m["max_memory_after_mb"] < m["max_memory_before_mb"] for m in moves if not m["fits_before"])


def test_search_is_deterministic_in_process():
    cm, space, gbs = tiny_problem(5)
    r1 = search(cm, gbs, space, SearchOptions(budget_evals=200, seed=3))
    r2 = search(cm, gbs, space, SearchOptions(budget_evals=200, seed=3))
    assert [e.state for e in r1.plans] == [e.state for e in r2.plans] and r1.evals == r2.evals


def test_ctrl_c_returns_best_so_far():
    cm, space, gbs = tiny_problem(10)

    def stop(n):
        if n >= 40:
            raise KeyboardInterrupt
    res = search(cm, gbs, space, SearchOptions(budget_evals=10_000, callback=stop))
    assert res.interrupted and res.plans and res.plans[0].fits
    assert res.evals <= 41


def test_ctrl_c_in_cli_writes_best_plan(tmp_path, monkeypatch):
    from search.planner import report

    @contextlib.contextmanager
    def interrupting(total, quiet=False):
        def tick(n):
            if n >= 30:
                raise KeyboardInterrupt
        yield tick
    monkeypatch.setattr(report, "progress", interrupting)
    out = tmp_path / "plan.json"
    assert main(["search", *ARGS, "--workers", "1", "--budget-evals", "100000", "--json", "-o", str(out)]) == 130
    plan = load_plan(out)
    assert plan.world_size == 4
    base = tmp_path / "base.json"  # even stopped early, never worse than the uniform baseline
    assert main(["baseline", *ARGS[:-2], "--json", "-o", str(base)]) == 0
    assert plan.predicted.iteration_time_ms <= load_plan(base).predicted.iteration_time_ms + 1e-6


def test_infeasible_exits_2_with_what_would_fit(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["search", "--model", "gpt-13b", "--cluster", "1x1-h100", "--memory-limit-mb", "20000",
                 "--global-batch-size", "8", "--budget-evals", "50", "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "MiB per GPU" in err and "gpt-13b does not fit on 1 h100 GPU" in err
    assert "need at least" in err and "--memory-limit-mib" not in err      # over the GPU itself: more GPUs
    assert not out.exists()


def test_baseline_cli_writes_uniform_plan(tmp_path, capsys):
    out = tmp_path / "base.json"
    assert main(["baseline", *ARGS[:-2], "--json", "-o", str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    plan = load_plan(out)
    assert len({(s.tp, s.cp, s.dp, s.sequence_parallel) for s in plan.stages}) == 1 and plan.num_stages == info["pp"]
    assert megatron_lm.problem(plan) is None and plan.micro_batch_per_rank(0) == info["micro_batch_per_rank"]


def test_three_lines_and_the_megatron_target(tmp_path, capsys):
    # GPT-13B layers on one-GPU nodes, memory a third of the way from the least any plan needs to what pure DP
    # needs: the plans pipeline and recompute, and the three lines differ
    from tests.unit.search_helpers import memory_between
    from search.spec.presets import load_model
    limit = memory_between(load_model("gpt-13b", num_layers=6), "4x1-h100", 64, 0.3)
    BIG = ["--model", "gpt-13b", "--num-layers", "6", "--cluster", "4x1-h100", "--memory-limit-mb", f"{limit:.0f}",
           "--precision", "bf16",   # the fp16 preset: the runtime (the heterogeneous line) trains bf16 on an H100
           "--global-batch-size", "64", "--micro-batch-sizes", "1", "2", "--budget-evals", "300"]
    het, mlm = tmp_path / "het.json", tmp_path / "mlm.json"
    assert main(["search", *BIG, "--json", "-o", str(het)]) == 0
    a = json.loads(capsys.readouterr().out)
    assert main(["search", *BIG, "--target", "megatron-lm", "--json", "-o", str(mlm)]) == 0
    b = json.loads(capsys.readouterr().out)
    for s in (a, b):
        lines = s["lines"]
        assert lines["uniform"]["speedup"] == 1.0
        assert lines["uniform"]["iteration_ms"] >= lines["megatron_lm"]["iteration_ms"] >= \
            lines["aceso"]["iteration_ms"]
    assert a["target"] == "aceso" and b["target"] == "megatron-lm"
    assert a["iteration_ms"] == a["lines"]["aceso"]["iteration_ms"]
    assert b["iteration_ms"] == b["lines"]["megatron_lm"]["iteration_ms"]
    plan = load_plan(mlm)
    assert megatron_lm.problem(plan) is None
    assert load_plan(het).predicted.iteration_time_ms <= plan.predicted.iteration_time_ms


def test_feature_switches_reach_the_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["search", "--model", "gpt-1.3b", "--num-layers", "4", "--cluster", "1x8-h100", "--global-batch-size",
            "64", "--budget-evals", "200", "--json", "-o", str(out)]
    assert main(args + ["--sequence-parallel", "on", "--distributed-optimizer", "off", "--virtual-stages", "1"]) == 0
    plan = load_plan(out)
    assert not plan.distributed_optimizer and not plan.overlap_param_gather and plan.num_virtual_stages == 1
    assert all(s.sequence_parallel == (s.tp > 1) for s in plan.stages)
    assert main(args + ["--sequence-parallel", "off", "--overlap", "off"]) == 0
    plan = load_plan(out)
    assert not any(s.sequence_parallel for s in plan.stages)
    assert not plan.overlap_grad_reduce and not plan.overlap_param_gather
    capsys.readouterr()


@pytest.mark.parametrize("extra,field", [(["--virtual-stages", "0"], "--virtual-stages"),
                                         (["--context-parallel-sizes", "0"], "--context-parallel-sizes"),
                                         (["--context-parallel-sizes", "3"], "context-parallel")])
def test_bad_switches_exit_2_with_one_line(tmp_path, capsys, extra, field):
    out = tmp_path / "plan.json"
    assert main(["search", *ARGS, *extra, "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0] and not out.exists()


def test_compat_model_refuses_what_it_cannot_price(tmp_path, capsys, reference_db):
    out = tmp_path / "plan.json"
    args = ["search", "--model", "gpt-1.3b", "--cluster", "1x4-v100", "--global-batch-size", "512",
            "--cost-model", "aceso-compat", "--db", str(reference_db / "miniset"), "-o", str(out)]
    assert main(args + ["--distributed-optimizer", "on"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--distributed-optimizer on" in err[0] and not out.exists()


def test_tokens_per_gpu_beside_samples_and_mfu_in_every_report(tmp_path, capsys):
    """Issue 32: tokens/s per GPU (the unit of NVIDIA's tables) next to samples/s and MFU in search, baseline,
    explain and the export header, each global batch x sequence / iteration / GPUs (gpt-1.3b: 2048 tokens, 4 GPUs)
    from the one function (search.costmodel.throughput), so the four agree on one plan."""
    out = tmp_path / "p.json"
    assert main(["search", *ARGS, "--json", "-o", str(out)]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["tokens_per_s_per_gpu"] == pytest.approx(64 * 2048 / (s["iteration_ms"] / 1e3) / 4, rel=1e-4)
    assert s["samples_per_s"] == pytest.approx(64 / (s["iteration_ms"] / 1e3), rel=1e-4) and 0 < s["mfu"] < 1
    assert main(["explain", str(out), "--json"]) == 0
    e = json.loads(capsys.readouterr().out)
    assert e["tokens_per_s_per_gpu"] == pytest.approx(64 * 2048 / (e["iteration_time_ms"] / 1e3) / 4)
    assert e["iteration_time_ms"] == pytest.approx(s["iteration_ms"], rel=1e-4)
    assert e["tokens_per_s_per_gpu"] == pytest.approx(s["tokens_per_s_per_gpu"], rel=1e-4)
    assert main(["explain", str(out)]) == 0
    assert f"{e['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU" in capsys.readouterr().out
    assert main(["baseline", *ARGS[:-2], "--json"]) == 0
    b = json.loads(capsys.readouterr().out)
    assert b["tokens_per_s_per_gpu"] == pytest.approx(64 * 2048 / (b["iteration_ms"] / 1e3) / 4, rel=1e-4)
    assert main(["search", *ARGS]) == 0
    assert "tokens/s per GPU" in capsys.readouterr().out
    assert main(["export", str(out), "--to", "megatron-lm", "-o", "-"]) == 0
    assert f"{s['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU" in capsys.readouterr().out


def test_budget_help_says_the_per_stage_count_minimum_a_small_budget_evaluates(capsys):
    """`--budget-evals 1` evaluated 160 plans on a 4-layer model (8 stage counts x the planner's 20 per count) while
    the help said the budget is the plan evaluations over all stage counts; the help now names the minimum."""
    import re
    from search.cli import main
    from search.planner.aceso import MIN_PER_COUNT
    assert main(["search", "--model", "gpt-1.3b", "--num-layers", "4", "--cluster", "1x8-h100",
                 "--global-batch-size", "16", "--budget-evals", "1", "--workers", "1", "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)["evaluated_plans"]
    assert evaluated >= MIN_PER_COUNT > 1
    assert main(["search", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert re.search(rf"at least {MIN_PER_COUNT} per stage count", text), text
