"""`aceso explain --megatron-args`: a Megatron-LM command line is priced exactly as the plan it imports to (as
Megatron-LM's training script runs it), plus what a short search on the same model and cluster gains."""

import json

from search.cli import main
from search.cluster import parse_cluster
from search.costmodel import make_cost_model
from search.costmodel.types import RunSettings
from search.megatron.importer import read_megatron
from search.training import TrainingSpec

ARGS = ("--num-layers 4 --hidden-size 2048 --num-attention-heads 32 --seq-length 2048 --max-position-embeddings 2048 "
        "--micro-batch-size 1 --global-batch-size 64 --fp16 --tensor-model-parallel-size 4 "
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 --lr 1e-4 --empty-unused-memory-level 2")


def test_explain_prices_the_imported_plan_as_megatron_lm_runs_it_and_reports_the_search_gain(capsys):
    assert main(["explain", "--megatron-args", ARGS, "--cluster", "1x8-h100", "--search-budget-evals", "150",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    plan = read_megatron(ARGS, cluster=parse_cluster("1x8-h100")).plan
    assert (plan.stages[0].tp, plan.stages[0].dp, plan.model.name) == (4, 2, "gpt-1.3b")
    training = TrainingSpec(global_batch_size=64, precision="fp16")
    cm = make_cost_model(plan.model, plan.cluster, training, settings=RunSettings.megatron_lm("fp16"))
    assert abs(out["iteration_time_ms"] - cm.evaluate(plan).iteration_ms) < 1e-6
    gain = out["megatron_search"]
    assert gain["config_ms"] == out["iteration_time_ms"] and gain["budget_evals"] == 150
    for key in ("megatron", "aceso"):
        assert abs(gain[key]["speedup"] - gain["config_ms"] / gain[key]["iteration_ms"]) < 1e-9
    # tp 4 with full recompute on 8 H100s for a 4-layer 1.3B model is far from the best Megatron-LM configuration
    assert gain["megatron"]["speedup"] > 1.2
    assert any("ignored 1 flag that does not change the plan: --empty-unused-memory-level" in n for n in out["notes"])


def test_the_drop_in_plan_is_expressible_and_priced_as_megatron_lm_runs_it():
    from search.megatron import check_expressible
    from search.megatron.compare import search_gain
    plan = read_megatron(ARGS, cluster=parse_cluster("1x8-h100")).plan
    g = search_gain(plan, 1.0, "flash", budget_evals=100)
    drop_in = g["megatron"]["plan"]
    assert check_expressible(drop_in) is None
    cm = make_cost_model(plan.model, plan.cluster, TrainingSpec(global_batch_size=64, precision="fp16"),
                         settings=RunSettings.megatron_lm("fp16"))
    assert abs(g["megatron"]["iteration_ms"] - cm.evaluate(drop_in).iteration_ms) < 1e-6


def test_explain_table_prints_the_three_lines(capsys):
    assert main(["explain", "--megatron-args", ARGS, "--cluster", "1x8-h100", "--search-budget-evals", "100"]) == 0
    lines = capsys.readouterr().out.splitlines()
    mine = next(i for i, line in enumerate(lines) if line.startswith("your Megatron-LM configuration:"))
    assert lines[mine + 1].startswith("best Megatron-LM plan (drop-in):") and "x faster" in lines[mine + 1]
    assert lines[mine + 2].startswith("best heterogeneous plan (aceso runtime):")
    assert "aceso search --model gpt-1.3b --num-layers 4 --cluster 1x8-h100 --global-batch-size 64" in lines[mine + 3]


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


def test_the_search_starts_from_the_given_configuration_even_outside_its_default_space():
    """vpp 3 and a per-rank micro-batch of 16 are outside the default candidates ([1, 2] and [1, 2, 4, 8]); the
    space is widened to hold them and the configuration is a start, so no line is slower than it (fp16: the two
    framework pricings agree)."""
    from search.megatron.compare import search_gain
    line = ("--num-layers 12 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
            "--max-position-embeddings 1024 --micro-batch-size 16 --global-batch-size 256 --fp16 "
            "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 3 "
            "--recompute-activations --tokenizer-type NullTokenizer --vocab-size 51199")
    plan = read_megatron(line, cluster=parse_cluster("1x8-a100")).plan
    cm = make_cost_model(plan.model, plan.cluster, TrainingSpec(global_batch_size=256, precision="fp16"),
                         settings=RunSettings.megatron_lm("fp16"))
    mine = cm.evaluate(plan).iteration_ms
    g = search_gain(plan, mine, "flash", budget_evals=60)
    assert g["megatron"]["speedup"] >= 1 - 1e-9 and g["aceso"]["speedup"] >= 1 - 1e-9
