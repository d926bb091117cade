"""One capability table (``search/targets/capabilities.py``): a line is offered only for a target that runs it, and each
target's limits apply to that target only (issue 32, item 4); the one pre-flight applies the table torch-free, on
the plan's device, so validate refuses what launch refuses (item "validate accepts what launch refuses")."""

from __future__ import annotations

import json
import re

import pytest

from search.targets.capabilities import TABLE, Device, markdown, model_refusal, plan_refusal
from search.cli import main
from search.spec.cluster import parse_cluster
from search.spec.model import ModelSpec
from search.layers.moe_spec import MoESpec
from search.spec.plan import ParallelPlan, uniform_plan
from search.settings.plan_settings import FRAMEWORKS, PlanSettings
from search.settings.precision import LowPrecision
from search.spec.presets import load_model
from tests.conftest import ROOT

MOE = ModelSpec(name="tiny-moe", family="llama", num_layers=2, hidden_size=32, num_attention_heads=4,
                ffn_hidden_size=64, seq_length=16, vocab_size=128, activation="swiglu", normalization="rmsnorm",
                position_embedding="rope", add_bias_linear=False, tied_embeddings=False, params_dtype="fp32",
                moe=MoESpec(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32))
FP8_ARGS = ("--num-layers 2 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
            "--group-query-attention --num-query-groups 8 --seq-length 2048 --max-position-embeddings 2048 "
            "--position-embedding-type rope --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights "
            "--disable-bias-linear --attention-dropout 0 --hidden-dropout 0 --micro-batch-size 1 "
            "--global-batch-size 64 --bf16 --fp8-format hybrid --fp8-recipe tensorwise --tensor-model-parallel-size 2 "
            "--sequence-parallel --use-distributed-optimizer --tokenizer-type NullTokenizer --vocab-size 32000")


# GPT-OSS-20B (2 layers) with LatentMoE: the aceso runtime does not build it, Megatron-LM does (runtime_rules.latent_moe)
_OSS = load_model("gpt-oss-20b", num_layers=2)
LATENT = _OSS.model_copy(update={"name": "gpt-oss-20b-latent", "moe": _OSS.moe.model_copy(update={"moe_latent_size": 512})})


def moe_plan(tp=1, dp=2, ep=2, etp=1, moe=None, cluster="1x2-cpu", model=MOE) -> dict:
    st = {"num_gpus": tp * dp, "tp": tp, "dp": dp, "ep": ep, "etp": etp, "sequence_parallel": tp > 1,
          "start_unit": 0, "end_unit": model.num_units, "recompute": ["none"] * model.num_units}
    return {"model": model.model_dump(), "micro_batch_size": 2 * dp, "global_batch_size": 4 * dp, "stages": [st],
            "moe": moe, "cluster": parse_cluster(cluster).model_dump()}


def _run(argv, capsys) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_every_row_names_only_known_targets_and_scopes():
    for row in TABLE:
        assert row.scope in ("model", "precision", "plan") and set(row.refuse) <= set(FRAMEWORKS), row
    assert len({row.feature for row in TABLE}) == len(TABLE)


def test_the_docs_show_the_table():
    assert markdown() in (ROOT / "docs" / "search.md").read_text()


def test_a_target_megatron_lm_search_is_not_held_to_the_runtime(tmp_path, capsys):
    """LatentMoE (GPT-OSS-20B's experts behind a 512-wide latent): the aceso runtime does not build it
    (runtime_rules.latent_moe), Megatron-LM does. Before, a --target megatron-lm search asked the runtime's pre-flight
    and exited 2 naming the runtime."""
    out = tmp_path / "p.json"
    spec = tmp_path / "latent.json"
    spec.write_text(LATENT.model_dump_json())
    rc, _, err = _run(["search", "--model", str(spec), "--cluster", "1x8-h100",
                       "--global-batch-size", "64", "--target", "megatron-lm", "--budget-evals", "60",
                       "--workers", "1", "-o", str(out)], capsys)
    assert rc == 0, err
    assert json.loads(out.read_text())["settings"]["framework"] == "megatron-lm"
    rc, _, err = _run(["search", "--model", str(spec), "--cluster", "1x8-h100",
                       "--global-batch-size", "64", "--budget-evals", "60", "--workers", "1"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "moe.moe_latent_size" in err and "--target megatron-lm" in err, err


def test_a_runtime_limit_refuses_the_model_before_any_search():
    super_ = load_model("nemotron-3-super")   # LatentMoE
    assert "moe.moe_latent_size" in model_refusal("aceso", super_)
    assert model_refusal("megatron-lm", super_) is None
    # GPT-OSS's biased experts run on the runtime (patches/expert_bias_out_of_place)
    assert model_refusal("aceso", load_model("gpt-oss-20b", num_layers=2)) is None
    # aux-loss-free routing runs on the runtime (each stage's own groups: tests/distributed/test_expert_bias_plans.py)
    assert model_refusal("aceso", load_model("deepseek-v3", num_layers=4)) is None
    low = LowPrecision(recipe="fp8-tensorwise")
    assert "does not run low-precision recipes" in model_refusal("aceso", load_model("llama3-8b"), low)
    assert model_refusal("megatron-lm", load_model("llama3-8b"), low) is None
    assert "no T5 pretraining recipe" in model_refusal("megatron-bridge", load_model("t5-770m"))


def test_explain_offers_no_line_its_target_cannot_run(capsys):
    """An FP8 script: the aceso runtime runs no low-precision recipe, so no heterogeneous line is offered (before:
    "best heterogeneous plan (aceso runtime) ... faster", and the search it pointed to exited 2)."""
    rc, out, err = _run(["explain", "--megatron-args", FP8_ARGS, "--cluster", "1x8-h100", "--search-budget-evals",
                         "60", "--json"], capsys)
    assert rc == 0, err
    g = json.loads(out)["megatron_search"]
    assert "does not run low-precision recipes" in g["aceso"]["not_offered"] and "iteration_ms" not in g["aceso"]
    assert g["megatron"]["iteration_ms"] > 0 and "--precision fp8-tensorwise" in g["megatron"]["command"]
    rc, out, _ = _run(["explain", "--megatron-args", FP8_ARGS, "--cluster", "1x8-h100", "--search-budget-evals",
                       "60"], capsys)
    line = next(ln for ln in out.splitlines() if ln.startswith("best heterogeneous plan (aceso runtime):"))
    assert "not offered: settings.low_precision (fp8-tensorwise; aceso search --precision fp8-tensorwise)" in line


def test_the_search_report_says_why_a_line_is_not_offered(capsys):
    rc, out, err = _run(["search", "--model", "llama3-8b", "--num-layers", "2", "--cluster", "1x8-h100",
                         "--global-batch-size", "64", "--precision", "fp8-tensorwise", "--target", "megatron-lm",
                         "--budget-evals", "60", "--workers", "1"], capsys)
    assert rc == 0, err
    assert re.search(r"^heterogeneous plan +not offered: settings.low_precision \(fp8-tensorwise", out, re.M), out
    rc, out, _ = _run(["search", "--model", "llama3-8b", "--num-layers", "2", "--cluster", "1x8-h100",
                       "--global-batch-size", "64", "--precision", "fp8-tensorwise", "--target", "megatron-lm",
                       "--budget-evals", "60", "--workers", "1", "--json"], capsys)
    summary = json.loads(out)
    assert summary["lines"]["aceso"] is None and "low-precision" in summary["not_offered"]["aceso"]


def test_validate_refuses_expert_tp_with_alltoall_on_a_cpu_cluster(tmp_path, capsys):
    """megatron-core all-gathers uneven token counts over expert-TP under alltoall, which gloo cannot: launch --cpu's
    workers refused it 30 s in while validate said valid. Now the table's CPU rule answers for both."""
    p = tmp_path / "p.json"
    p.write_text(json.dumps(moe_plan(tp=2, dp=1, ep=1, etp=2)))
    rc, out, err = _run(["validate", str(p)], capsys)
    assert rc == 2 and err.count("\n") == 1 and "stages[0].etp (2) with the alltoall dispatcher on CPU" in err, err
    p.write_text(json.dumps(moe_plan(tp=2, dp=1, ep=1, etp=2, moe={"token_dispatcher": "allgather"})))
    assert _run(["validate", str(p)], capsys)[0] == 0
    p.write_text(json.dumps(moe_plan(tp=2, dp=1, ep=1, etp=2, cluster="1x2-h100")))    # a GPU plan: gloo not used
    assert _run(["validate", str(p)], capsys)[0] == 0


def test_the_table_applies_without_torch():
    """The planner's output check and validate applied the runtime's MoE / FSDP rules only through the runtime's
    torch-side pre-flight, skipped when torch is absent; the table applies them anyway."""
    from tests.unit.test_torch_free import run_blocked

    raw = json.dumps(moe_plan(moe={"token_dispatcher": "flex"}))
    r = run_blocked(f"""
        import json
        from search.io.errors import AcesoError
        from search.spec.plan import ParallelPlan
        from search.targets.preflight import preflight
        plan = ParallelPlan.model_validate(json.loads({raw!r}))
        try:
            preflight(plan, "cpu")
        except AcesoError as e:
            print("refused:", e)
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "refused: settings.moe.token_dispatcher flex: DeepEP/HybridEP need CUDA" in r.stdout, r.stdout


def test_each_target_is_held_to_its_own_rules():
    plan = uniform_plan(LATENT, 1, 1, 8, 8, 64, cluster=parse_cluster("1x8-h100"))
    assert "moe.moe_latent_size" in plan_refusal(plan, "aceso", Device.of("cuda"))
    assert plan_refusal(plan, "megatron-lm", Device.of("cuda")) is None
    mlm = plan.model_copy(update={"settings": PlanSettings(framework="megatron-lm")})
    assert plan_refusal(mlm, None, "cuda") is None                 # the plan's own target
    dense = uniform_plan(load_model("llama3-8b", num_layers=2), 1, 2, 4, 4, 64, cluster=parse_cluster("1x8-h100"))
    assert plan_refusal(dense, "aceso", "cuda") is None and plan_refusal(dense, "megatron-lm", "cuda") is None
    two = ParallelPlan.model_validate({**json.loads(dense.to_json()), "stages": [
        {"num_gpus": 4, "tp": 2, "dp": 2, "start_unit": 0, "end_unit": 3, "recompute": ["none"] * 3},
        {"num_gpus": 4, "tp": 1, "dp": 4, "start_unit": 3, "end_unit": 4, "recompute": ["none"]}]})
    assert plan_refusal(two, "aceso", "cuda") is None                # per-stage shapes, a mid-layer cut: the runtime
    assert "tp" in plan_refusal(two, "megatron-lm", "cuda")           # ... not Megatron-LM's one shape


def test_validate_checks_the_target_asked_for(tmp_path, capsys):
    plan = uniform_plan(LATENT, 1, 1, 8, 8, 64, cluster=parse_cluster("1x8-h100"))
    p = tmp_path / "p.json"
    p.write_text(plan.model_copy(update={"settings": PlanSettings(framework="megatron-lm")}).to_json())
    rc, out, err = _run(["validate", str(p)], capsys)
    assert rc == 0 and "target megatron-lm" in out, err
    rc, _, err = _run(["validate", str(p), "--target", "aceso"], capsys)
    assert rc == 2 and "moe.moe_latent_size" in err, err


@pytest.mark.parametrize("command", ["search", "baseline"])
def test_megatron_fsdp_on_is_searched_for_megatron_lm(command, tmp_path, capsys):
    """Before, every --megatron-fsdp on failed ("Megatron FSDP is searched for --target megatron-lm"): the setup
    built the space of the default target (aceso), and baseline had no --target."""
    out = tmp_path / "p.json"
    argv = [command, "--model", "llama3-8b", "--num-layers", "4", "--cluster", "1x8-h100", "--global-batch-size",
            "64", "--target", "megatron-lm", "--megatron-fsdp", "on", "-o", str(out)]
    rc, _, err = _run(argv + (["--budget-evals", "60", "--workers", "1"] if command == "search" else []), capsys)
    assert rc == 0, err
    plan = json.loads(out.read_text())
    assert plan["settings"]["megatron_fsdp"]["data_parallel_sharding_strategy"] in ("optim_grads", "optim_grads_params")
    assert plan["settings"]["framework"] == "megatron-lm" and len(plan["stages"]) == 1
    rc, _, err = _run([command, "--model", "llama3-8b", "--num-layers", "4", "--cluster", "1x8-h100",
                       "--global-batch-size", "64", "--megatron-fsdp", "on"], capsys)
    assert rc == 2 and "--megatron-fsdp on" in err and "--target megatron-lm" in err, err


def test_a_cpu_device_is_held_to_what_a_cpu_runs():
    assert Device.of("cpu") == Device(cuda=False, te=False) and Device.of("cuda") == Device(cuda=True, te=None)
    etp2 = ParallelPlan.model_validate(moe_plan(tp=2, dp=1, ep=1, etp=2))
    assert "with the alltoall dispatcher on CPU" in plan_refusal(etp2, "aceso", "cpu")
    assert plan_refusal(etp2, "aceso", "cuda") is None
    off = ParallelPlan.model_validate(moe_plan(tp=2, dp=1, ep=1, etp=2, moe={"grouped_gemm": False}))
    assert plan_refusal(off, "aceso", Device(cuda=True, te=False)) is None    # grouped GEMM off: nothing needs TE
    gg = ParallelPlan.model_validate(moe_plan(moe={"grouped_gemm": True}))
    assert "moe.grouped_gemm" in plan_refusal(gg, "aceso", Device(cuda=True, te=False))
    assert plan_refusal(gg, "aceso", "cuda") is None                          # TE unknown here: the GPU's to say


def test_the_search_says_what_it_could_not_check_without_the_runtime():
    """Without torch the search's output check still applies the table (an MoE model's rules) and says that the
    runtime's own checks (layer specs, megatron block) were not run, instead of skipping them silently."""
    from tests.unit.test_torch_free import run_blocked

    r = run_blocked("""
        from search.cli import main
        assert main(["search", "--model", "qwen3-30b-a3b", "--num-layers", "2", "--cluster", "1x8-h100",
                     "--global-batch-size", "64", "--budget-evals", "40", "--workers", "1", "--json"]) == 0
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "the runtime is not installed here" in r.stderr, r.stderr


def test_the_readme_search_plans_what_the_runtime_runs_on_its_gpus(tmp_path, capsys):
    """Issue 32: the README's first command returned an fp16 plan (the GPT presets' dtype) for the aceso runtime on
    H100s, whose engine refuses fp16 on a GPU (no loss scaling: ``training.engine.check_plan``), and validate and
    launch --dry-run called it valid. The search plans such a model in bf16 for the runtime, with a note; fp16
    plans are refused by the table on a GPU with bf16, as the runtime refuses them; Megatron-LM (which scales fp16
    losses) keeps fp16, its report's heterogeneous line is not offered; a V100 keeps fp16 (Aceso's dtype)."""
    small = ["--model", "gpt-1.3b", "--num-layers", "2", "--global-batch-size", "16", "--budget-evals", "50"]
    plan = tmp_path / "plan.json"
    rc, out, err = _run(["search", *small, "--cluster", "1x8-h100", "--json", "-o", str(plan)], capsys)
    assert rc == 0 and "gpt-1.3b is an fp16 model and the aceso runtime trains in bf16 on the h100" in err, err
    assert json.loads(plan.read_text())["model"]["params_dtype"] == "bf16"
    assert _run(["validate", str(plan), "--target", "aceso"], capsys)[0] == 0
    mlm = tmp_path / "mlm.json"
    rc, out, err = _run(["search", *small, "--cluster", "1x8-h100", "--target", "megatron-lm", "--json", "-o",
                         str(mlm)], capsys)
    assert rc == 0 and json.loads(mlm.read_text())["model"]["params_dtype"] == "fp16"
    assert "model.params_dtype fp16 (aceso search --precision fp16): the aceso runtime has no fp16 loss scaling" in json.loads(out)["not_offered"]["aceso"]
    rc, out, err = _run(["validate", str(mlm), "--target", "aceso"], capsys)
    assert rc == 2 and "model.params_dtype fp16 (aceso search --precision fp16): the aceso runtime has no fp16 loss scaling yet" in err
    assert _run(["validate", str(mlm)], capsys)[0] == 0          # its own target, Megatron-LM, runs it
    rc, out, err = _run(["search", *small, "--cluster", "1x8-h100", "--precision", "fp16", "-o", str(tmp_path / "x")],
                        capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and not (tmp_path / "x").exists()
    v100 = tmp_path / "v100.json"
    rc, out, err = _run(["search", *small, "--cluster", "1x8-v100", "--json", "-o", str(v100)], capsys)
    assert rc == 0 and json.loads(v100.read_text())["model"]["params_dtype"] == "fp16" and "note" not in err

