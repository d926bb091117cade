"""One price of a plan (``search/pricing/plan_price.py``): import, explain, validate, calibrate, export and the search report
the same numbers for the same plan under the settings its flags run, to the last digit."""

import json

import pytest

from search.calibration.calibrate import Run, price as calibrate_price
from search.cli import main
from search.spec.cluster import parse_cluster
from search.costmodel.memory import MB
from search.megatron.importer import read_megatron
from search.spec.plan import load_plan
from search.pricing import price

CLUSTER = "1x8-h100"
ARGS = ("--num-layers 4 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 "
        "--micro-batch-size 2 --global-batch-size 64 --bf16 --tensor-model-parallel-size 2 --vocab-size 50257 "
        "--transformer-impl transformer_engine --overlap-grad-reduce")


def _imported(tmp_path, capsys, flags: str, name: str):
    out = tmp_path / name
    assert main(["import", "--from", "megatron-lm", "--args", ARGS + flags, "--cluster", CLUSTER, "-o", str(out)]) == 0
    capsys.readouterr()
    return out, load_plan(str(out))


@pytest.mark.parametrize("flags", ["", " --grad-reduce-in-bf16"])
def test_every_command_prices_an_imported_command_line_as_its_flags_run_it(tmp_path, capsys, flags):
    path, plan = _imported(tmp_path, capsys, flags, "p.json")
    cost = price(plan)
    assert plan.predicted.iteration_time_ms == cost.iteration_ms                                # import
    assert main(["explain", str(path), "--json"]) == 0                                           # explain
    assert json.loads(capsys.readouterr().out)["iteration_time_ms"] == pytest.approx(cost.iteration_ms, abs=1e-9)
    assert main(["validate", str(path), "--json"]) == 0                                          # validate
    mem = json.loads(capsys.readouterr().out)["stage_memory_mib"]
    assert mem == [round(s.memory_mb, 1) for s in cost.stages]
    imp = read_megatron(ARGS + flags, cluster=parse_cluster(CLUSTER))                           # calibrate
    ran = calibrate_price(Run("", imp.plan, imp.config.attention, "megatron-lm", None), imp.plan.cluster)
    assert ran.iteration_ms == cost.iteration_ms and ran.max_memory_mb == cost.max_memory_mb
    assert main(["export", str(path), "--to", "megatron-lm", "-o", str(tmp_path / "run.sh")]) == 0   # export
    assert f"{cost.iteration_ms:.1f} ms per iteration" in (tmp_path / "run.sh").read_text()


def test_the_gradient_buffer_is_the_dtype_the_flags_reduce_in():
    """Megatron-LM core_v0.16.1 validate_args: --bf16 reduces (and keeps the DDP gradient buffer) in fp32, 4 B per
    parameter, unless --grad-reduce-in-bf16 (2 B). The price of each command line follows its own flag, in
    every command (calibrate priced both as fp32 before: the framework's default, not the run's flags)."""
    cl = parse_cluster(CLUSTER)
    fp32, bf16 = (read_megatron(ARGS + f, cluster=cl).plan for f in ("", " --grad-reduce-in-bf16"))
    h, s, layers, tp = 2048, 2048, 4, 2
    vocab = -(-50257 // (128 * tp)) * 128 * tp          # Megatron-LM pads to a multiple of 128 x tp
    # per rank: the layers' weights and the tied embedding split over tp, the learned positions whole (their
    # biases and norms, under 0.1% here, are left out)
    params = (layers * 12 * h * h + vocab * h) / tp + s * h
    for plan, per_param in ((fp32, 4), (bf16, 2)):
        for cost in (price(plan), calibrate_price(Run("", plan, "flash", "megatron-lm", None), cl)):
            assert cost.stages[0].memory_breakdown["grads"] * MB == pytest.approx(params * per_param, rel=0.002)


def test_a_target_prices_the_same_switches_under_its_own_defaults(tmp_path, capsys):
    """``price(plan, target)``: the plan's switches as another framework runs them; ``explain --framework`` is it."""
    path, plan = _imported(tmp_path, capsys, " --grad-reduce-in-bf16", "p.json")
    as_lm = price(plan, "megatron-lm")
    assert as_lm.iteration_ms == price(plan).iteration_ms                      # the plan's own framework: itself
    on_runtime = price(plan, "aceso")
    assert main(["explain", str(path), "--framework", "runtime", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["iteration_time_ms"] == pytest.approx(on_runtime.iteration_ms, abs=1e-9)
    fp32 = price(plan.model_copy(update={"settings": plan.settings.model_copy(update={"framework": "runtime"})}),
                 "megatron-lm")                                                  # Megatron-LM's default: fp32
    assert fp32.stages[0].memory_breakdown["grads"] == pytest.approx(2 * as_lm.stages[0].memory_breakdown["grads"])


@pytest.mark.parametrize("target", ["aceso", "megatron-lm"])
def test_a_searched_plan_is_priced_as_the_search_priced_it(tmp_path, capsys, target):
    out = tmp_path / "p.json"
    assert main(["search", "--model", "gpt-1.3b", "--num-layers", "4", "--cluster", CLUSTER, "--global-batch-size",
                 "64", "--target", target, "--budget-evals", "60", "--workers", "1", "-o", str(out)]) == 0
    capsys.readouterr()
    plan = load_plan(str(out))
    cost = price(plan)
    assert plan.predicted.iteration_time_ms == pytest.approx(cost.iteration_ms, abs=1e-5)
    assert plan.predicted.stage_memory_mb == pytest.approx([s.memory_mb for s in cost.stages], abs=1e-5)
    assert main(["explain", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["iteration_time_ms"] == pytest.approx(cost.iteration_ms, abs=1e-9)
