"""``--memory-headroom``: one budget (``memory.memory_budget_mb`` / ``headroom_verdict``) shared by search, validate
and explain; a plan inside the headroom is flagged (validate: exit 2, one line; explain: said, exit 0), not taken
by search (bad values: tests/unit/test_bad_inputs.py). And Megatron-LM's theoretical memory formula (transcribed in bench/megatron_memory.py) against ours
where its simplifications do not apply (docs/costmodel.md, Memory)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from search.cli import main
from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.costmodel.plan_view import run_settings
from search.settings.plan_settings import target_settings
from search.costmodel.memory import DEFAULT_HEADROOM, MB, headroom_verdict, memory_budget_mb
from search.spec.model import ModelSpec
from search.spec.plan import uniform_plan
from search.spec.presets import load_model
from search.spec.training import TrainingSpec
from tests.conftest import ROOT


def test_budget_and_verdict_by_hand():
    assert memory_budget_mb(81920, 0.03) == pytest.approx(79462.4)
    assert headroom_verdict(79000, 81920, 0.03) is None
    inside = headroom_verdict(80000, 81920, 0.03)
    assert "fits the 81920 MiB but not the 3% --memory-headroom (budget 79462 MiB)" in inside
    assert "over the 81920 MiB" in headroom_verdict(82000, 81920, 0.03)
    assert headroom_verdict(81920, 81920, 0.0) is None
    assert 0 < DEFAULT_HEADROOM < 0.1


def _plan_between(tmp_path):
    """A plan whose peak fits a memory limit but not the default headroom of it, as a file."""
    model = load_model("gpt-1.3b").model_copy(update={"params_dtype": "bf16"})   # (the runtime: no fp16 on H100s)
    plan = uniform_plan(model, num_stages=2, tp=2, dp=2, micro_batch_size=4, global_batch_size=64,
                        cluster=parse_cluster("1x8-h100"))
    cm = make_cost_model(plan.model, plan.cluster, TrainingSpec(global_batch_size=64, micro_batch_sizes=[4],
                                                                precision="bf16"))
    peak = cm.evaluate(plan).max_memory_mb
    path = tmp_path / "p.json"
    path.write_text(plan.to_json())
    return path, peak, round(peak / (1 - DEFAULT_HEADROOM / 2), 1)    # the limit: peak uses half the headroom


def test_validate_flags_a_plan_inside_the_headroom(tmp_path, capsys):
    path, _, limit = _plan_between(tmp_path)
    assert main(["validate", str(path), "--memory-limit-mib", f"{limit:.1f}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--memory-headroom" in err[0] and "Traceback" not in err[0]
    assert main(["validate", str(path), "--memory-limit-mib", f"{limit:.1f}", "--memory-headroom", "0"]) == 0


def test_explain_says_so_and_search_does_not_take_it(tmp_path, capsys):
    path, peak, limit = _plan_between(tmp_path)
    assert main(["explain", str(path), "--memory-limit-mib", f"{limit:.1f}", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and not out["within_headroom"]
    assert any("--memory-headroom" in w for w in out["warnings"])
    assert out["memory_budget_mib"] == pytest.approx(limit * (1 - DEFAULT_HEADROOM))
    plan_out = tmp_path / "s.json"
    assert main(["search", "--model", "gpt-1.3b", "--cluster", "1x8-h100", "--global-batch-size", "64",
                 "--memory-limit-mib", f"{limit:.1f}", "--budget-evals", "200", "--json", "-o", str(plan_out)]) == 0
    capsys.readouterr()
    assert main(["explain", str(plan_out), "--memory-limit-mib", f"{limit:.1f}", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["within_headroom"] and found["max_memory_mib"] <= limit * (1 - DEFAULT_HEADROOM) + 1e-6


# ----- Megatron-LM's formula, where its assumptions hold ----------------------------------------------------------
def _theory():
    spec = importlib.util.spec_from_file_location("megatron_memory_bench", ROOT / "bench" / "megatron_memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.theoretical_memory


LLAMA = ModelSpec(name="l", family="llama", num_layers=8, hidden_size=1024, num_attention_heads=16,
                  num_query_groups=4, ffn_hidden_size=2816, seq_length=2048, vocab_size=32000, activation="swiglu",
                  normalization="rmsnorm", position_embedding="rope", tied_embeddings=False, add_bias_linear=False,
                  params_dtype="bf16")


@pytest.mark.parametrize("dist,dp", [(False, 1), (True, 4)])
def test_weights_and_optimizer_equal_megatron_lm_formula_where_it_is_exact(dist, dp):
    """No biases, no learned positions, pp 1, tp 1, fp32 gradients: Megatron-LM's formula counts every parameter
    (its 18 or 6 + 12/d bytes); ours must give the same weight + gradient + optimizer bytes."""
    plan = uniform_plan(LLAMA, num_stages=1, tp=1, dp=dp, micro_batch_size=dp, global_batch_size=8 * dp,
                        cluster=parse_cluster(f"1x{dp}-h100"), distributed_optimizer=dist)
    cm = make_cost_model(LLAMA, plan.cluster, TrainingSpec(global_batch_size=8 * dp, micro_batch_sizes=[dp],
                                                           precision="bf16"),
                         settings=run_settings(target_settings("megatron-lm", precision="bf16"), "bf16"))
    b = cm.evaluate(plan).stages[0].memory_breakdown
    ours = (b["params"] + b["grads"] + b["optimizer"]) * MB
    theirs = _theory()(LLAMA, 1, 1, dp, None, 1, 8, dist, False, "none")["weight_optimizer_gb"] * 2 ** 30
    assert ours == pytest.approx(theirs, rel=1e-12)
    assert LLAMA.num_parameters * (18 if not dist else 6 + 12 / dp) == pytest.approx(theirs, rel=1e-12)


def test_megatron_lm_formula_simplifies_what_we_count():
    """Where it simplifies (docs/costmodel.md): it drops biases and learned position embeddings, so for a GPT
    with both it counts fewer parameters than the model has; it divides the optimizer by dp, not dp x cp."""
    gpt = load_model("gpt-1.3b")
    th = _theory()(gpt, 1, 1, 1, None, 1, 8, False, False, "none")["weight_optimizer_gb"] * 2 ** 30 / 18
    assert th < gpt.num_parameters
    missing = gpt.num_parameters - th
    biases = gpt.num_layers * (3 * gpt.hidden_size + gpt.hidden_size + 4 * gpt.hidden_size + gpt.hidden_size)
    assert missing == pytest.approx(biases + gpt.seq_length * gpt.hidden_size, rel=1e-9)


# ----- published runs fit under their own settings ----------------------------------------------------------------
def _bench():
    spec = importlib.util.spec_from_file_location("megatron_memory_bench2", ROOT / "bench" / "megatron_memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_fully_specified_published_bf16_run_fits_with_the_headroom():
    """Runs that ran must fit: every fully specified bf16 row of bench/data/published_runs.json (and the shared
    Megatron-Bridge file's bf16 rows, where present), priced under its own settings, keeps the default headroom
    free on every rank (the FP8 / MXFP8 rows, priced with their recipe, only have to fit the GPU: asserted in
    tests/unit/test_precision.py)."""
    mm = _bench()
    rows = [r for r in mm.memory_rows(build=False) if "skipped" not in r and r["precision"] == "bf16"]
    assert len({r["id"] for r in rows}) >= 20
    over = [(r["id"], r["rank"], round(r["total_gb"], 1)) for r in rows
            if r["total_gb"] > memory_budget_mb(r["limit_gb"], DEFAULT_HEADROOM)]
    assert over == []
