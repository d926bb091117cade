"""`aceso explain --megatron-args`: a Megatron-LM command line is priced exactly as the plan it imports to, plus
what a short search on the same model and cluster gains (the same cost model, so the speedup is its ratio)."""

import json

from search.cli import main
from search.cluster import parse_cluster
from search.costmodel import make_cost_model
from search.megatron.importer import read_megatron
from search.training import TrainingSpec

ARGS = ("--num-layers 4 --hidden-size 2048 --num-attention-heads 32 --seq-length 2048 --max-position-embeddings 2048 "
        "--micro-batch-size 1 --global-batch-size 64 --fp16 --tensor-model-parallel-size 4 "
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 --lr 1e-4 --made-up 2")


def test_explain_prices_the_imported_plan_and_reports_the_search_gain(capsys):
    assert main(["explain", "--megatron-args", ARGS, "--cluster", "1x8-h100", "--search-budget-evals", "150",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    plan = read_megatron(ARGS, cluster=parse_cluster("1x8-h100")).plan
    assert (plan.stages[0].tp, plan.stages[0].dp, plan.model.name) == (4, 2, "gpt-1.3b")
    cm = make_cost_model(plan.model, plan.cluster, TrainingSpec(global_batch_size=64, precision="fp16"))
    assert abs(out["iteration_time_ms"] - cm.evaluate(plan).iteration_ms) < 1e-6
    gain = out["megatron_search"]
    assert gain["config_ms"] == out["iteration_time_ms"] and gain["budget_evals"] == 150
    assert abs(gain["speedup"] - gain["config_ms"] / gain["search_ms"]) < 1e-9
    assert gain["speedup"] > 1        # tp 4 with full recompute on 8 H100s for a 4-layer 1.3B is far from best
    assert any("ignored 1 flag that does not change the plan: --made-up" in n for n in out["notes"])


def test_explain_table_prints_the_two_lines(capsys):
    assert main(["explain", "--megatron-args", ARGS, "--cluster", "1x8-h100", "--search-budget-evals", "100"]) == 0
    lines = capsys.readouterr().out.splitlines()
    mine = next(i for i, line in enumerate(lines) if line.startswith("your Megatron-LM configuration:"))
    assert lines[mine + 1].startswith("aceso search (100 plan evaluations):") and "x faster" in lines[mine + 1]
    assert "aceso search --model gpt-1.3b --num-layers 4 --cluster 1x8-h100 --global-batch-size 64" in lines[mine + 2]


def test_explain_megatron_args_needs_a_cluster_and_no_plan(tmp_path, capsys):
    assert main(["explain", "--megatron-args", ARGS]) == 2
    assert "needs --cluster" in capsys.readouterr().err
    f = tmp_path / "run.sh"
    f.write_text("torchrun --nproc-per-node 4 pretrain_gpt.py " + ARGS)
    assert main(["explain", "--megatron-args-file", str(f), "--cluster", "1x8-h100"]) == 2
    assert "world sizes disagree: the launcher's 4, the cluster's 8" in capsys.readouterr().err
    assert main(["explain", "--megatron-args-file", str(f), "--cluster", "1x4-h100", "--search-budget-evals", "0",
                 "--json"]) == 0
    assert "megatron_search" not in json.loads(capsys.readouterr().out)
