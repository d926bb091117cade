"""megatron-core's precision-aware optimizer (``--use-precision-aware-optimizer --main-params-dtype --exp-avg-dtype
--exp-avg-sq-dtype``): the state bytes per parameter as megatron-core and TE's FusedAdam allocate them (hand-computed
in each test from search/costmodel/optimizer_state.py's cited lines), the Megatron-LM import (read, not ignored;
megatron-core's asserts refused with one line, exit 2) and the exports (Megatron-LM flags, Bridge optimizer fields)
with the import -> export -> import round trip."""

import json
from pathlib import Path

import numpy as np
import pytest

from search.cli import main
from search.costmodel.optimizer_state import step_copy_bytes
from search.costmodel.plan_view import run_settings
from search.costmodel.types import Features
from search.megatron.importer import read_megatron
from search.megatron.names import bridge_fields
from search.pricing.plan_price import cost_model
from search.settings.optimizer_state import PrecisionAwareOptimizer as PA
from search.settings.plan_settings import target_settings
from search.spec.cluster import parse_cluster
from search.spec.presets import load_model
from search.spec.plan import load_plan
from search.spec.training import TrainingSpec

ROOT = Path(__file__).resolve().parents[2]
BASE = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 "
        "--micro-batch-size 1 --tokenizer-type NullTokenizer --vocab-size 999 --bf16 ")
FLAGS = "--use-distributed-optimizer --use-precision-aware-optimizer --main-params-dtype fp16 --exp-avg-dtype bf16 " \
        "--exp-avg-sq-dtype fp8"


def _stage(pa, dp=8):
    """gpt-1.3b on one stage of ``dp`` H100s, bf16, Megatron-LM's settings (fp32 gradients), distributed optimizer."""
    m, c = load_model("gpt-1.3b"), parse_cluster("1x8-h100")
    settings = target_settings("megatron-lm", precision="bf16").model_copy(
        update={"distributed_optimizer": True, "precision_aware_optimizer": pa})
    training = TrainingSpec(global_batch_size=8, micro_batch_sizes=[1], distributed_optimizer=True)
    cm = cost_model(m, c, training, settings)
    assert cm.settings == run_settings(settings, "bf16")
    st = cm.stage_cost(0, 1, 0, 0, m.num_units, 1, dp, np.zeros(m.num_units, np.int8), dp,
                       features=Features(distributed_optimizer=True))
    return cm, st.memory_breakdown


def test_state_bytes_per_parameter_hand_computed_with_dp_8():
    """bf16 weights, distributed optimizer over dp 8. Without the flag: fp32 master + m + v = 12 B / 8.
    fp32 dtypes: TE keeps only the master's 16 remainder bits (int16, store_param_remainders) + 4 + 4 = 10 B / 8.
    fp16 master, bf16 m, fp8 v: 2 + 2 + 1 = 5 B / 8."""
    _, plain = _stage(None)
    params = plain["params"] / 2                       # bf16 weights: 2 B each (MB)
    assert plain["optimizer"] == pytest.approx(12 * params / 8)
    _, fp32 = _stage(PA())
    assert fp32["optimizer"] == pytest.approx(10 * params / 8)
    _, low = _stage(PA(main_params_dtype="fp16", exp_avg_dtype="bf16", exp_avg_sq_dtype="fp8"))
    assert low["optimizer"] == pytest.approx(5 * params / 8)
    assert low["params"] == plain["params"] and low["grads"] == plain["grads"]    # weights, grad buffer unchanged


def test_step_transient_and_step_bytes_hand_computed():
    """The step's fp32 temporaries: FusedAdam unscales each non-fp32 state to fp32 (4 B each); the gradient is
    handed over as decoupled_grad (no fp32 copy). The step's HBM bytes: Megatron-LM bf16 with fp32 gradients is
    30 B per parameter (evaluate.OPT_BYTES_PER_PARAM + 2); the remainder master moves 6 instead of 8 (28); fp16
    master 40, bf16 m 24, fp8 v 22 instead of 8 each: 30 - 24 + 86 = 92."""
    assert step_copy_bytes(PA(), "bf16", grad_fp32=False) == 0.0
    assert step_copy_bytes(PA(main_params_dtype="fp16", exp_avg_dtype="bf16", exp_avg_sq_dtype="fp8"), "bf16",
                           grad_fp32=False) == 12.0
    # fp32 master kept by megatron-core under a non-delayed FP8 recipe: its fp32 gradient copy stays
    assert step_copy_bytes(PA(exp_avg_dtype="bf16"), "mxfp8", grad_fp32=False) == 4.0 + 4.0
    plain, _ = _stage(None)
    fp32, _ = _stage(PA())
    low, _ = _stage(PA(main_params_dtype="fp16", exp_avg_dtype="bf16", exp_avg_sq_dtype="fp8"))
    assert fp32._opt_ms_per_param / plain._opt_ms_per_param == pytest.approx(28 / 30)
    assert low._opt_ms_per_param / plain._opt_ms_per_param == pytest.approx(92 / 30)
    assert low._copy == 12.0 and plain._copy == 0.0     # fp32 gradients: no copy without the flag either


def test_import_reads_the_flags_and_does_not_ignore_them():
    imp = read_megatron(BASE + FLAGS, world_size=4)
    assert imp.plan.settings.precision_aware_optimizer == PA(main_params_dtype="fp16", exp_avg_dtype="bf16",
                                                             exp_avg_sq_dtype="fp8")
    assert imp.warning is None and imp.ignored == []
    assert read_megatron(BASE + "--use-distributed-optimizer", world_size=4).plan.settings.precision_aware_optimizer \
        is None


@pytest.mark.parametrize("extra, needle", [
    ("--use-precision-aware-optimizer", "needs distributed_optimizer"),
    ("--use-distributed-optimizer --exp-avg-dtype bf16",
     "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
    ("--use-distributed-optimizer --main-params-dtype fp16",
     "main_params_dtype can only be fp32 when not using precision-aware optimizer"),
    ("--use-precision-aware-optimizer --optimizer muon",
     "supports it only with adam"),
])
def test_what_megatron_core_asserts_exits_2_with_one_line(extra, needle, tmp_path, capsys):
    from tests.unit.test_megatron_import import assert_refused
    assert_refused(BASE + extra, needle, tmp_path, capsys)


def test_export_writes_the_flags_and_the_round_trip_holds(tmp_path, capsys):
    f, plan, args, back = (tmp_path / n for n in ("in.txt", "plan.json", "args.txt", "back.json"))
    f.write_text(BASE + FLAGS)
    assert main(["import", str(f), "--from", "megatron-lm", "--cluster", "1x4-h100", "-o", str(plan)]) == 0
    assert main(["export", str(plan), "--to", "megatron-lm", "--args-only", "-o", str(args)]) == 0
    line = args.read_text()
    assert ("--use-precision-aware-optimizer --main-params-dtype fp16 --exp-avg-dtype bf16 --exp-avg-sq-dtype fp8"
            in line), line
    assert main(["import", str(args), "--from", "megatron-lm", "--cluster", "1x4-h100", "-o", str(back)]) == 0
    assert "warning" not in capsys.readouterr().err
    a, b = load_plan(plan), load_plan(back)
    assert a.model_dump(exclude={"predicted"}) == b.model_dump(exclude={"predicted"})
    assert b.settings.precision_aware_optimizer.exp_avg_sq_dtype == "fp8"
    # Bridge: the optimizer fields megatron-core's OptimizerConfig has (Bridge v0.3.1's field list), torch dtypes
    imp = read_megatron(BASE + FLAGS, world_size=4)
    opt = bridge_fields(imp.config)["optimizer"]
    assert opt["use_precision_aware_optimizer"] is True
    assert opt["main_params_dtype"] == {"_target_": "torch.float16", "_call_": False}
    assert opt["exp_avg_dtype"] == {"_target_": "torch.bfloat16", "_call_": False}
    assert opt["exp_avg_sq_dtype"] == {"_target_": "torch.uint8", "_call_": False}     # Megatron-LM's fp8
    known = json.loads((ROOT / "search/megatron/data/bridge_fields_v0.3.1.json").read_text())["fields"]["optimizer"]
    assert set(opt) <= set(known)
    # without the flag the settings are written as before the field existed (digests unchanged)
    plain = read_megatron(BASE + "--use-distributed-optimizer", world_size=4).plan
    assert "precision_aware_optimizer" not in plain.model_dump_json()


def test_bridge_yaml_of_a_hybrid_plan_imports_back_with_the_dtypes(tmp_path):
    """Megatron-Bridge's YAML (the hybrid models' export, which imports back): the optimizer fields say the dtypes
    as torch dtype objects and read back as the plan's record."""
    from tests.hybrid_plans import cut_plan
    h8 = load_model("nemotron-h-8b")
    plan = cut_plan(h8, [0, 26, 52], 2, tp=2, dp=2, sp=True, gbs=32)
    pa = PA(main_params_dtype="fp16", exp_avg_dtype="bf16", exp_avg_sq_dtype="fp8")
    plan = plan.model_copy(update={"settings": plan.settings.model_copy(
        update={"distributed_optimizer": True, "precision_aware_optimizer": pa})})
    path, yaml, back = tmp_path / "plan.json", tmp_path / "o.yaml", tmp_path / "back.json"
    path.write_text(plan.to_json())
    assert main(["export", str(path), "--to", "megatron-bridge", "-o", str(yaml)]) == 0
    text = yaml.read_text()
    assert "  use_precision_aware_optimizer: true\n" in text
    assert "  exp_avg_sq_dtype: {_target_: torch.uint8, _call_: false}\n" in text, text
    assert main(["import", str(yaml), "--from", "megatron-bridge", "-o", str(back)]) == 0
    assert load_plan(str(back)).settings.precision_aware_optimizer == pa


def test_a_plan_file_breaking_megatron_cores_rule_is_refused_in_one_line(tmp_path, capsys):
    plan = read_megatron(BASE + "--use-distributed-optimizer --use-precision-aware-optimizer", world_size=4).plan
    d = json.loads(plan.to_json())
    d["settings"]["distributed_optimizer"] = False
    (tmp_path / "p.json").write_text(json.dumps(d))
    assert main(["validate", str(tmp_path / "p.json"), "--cluster", "1x4-h100"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "precision_aware_optimizer needs distributed_optimizer" in err, err


def test_the_runtime_preflight_refuses_what_it_would_not_run():
    """The runtime's OptimizerConfig (aceso_megatron/training/build_steps.py) sets no state dtype: a plan priced with
    the precision-aware optimizer is refused by the one pre-flight for the aceso runtime in one line, and runs on
    Megatron-LM (the export writes its flags)."""
    from search.targets.capabilities import plan_refusal
    from search.spec.plan import uniform_plan
    from search.spec.presets import load_model
    from search.settings.optimizer_state import PrecisionAwareOptimizer
    plan = uniform_plan(load_model("gpt-1.3b"), 1, 1, 8, 8, 64, distributed_optimizer=True,
                        precision_aware_optimizer=PrecisionAwareOptimizer(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"))
    why = plan_refusal(plan, "aceso")
    assert why is not None and "settings.precision_aware_optimizer" in why and "\n" not in why
    assert plan_refusal(plan, "megatron-lm") is None


@pytest.mark.parametrize("extra,needle", [
    (["--exp-avg-dtype", "bf16"], "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
    (["--use-precision-aware-optimizer", "--distributed-optimizer", "off"], "with --distributed-optimizer off"),
    (["--use-precision-aware-optimizer", "--optimizer", "muon"], "with --optimizer muon"),
    (["--use-precision-aware-optimizer", "--target", "aceso"], "the aceso runtime builds megatron-core's optimizer"),
])
def test_search_refuses_what_megatron_core_or_the_runtime_does_not_run(extra, needle, tmp_path, capsys):
    argv = ["search", "--model", "gpt-1.3b", "--cluster", "1x8-h100", "--global-batch-size", "64", "--budget-evals",
            "20", "--target", "megatron-lm", *extra, "-o", str(tmp_path / "p.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "p.json").exists()


def test_explain_keeps_the_optimizer_state_in_its_searches(tmp_path, capsys):
    """The optimizer state dtypes are numerics, kept as --optimizer is: ``explain --megatron-args`` searches under
    them (before, its drop-in plan dropped them: priced and exported with fp32 states), the printed command names
    them and returns exactly the saved plan."""
    import shlex
    script = tmp_path / "run.sh"
    script.write_text("torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers 8 --hidden-size 2048 "
                      "--num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 "
                      "--micro-batch-size 1 --global-batch-size 64 --vocab-size 32000 --tokenizer-type NullTokenizer "
                      "--bf16 --use-distributed-optimizer --use-precision-aware-optimizer --exp-avg-dtype bf16 "
                      "--exp-avg-sq-dtype bf16\n")
    best = tmp_path / "best.json"
    assert main(["explain", "--megatron-args-file", str(script), "--cluster", "1x8-h100", "--search-budget-evals",
                 "40", "--save-best", str(best)]) == 0
    out = capsys.readouterr().out
    cmd = next(line.strip() for line in out.splitlines() if line.strip().startswith("aceso search ")
               and "--target megatron-lm" in line)
    assert "--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16" in cmd, cmd
    saved = json.loads(best.read_text())
    assert saved["settings"]["precision_aware_optimizer"] == {"main_params_dtype": "fp32", "exp_avg_dtype": "bf16",
                                                             "exp_avg_sq_dtype": "bf16"}
    assert "best heterogeneous plan (aceso runtime): not offered: --use-precision-aware-optimizer" in out
    argv = shlex.split(cmd)[2:]
    argv[argv.index("-o") + 1] = str(tmp_path / "again.json")
    assert main(["search", *argv]) == 0
    assert json.loads((tmp_path / "again.json").read_text()) == saved


def test_search_with_it_searches_no_megatron_fsdp():
    """megatron-core runs the precision-aware optimizer with the distributed optimizer, not Megatron FSDP (and aceso
    does not price the pair: PlanSettings refuses it): the search turns the distributed optimizer on and FSDP off
    instead of searching it (before, --megatron-fsdp auto left FSDP plans in the space, whose settings a plan file
    could not hold)."""
    from search.cli.search_cmd import parse_args, training_from_args
    from search.spec.presets import load_model
    args = parse_args(["--model", "gpt-1.3b", "--cluster", "1x8-h100", "--global-batch-size", "64", "--target",
                       "megatron-lm", "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16"])
    training = training_from_args(args, load_model("gpt-1.3b"))
    assert training.distributed_optimizer is True and training.megatron_fsdp is False
    plain = training_from_args(parse_args(["--model", "gpt-1.3b", "--cluster", "1x8-h100", "--global-batch-size",
                                           "64", "--target", "megatron-lm"]), load_model("gpt-1.3b"))
    assert plain.megatron_fsdp is None              # searched without it, as before
