"""One pricing everywhere: the settings a plan was priced under travel with it (search -> plan -> export -> import ->
explain), and Megatron-LM's gradient-reduction rule is mirrored (core_v0.16.1 ``validate_args``)."""

from __future__ import annotations

import importlib.util
import json
import shlex
from pathlib import Path

import pytest
import yaml

from search.cli import main
from search.megatron.importer import read_megatron
from search.spec.plan import load_plan
from search.spec.plan import ParallelPlan
from search.costmodel.plan_view import run_settings
from search.settings.plan_settings import PlanSettings, target_settings

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("megatron_parity", ROOT / "bench" / "megatron_parity.py")
parity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(parity)

BASE = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 512 --max-position-embeddings 512 "
        "--micro-batch-size 1 --tokenizer-type NullTokenizer --vocab-size 1023 ")
SMALL = "--model gpt-1.3b --num-layers 4 --cluster 1x8-h100 --global-batch-size 16 --budget-evals 60 --workers 1"


# Megatron-LM core_v0.16.1 megatron/training/arguments.py, validate_args (lines 712-724 at 55ac708):
#   if args.bf16: ... if args.grad_reduce_in_bf16: accumulate_allreduce_grads_in_fp32 = False
#                     elif not accumulate_allreduce_grads_in_fp32 and main_grads_dtype == fp32: ... = True
# fp16 / fp32: --accumulate-allreduce-grads-in-fp32 as given (default off).
@pytest.mark.parametrize("flags,fp32", [
    ("--bf16", True),
    ("--bf16 --grad-reduce-in-bf16", False),
    ("--bf16 --accumulate-allreduce-grads-in-fp32", True),
    ("--bf16 --accumulate-allreduce-grads-in-fp32 --grad-reduce-in-bf16", False),   # bf16 reduction wins
    ("--bf16 --main-grads-dtype bf16", False),
    ("--fp16", False),
    ("--fp16 --accumulate-allreduce-grads-in-fp32", True),
    ("--fp16 --grad-reduce-in-bf16", False),                                          # bf16 branch only
    ("", False),
])
def test_import_mirrors_megatron_lm_gradient_reduction_rule(flags, fp32):
    plan = read_megatron(BASE + flags, world_size=1).plan
    assert plan.settings == PlanSettings(framework="megatron-lm", grad_reduce_in_fp32=fp32)


def test_plans_without_settings_are_runtime_plans_and_fp32_training_ignores_the_flag():
    plan = read_megatron(BASE + "--bf16", world_size=1).plan
    raw = plan.model_dump(exclude={"settings"})
    raw["schema_version"] = 3                          # a v3 plan without settings (written before the field)
    old = ParallelPlan.model_validate(raw)
    assert old.settings == PlanSettings() and target_settings("megatron-lm", old.settings, "bf16").grad_reduce_in_fp32
    assert target_settings(None, plan.settings) is plan.settings
    assert target_settings("megatron-lm", plan.settings) is plan.settings
    assert target_settings("runtime", plan.settings, "bf16") == PlanSettings()
    assert not run_settings(PlanSettings(grad_reduce_in_fp32=True), "fp32").grad_reduce_in_fp32


def _search(tmp_path, capsys, *extra, name="p.json"):
    out = tmp_path / name
    assert main(["search", *SMALL.split(), "--precision", "bf16", *extra, "--json", "-o", str(out)]) == 0
    capsys.readouterr()
    return out


def _args(tmp_path, capsys, path, to="megatron-lm"):
    assert main(["export", str(path), "--to", to, "--args-only"]) == 0
    return shlex.split(capsys.readouterr().out)


def _who(path) -> tuple[str, bool]:
    """Who runs the searched plan and its gradient reduction dtype (its other settings are the searched switches)."""
    s = load_plan(path).settings
    return s.framework, s.grad_reduce_in_fp32


def test_target_megatron_lm_prices_fp32_reduction_by_default_and_the_export_says_what_was_priced(tmp_path, capsys):
    dflt = _search(tmp_path, capsys, "--target", "megatron-lm")
    bf16 = _search(tmp_path, capsys, "--target", "megatron-lm", "--grad-reduce-in-bf16", name="b.json")
    aceso = _search(tmp_path, capsys, name="a.json")
    assert _who(dflt) == ("megatron-lm", True)
    assert _who(bf16) == ("megatron-lm", False)
    assert _who(aceso) == ("runtime", False)
    assert "--grad-reduce-in-bf16" not in _args(tmp_path, capsys, dflt)
    assert "--grad-reduce-in-bf16" in _args(tmp_path, capsys, bf16)
    assert "--grad-reduce-in-bf16" in _args(tmp_path, capsys, aceso)     # priced with bf16 reduction: says so
    kv = dict(w.split("=", 1) for w in _args(tmp_path, capsys, bf16, "megatron-bridge")[2:])
    assert kv["ddp.grad_reduce_in_fp32"] == "false"


def test_bridge_target_writes_the_gradient_dtype_bridge_then_runs(tmp_path, capsys):
    for extra, want in (((), True), (("--grad-reduce-in-bf16",), False)):
        path = _search(tmp_path, capsys, "--target", "megatron-bridge", *extra)
        assert _who(path) == ("megatron-bridge", want)
        assert main(["export", str(path), "--to", "megatron-bridge"]) == 0
        y = yaml.safe_load(capsys.readouterr().out)
        assert y["ddp"]["grad_reduce_in_fp32"] is want
        assert parity.bridge_grad_fp32(y, False) is want     # gpt recipe: its mixed_precision object says it


def test_explain_prices_a_plan_under_its_own_settings_unless_framework_says_otherwise(tmp_path, capsys):
    path = _search(tmp_path, capsys, "--target", "megatron-lm")
    pred = load_plan(path).predicted

    def explain(*extra):
        assert main(["explain", str(path), "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)
    own, mlm, rt = explain(), explain("--framework", "megatron-lm"), explain("--framework", "runtime")
    assert own["max_memory_mib"] == pytest.approx(max(pred.stage_memory_mb), rel=1e-6) == mlm["max_memory_mib"]
    assert own["settings"]["grad_reduce_in_fp32"] and not rt["settings"]["grad_reduce_in_fp32"]
    assert rt["max_memory_mib"] != pytest.approx(own["max_memory_mib"], rel=1e-3)   # bf16 gradients: another size
    assert main(["validate", str(path), "--json"]) == 0
    assert max(json.loads(capsys.readouterr().out)["stage_memory_mib"]) == pytest.approx(own["max_memory_mib"], abs=0.1)


@pytest.mark.parametrize("extra", [(), ("--target", "megatron-lm", "--precision", "fp16")])
def test_grad_reduce_in_bf16_needs_a_megatron_target_and_bf16(extra, tmp_path, capsys):
    out = tmp_path / "p.json"
    args = ["search", *SMALL.split(), *extra, "--grad-reduce-in-bf16", "-o", str(out)]
    if "--precision" not in extra:
        args += ["--precision", "bf16"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--grad-reduce-in-bf16" in err and not out.exists()


def test_bridge_target_refuses_t5_before_searching(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["search", "--model", "t5-770m", "--num-layers", "2", "--cluster", "1x8-h100", "--global-batch-size",
                 "16", "--target", "megatron-bridge", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no T5 pretraining recipe" in err and not out.exists()


@pytest.mark.parametrize("problem,target", parity.QUICK)
def test_search_equals_export_import_explain_of_the_script(problem, target, tmp_path):
    row = parity.run_case(problem, target, tmp_path, budget=80)
    assert row["rel_diff"] <= parity.TOLERANCE, row
    assert row["settings_agree"], row
