"""`aceso explain --megatron-args`: a Megatron-LM command line is priced exactly as the plan it imports to (as
Megatron-LM's training script runs it), plus what a short search on the same model and cluster gains."""

import json

import pytest

from search.cli import main
from search.spec.cluster import parse_cluster
from search.settings.plan_settings import target_settings
from search.pricing import cost_model
from search.megatron.importer import read_megatron
from search.spec.training import TrainingSpec

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
    cm = cost_model(plan.model, plan.cluster, training, target_settings("megatron-lm", precision="fp16"))
    assert abs(out["iteration_time_ms"] - cm.evaluate(plan).iteration_ms) < 1e-6
    gain = out["megatron_search"]
    assert gain["config_ms"] == out["iteration_time_ms"] and gain["budget_evals"] == 150
    assert abs(gain["megatron"]["speedup"] - gain["config_ms"] / gain["megatron"]["iteration_ms"]) < 1e-9
    assert "no fp16 loss scaling" in gain["aceso"]["not_offered"]      # an fp16 script: the runtime trains bf16
    # tp 4 with full recompute on 8 H100s for a 4-layer 1.3B model is far from the best Megatron-LM configuration
    assert gain["megatron"]["speedup"] > 1.2
    assert any("ignored 1 flag aceso does not price (the prediction is the run without it): --empty-unused-memory-level" in n for n in out["notes"])


def test_the_drop_in_plan_is_expressible_and_priced_as_megatron_lm_runs_it(tmp_path, capsys):
    from search.megatron import check_expressible
    from search.spec.plan import load_plan
    best = tmp_path / "best.json"
    assert main(["explain", "--megatron-args", ARGS, "--cluster", "1x8-h100", "--search-budget-evals", "100",
                 "--save-best", str(best), "--json"]) == 0
    g = json.loads(capsys.readouterr().out)["megatron_search"]
    drop_in = load_plan(str(best))
    assert check_expressible(drop_in) is None and drop_in.settings.framework == "megatron-lm"
    cm = cost_model(drop_in.model, drop_in.cluster, TrainingSpec(global_batch_size=64, precision="fp16"),
                    target_settings("megatron-lm", precision="fp16"))
    assert abs(g["megatron"]["iteration_ms"] - cm.evaluate(drop_in).iteration_ms) < 1e-6


def test_explain_table_prints_each_line_with_the_command_that_gives_it(capsys):
    assert main(["explain", "--megatron-args", ARGS, "--cluster", "1x8-h100", "--search-budget-evals", "100"]) == 0
    lines = capsys.readouterr().out.splitlines()
    mine = next(i for i, line in enumerate(lines) if line.startswith("your Megatron-LM configuration:"))
    assert lines[mine + 1].startswith("best Megatron-LM plan (drop-in):") and "x faster" in lines[mine + 1]
    assert lines[mine + 2] == ("  aceso search --model gpt-1.3b --num-layers 4 --cluster 1x8-h100 --global-batch-size "
                               "64 --target megatron-lm --budget-evals 100 -o plan.json")
    assert lines[mine + 3].startswith("best heterogeneous plan (aceso runtime): not offered: model.params_dtype fp16")
    assert main(["explain", "--megatron-args", ARGS.replace("--fp16", "--bf16"), "--cluster", "1x8-h100",
                 "--search-budget-evals", "100"]) == 0
    lines = capsys.readouterr().out.splitlines()
    het = next(i for i, line in enumerate(lines) if line.startswith("best heterogeneous plan (aceso runtime):"))
    # (no --precision: bf16 is the runtime's default for the fp16 preset)
    assert lines[het + 1] == ("  aceso search --model gpt-1.3b --num-layers 4 --cluster 1x8-h100 --global-batch-size "
                              "64 --budget-evals 100 -o plan.json")


def test_the_advice_under_the_lines_names_only_what_runs_the_offered_plans(tmp_path, capsys):
    """Under the lines explain says what to do with the plans: export the drop-in plan for its target, launch the
    heterogeneous one. It said "or aceso launch plan.json" also where no heterogeneous plan was offered (an fp16
    script; FP8 / MXFP8 ones), and `aceso launch` of the drop-in plan is refused there (the runtime's own check)."""
    best = tmp_path / "best.json"
    assert main(["explain", "--megatron-args", ARGS, "--cluster", "1x8-h100", "--search-budget-evals", "100",
                 "--save-best", str(best)]) == 0
    out = capsys.readouterr().out
    advice = next(line for line in out.splitlines() if line.startswith("  (each command returns"))
    assert "aceso export plan.json --to megatron-lm" in advice and "aceso launch" not in advice
    from search.io.errors import AcesoError
    from search.spec.plan import load_plan
    from search.targets.capabilities import RUNTIME
    from search.targets.preflight import planner_checks, target_device
    drop_in = load_plan(str(best))
    with pytest.raises(AcesoError, match="fp16"):     # the pre-flight aceso launch runs: the runtime refuses it
        planner_checks(drop_in, target_device(drop_in), RUNTIME)
    assert main(["explain", "--megatron-args", ARGS.replace("--fp16", "--bf16"), "--cluster", "1x8-h100",
                 "--search-budget-evals", "100"]) == 0
    advice = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  (each command returns"))
    assert advice.endswith("then aceso export plan.json --to megatron-lm, or aceso launch plan.json (the "
                           "heterogeneous plan))")


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


def test_the_search_space_holds_the_given_configuration_even_outside_its_defaults(capsys):
    """A per-rank micro-batch of 16 is outside the default candidates (1 2 4 8): the printed search command widens
    them (--micro-batch-sizes 1 2 4 8 16), so the uniform baseline (every uniform configuration, vpp 3 and selective
    recompute among them) holds the configuration and neither line is slower than it (fp16: the two framework
    pricings agree)."""
    line = ("--num-layers 12 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
            "--max-position-embeddings 1024 --micro-batch-size 16 --global-batch-size 256 --fp16 "
            "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 3 "
            "--recompute-activations --tokenizer-type NullTokenizer --vocab-size 51199")
    assert main(["explain", "--megatron-args", line, "--cluster", "1x8-a100", "--search-budget-evals", "60",
                 "--json"]) == 0
    g = json.loads(capsys.readouterr().out)["megatron_search"]
    assert "--micro-batch-sizes 1 2 4 8 16" in g["megatron"]["command"]
    assert g["megatron"]["speedup"] >= 1 - 1e-9, g["megatron"]
    assert "not_offered" in g["aceso"]          # fp16 on an A100: the runtime has no fp16 loss scaling


CUSTOM = ("--num-layers 2 --hidden-size 1024 --ffn-hidden-size 3584 --num-attention-heads 16 --group-query-attention "
          "--num-query-groups 4 --seq-length 2048 --max-position-embeddings 2048 --position-embedding-type rope "
          "--normalization RMSNorm --swiglu --untie-embeddings-and-output-weights --disable-bias-linear "
          "--micro-batch-size 1 --global-batch-size 64 --bf16 --tensor-model-parallel-size 2 --sequence-parallel "
          "--use-distributed-optimizer --tokenizer-type NullTokenizer --vocab-size 32000")


def _run_printed(command: str, out, capsys) -> dict:
    import shlex
    assert main(shlex.split(command)[1:] + ["-o", str(out)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    return json.loads(out.read_text())


def test_each_line_is_what_its_printed_command_returns_and_save_best_writes_it(tmp_path, capsys):
    """Issue 32: explain said 25920.4 ms for a drop-in plan its suggested search returned at 26375.3 (no memory
    headroom, runtime pricing, another budget and start). Now each line is the result of the command printed under
    it, run by the search's own function: the command writes byte for byte the plan --save-best writes (a model
    that is no preset travels as the spec file --save-best writes and the command names)."""
    best = tmp_path / "best.json"
    assert main(["explain", "--megatron-args", CUSTOM, "--cluster", "1x8-h100", "--search-budget-evals", "80",
                 "--save-best", str(best), "--json"]) == 0
    g = json.loads(capsys.readouterr().out)["megatron_search"]
    saved = {"megatron": best, "aceso": tmp_path / "best.aceso.json"}
    assert sorted(g["saved"]) == sorted(map(str, [*saved.values(), tmp_path / "best.model.json"]))
    for key in ("megatron", "aceso"):
        assert f"--model {tmp_path / 'best.model.json'}" in g[key]["command"]
        plan = _run_printed(g[key]["command"], tmp_path / f"{key}.json", capsys)
        assert (tmp_path / f"{key}.json").read_bytes() == saved[key].read_bytes()
        assert plan["predicted"]["iteration_time_ms"] == pytest.approx(g[key]["iteration_ms"], abs=1e-5)   # (the plan rounds it to 1 ns)
    assert "--target megatron-lm" in g["megatron"]["command"] and "--target" not in g["aceso"]["command"]


def test_a_preset_models_command_reproduces_the_line(tmp_path, capsys):
    assert main(["explain", "--megatron-args", ARGS, "--cluster", "1x8-h100", "--search-budget-evals", "80",
                 "--json"]) == 0
    g = json.loads(capsys.readouterr().out)["megatron_search"]
    assert "not_offered" in g["aceso"]          # fp16 on an H100: the runtime has no fp16 loss scaling
    for key in ("megatron",):
        assert g[key]["command"].startswith("aceso search --model gpt-1.3b --num-layers 4 ")
        plan = _run_printed(g[key]["command"], tmp_path / f"{key}.json", capsys)
        assert plan["predicted"]["iteration_time_ms"] == pytest.approx(g[key]["iteration_ms"], abs=1e-5)   # (the plan rounds it to 1 ns)


def test_save_best_is_checked_before_any_work(tmp_path, capsys):
    assert main(["explain", "--megatron-args", ARGS, "--cluster", "1x8-h100", "--save-best",
                 str(tmp_path / "no" / "such" / "dir" / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--save-best" in err
    assert main(["explain", "p.json", "--save-best", str(tmp_path / "x.json")]) == 2
    assert "--save-best is for --megatron-args" in capsys.readouterr().err


MOE = ("--num-layers 2 --hidden-size 512 --num-attention-heads 8 --ffn-hidden-size 1024 --seq-length 1024 "
       "--max-position-embeddings 1024 --position-embedding-type rope --normalization RMSNorm --swiglu "
       "--untie-embeddings-and-output-weights --disable-bias-linear --num-experts 8 --moe-router-topk 2 "
       "--moe-ffn-hidden-size 256 --expert-model-parallel-size 2 --moe-token-dispatcher-type allgather "
       "--moe-router-dtype fp32 --moe-grouped-gemm --tensor-model-parallel-size 2 --sequence-parallel "
       "--micro-batch-size 1 --global-batch-size 16 --bf16 --tokenizer-type NullTokenizer --vocab-size 31999")


def test_an_moe_configurations_settings_travel_in_the_printed_command(tmp_path, capsys):
    """Issue 32: the command explain printed for an MoE script searched under the alltoall dispatcher and the
    model's router dtype, whatever the script ran: its plans dropped the script's fp32 router (numerics) and its
    uniform baseline did not hold the configuration. Now the script's dispatcher is the first of --dispatcher (the
    one the search runs under) and its router dtype is --moe-router-dtype; running the printed command gives byte
    for byte the plan --save-best wrote, with the script's router dtype."""
    best = tmp_path / "best.json"
    assert main(["explain", "--megatron-args", MOE, "--cluster", "1x8-h100", "--search-budget-evals", "40",
                 "--save-best", str(best), "--json"]) == 0
    g = json.loads(capsys.readouterr().out)["megatron_search"]
    saved = {"megatron": best, "aceso": tmp_path / "best.aceso.json"}
    for key in ("megatron", "aceso"):
        assert "--dispatcher allgather alltoall flex --moe-router-dtype fp32" in g[key]["command"]
        plan = _run_printed(g[key]["command"], tmp_path / f"{key}.json", capsys)
        assert (tmp_path / f"{key}.json").read_bytes() == saved[key].read_bytes()
        assert plan["settings"]["moe"]["router_dtype"] == "fp32"
    # a host-bound MoE model: the drop-in plan's EP overlap and CUDA graphs make it the faster; the line says why
    assert g["aceso"]["iteration_ms"] > g["megatron"]["iteration_ms"]
    assert "the aceso runtime does not run it (settings.moe.overlap_ep_comm" in g["aceso"]["slower_than_drop_in"]
    assert main(["search", "--model", "gpt-1.3b", "--num-layers", "2", "--cluster", "1x8-h100", "--global-batch-size",
                 "16", "--moe-router-dtype", "fp32", "--budget-evals", "5", "-o", str(tmp_path / "d.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--moe-router-dtype: gpt-1.3b is a dense model" in err
    assert not (tmp_path / "d.json").exists()


def test_a_muon_script_is_searched_and_priced_with_muon(tmp_path, capsys):
    """Issue 32: explain priced a script's --optimizer muon but its search lines (and the plans they wrote) with
    Adam, the search's only optimizer; the drop-in plan then exported without --optimizer muon. Now the command
    carries --optimizer (the search prices it: costmodel/optimizers.py, hand-computed in test_stack_features.py),
    the drop-in plan records it and is priced by the plan evaluator as Muon, not Adam, and the aceso runtime's line
    is not offered (it runs Adam only); a --target aceso search with Muon is refused in one line."""
    from search.spec.plan import load_plan
    best = tmp_path / "best.json"
    muon = CUSTOM.replace("--use-distributed-optimizer ", "") + " --optimizer muon"   # (megatron-core: not both)
    assert main(["explain", "--megatron-args", muon, "--cluster", "1x8-h100",
                 "--search-budget-evals", "40", "--save-best", str(best), "--json"]) == 0
    g = json.loads(capsys.readouterr().out)["megatron_search"]
    assert "--optimizer muon --target megatron-lm" in g["megatron"]["command"]
    assert "the aceso runtime runs Adam only" in g["aceso"]["not_offered"]
    plan = _run_printed(g["megatron"]["command"], tmp_path / "m.json", capsys)
    assert (tmp_path / "m.json").read_bytes() == best.read_bytes() and plan["settings"]["optimizer"] == "muon"
    assert not plan["settings"].get("distributed_optimizer") and not plan["settings"].get("overlap_param_gather")
    p = load_plan(str(best))

    def priced(optimizer):
        tr = TrainingSpec(global_batch_size=64, precision="bf16", optimizer=optimizer,
                          distributed_optimizer=p.distributed_optimizer)
        settings = p.settings.model_copy(update={"optimizer": optimizer})
        return cost_model(p.model, p.cluster, tr, settings).evaluate(p)
    assert g["megatron"]["iteration_ms"] == pytest.approx(priced("muon").iteration_ms, rel=1e-9)
    assert priced("adam").stages[0].memory_breakdown["optimizer"] != priced("muon").stages[0].memory_breakdown[
        "optimizer"]
    assert main(["search", "--model", str(tmp_path / "best.model.json"), "--cluster", "1x8-h100",
                 "--global-batch-size", "64", "--optimizer", "muon", "--budget-evals", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--optimizer (muon): the aceso runtime runs Adam only" in err


def _published_router_dtypes() -> set:
    """The --moe-router-dtype of every MoE run NVIDIA published with its arguments (../shared/published/)."""
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[3] / "shared" / "published"
    if not root.is_dir():
        pytest.skip(f"the published runs are not at {root}")
    seen = set()
    for f in sorted(root.glob("megatron-bridge-*.json")):
        d = json.loads(f.read_text())
        for r in d["rows"] if isinstance(d, dict) else d:
            a = r.get("args")
            if r.get("moe") and a:
                t = (" ".join(a) if isinstance(a, list) else a).split()
                seen.add(t[t.index("--moe-router-dtype") + 1] if "--moe-router-dtype" in t else None)
    return seen


def test_an_moe_search_routes_in_fp32_as_nvidias_runs_unless_asked(tmp_path, capsys):
    """Every published MoE run routes in fp32 (and so does every Megatron-Bridge MoE recipe), while Megatron-LM's own
    default is the model's dtype: `aceso search` of an MoE model plans fp32 and its export says so; `--moe-router-dtype
    model` plans the model's dtype (no flag), a dense model gets no router dtype."""
    assert _published_router_dtypes() == {"fp32"}
    common = ["--cluster", "1x8-h100", "--global-batch-size", "16", "--budget-evals", "5"]
    for asked, want in ((None, "fp32"), ("model", None), ("fp64", "fp64")):
        out = tmp_path / f"{asked}.json"
        argv = ["search", "--model", "qwen3-30b-a3b", "--num-layers", "2", *common, "-o", str(out)]
        argv += ["--moe-router-dtype", asked] if asked else []
        assert main(argv) == 0, capsys.readouterr().err
        plan = json.loads(out.read_text())
        assert (plan["settings"]["moe"] or {}).get("router_dtype") == want
        assert main(["export", str(out), "--to", "megatron-lm", "-o", str(tmp_path / f"{asked}.sh")]) == 0
        script = (tmp_path / f"{asked}.sh").read_text()
        assert (f"--moe-router-dtype {want}" in script) == (want is not None)
        assert ("--moe-router-dtype" in script) == (want is not None)
    dense = tmp_path / "dense.json"
    assert main(["search", "--model", "gpt-1.3b", "--num-layers", "2", *common, "-o", str(dense)]) == 0
    assert json.loads(dense.read_text())["settings"].get("moe") is None


def test_explain_under_a_framework_that_does_not_run_the_plan_says_so(tmp_path, capsys):
    """``explain --framework megatron-bridge`` of a Nemotron-H plan with virtual pipeline stages prices it, and says
    that Megatron-Bridge does not run it in the words of the one pre-flight (``aceso validate --target
    megatron-bridge`` of the same plan: the reference); a plan it runs gets no such note. Before, the price came with
    no word that Bridge's hybrid provider asserts no VPP (the export and validate refuse the plan)."""
    from search.spec.cluster import parse_cluster
    from search.spec.plan import uniform_plan
    from search.spec.presets import load_model

    model = load_model("nemotron-h-8b")
    notes = {}
    for vpp in (2, 1):
        plan = uniform_plan(model, 2, 1, 4, 4, 64, cluster=parse_cluster("1x8-h100"), num_virtual_stages=vpp,
                            distributed_optimizer=True, framework="megatron-lm")
        path = tmp_path / f"vpp{vpp}.json"
        path.write_text(plan.to_json())
        rc_v = main(["validate", str(path), "--target", "megatron-bridge"])
        err = capsys.readouterr().err
        refusal = err.strip().split(": error: ", 1)[-1].split(": ", 1)[-1] if rc_v else None
        rc_e = main(["explain", str(path), "--framework", "megatron-bridge", "--json"])
        out, err = capsys.readouterr()
        assert rc_e == 0, err
        got = json.loads(out)
        notes[vpp] = [n for n in got["notes"] if n.startswith("--framework")]
        if vpp == 2:
            assert rc_v == 2 and len(notes[2]) == 1 and refusal in notes[2][0], (refusal, notes)
        else:
            assert rc_v == 0 and notes[1] == [], notes
