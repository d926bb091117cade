"""`aceso export --to megatron-lm | megatron-bridge`: the script bash really runs (for each Megatron-LM release), the
argument forms Megatron-LM documents, refusals with exit 2 and nothing written, and the documented flag table."""

import os
import shlex
import shutil
import stat
import subprocess

import pytest
import yaml

from search.cli import main
from search.megatron import megatron_config
from search.megatron.names import TABLE, mapping_table
from search.settings.plan_settings import PlanSettings
from search.megatron.script import argv
from search.megatron.versions import release
from search.spec.plan import ParallelPlan, load_plan, uniform_plan
from search.spec.presets import load_model
from tests.conftest import ROOT
from tests.megatron_plans import CASES, case_config, case_plan


def _write(tmp_path, plan: ParallelPlan, name="plan.json"):
    path = tmp_path / name
    path.write_text(plan.to_json())
    return path


def _export(tmp_path, capsys, plan, *extra):
    path = _write(tmp_path, plan)
    assert main(["export", str(path), *extra]) == 0
    return capsys.readouterr().out


# where each release keeps the entry points (git ls-tree of NVIDIA/Megatron-LM at each tag)
ENTRY = {"0.16": {"gpt": "pretrain_gpt.py", "t5": "pretrain_t5.py"},
         "0.17": {"gpt": "pretrain_gpt.py", "t5": "pretrain_t5.py"},
         "0.18": {"gpt": "pretrain_gpt.py", "t5": "examples/t5/pretrain_t5.py"},
         "0.19": {"gpt": "pretrain_gpt.py", "t5": "examples/t5/pretrain_t5.py"}}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("version", sorted(ENTRY))
@pytest.mark.parametrize("name", ["gpt-pp4-layout-block1", "llama-pp4-vpp2-first-last", "t5-selective-sp"])
def test_script_runs_torchrun_with_exactly_the_plan_arguments(name, version, tmp_path):
    """A stub torchrun on PATH records what bash hands it: the world size, the release's entry point and every plan
    argument, in order."""
    plan = case_plan(name)
    script = tmp_path / "run.sh"
    assert main(["export", str(_write(tmp_path, plan)), "--megatron-version", version, "-o", str(script)]) == 0
    assert os.stat(script).st_mode & stat.S_IXUSR
    stub = tmp_path / "bin" / "torchrun"
    stub.parent.mkdir()
    stub.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$OUT"\nenv > "$OUT.env"\n')
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK",
                                                             "TOKENIZER_ARGS", "DATA_ARGS", "TRAINING_ARGS")}
    env.update(PATH=f"{stub.parent}:{os.environ['PATH']}", OUT=str(tmp_path / "argv"), MEGATRON_LM="/opt/Megatron-LM")
    r = subprocess.run(["bash", str(script), "--seed", "7"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = (tmp_path / "argv").read_text().splitlines()
    cl = plan.cluster
    assert got[:10] == ["--nproc-per-node", str(cl.gpus_per_node), "--nnodes", str(cl.num_nodes), "--node-rank", "0",
                        "--master-addr", "localhost", "--master-port", "6000"]
    assert got[10] == f"/opt/Megatron-LM/{ENTRY[version]['t5' if plan.model.is_t5 else 'gpt']}"
    rest = got[11:]
    plan_args = argv(megatron_config(plan), release(version))
    assert rest[:len(plan_args)] == plan_args
    assert rest[-2:] == ["--seed", "7"]
    assert ("--mock-data" in rest) == (not plan.model.is_t5)
    tp_cp = megatron_config(plan).tp * megatron_config(plan).cp
    assert ("CUDA_DEVICE_MAX_CONNECTIONS=1" in (tmp_path / "argv.env").read_text()) == (tp_cp > 1)


def test_header_names_version_model_cluster_prediction_and_the_micro_batch_conversion(tmp_path, capsys):
    plan = case_plan("llama-pp4-tp-comm-overlap")
    text = _export(tmp_path, capsys, plan)                                       # --to megatron-lm, the default
    head = [line for line in text.splitlines() if line.startswith("#")]
    assert "# Arguments of Megatron-LM core_v0.19.0 (megatron/training/arguments.py, megatron-core 0.19.x)" in text
    old = _export(tmp_path, capsys, plan, "--megatron-version", "0.16")
    assert "# Arguments of Megatron-LM core_v0.16.1 (megatron/training/arguments.py, megatron-core 0.16.x)" in old
    assert any(line.startswith("# model: llama3-8b (Llama, 8 layers") for line in head)
    assert any(line.startswith("# cluster: 1x8-h100, 8 GPUs = pp 4 x tp 2 x cp 1 x dp 1") for line in head)
    pred = plan.predicted
    assert any(f"{pred.iteration_time_ms:.1f} ms per iteration" in line and "flash attention" in line for line in head)
    assert "# micro-batch: the plan's pipeline micro-batch 1 = --micro-batch-size 1 per rank x dp 1" in text
    # NullTokenizer: --vocab-size V from 0.18 (the EOD token its last id), V - 1 before (it adds the EOD token)
    assert "TOKENIZER_ARGS=(${TOKENIZER_ARGS:---tokenizer-type NullTokenizer --vocab-size 128256})" in text
    assert "TOKENIZER_ARGS=(${TOKENIZER_ARGS:---tokenizer-type NullTokenizer --vocab-size 128255})" in old


def test_micro_batch_per_rank_is_the_pipeline_micro_batch_over_dp(tmp_path, capsys):
    plan = uniform_plan(load_model("gpt-1.3b", num_layers=4), 2, 1, 4, micro_batch_size=8, global_batch_size=64)
    words = shlex.split(_export(tmp_path, capsys, plan, "--to", "megatron-lm", "--args-only"))
    assert words[words.index("--micro-batch-size") + 1] == "2"          # 8 samples / dp 4
    assert words[words.index("--global-batch-size") + 1] == "64"


@pytest.mark.parametrize("chunks,pp,vpp,expect", [
    ((4, 4), 2, 1, []),
    ((2, 2, 2, 2), 2, 2, ["--num-virtual-stages-per-pipeline-rank", "2"]),
    ((3, 5), 2, 1, ["--decoder-first-pipeline-num-layers", "3"]),
    ((2, 3, 3), 3, 1, ["--decoder-first-pipeline-num-layers", "2"]),
    ((3, 3, 2), 3, 1, ["--decoder-last-pipeline-num-layers", "2"]),
    ((1, 3, 3, 1), 4, 1, ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1"]),
    ((1, 3, 2, 2), 4, 1, ["--pipeline-model-parallel-layout", "Et|t*3|t*2|t*2L"]),
    ((2, 1, 1, 2, 1, 1), 2, 3, ["--pipeline-model-parallel-layout", "Et*2|t|t|t*2|t|tL"]),
])
def test_layer_split_uses_the_simplest_megatron_form(chunks, pp, vpp, expect, tmp_path, capsys):
    c = case_config("gpt-pp1-dp8")
    from dataclasses import replace
    c = replace(c, chunk_layers=chunks, pp=pp, vpp=vpp, dp=8 // pp, global_batch_size=48)
    from search.megatron.build import plan_from_config
    words = shlex.split(_export(tmp_path, capsys, plan_from_config(c), "--to", "megatron-lm", "--args-only"))
    forms = ("--num-virtual-stages-per-pipeline-rank", "--decoder-first-pipeline-num-layers",
             "--decoder-last-pipeline-num-layers", "--pipeline-model-parallel-layout")
    got = [w for i, w in enumerate(words) if w in forms or (i and words[i - 1] in forms)]
    assert got == expect


def _unit_cut(d):
    d["stages"][0]["chunks"][0].update(end_unit=7, recompute=["none"] * 7)
    d["stages"][1]["chunks"][0].update(start_unit=7, recompute=["none"] * 9)


def _hetero(d):
    d["stages"][1].update(tp=1, dp=4)


def _recompute(d):
    d["stages"][0]["chunks"][0]["recompute"] = ["full", "none"] * 4


@pytest.mark.parametrize("edit,field", [(_hetero, "stages[1].tp"), (_unit_cut, "stages[1].start_unit"),
                                        (_recompute, "stages[0].recompute[0:2]")])
@pytest.mark.parametrize("to", ["megatron-lm", "megatron-bridge"])
def test_inexpressible_plan_exits_2_with_one_line_and_writes_nothing(edit, field, to, tmp_path, capsys):
    d = case_plan("gpt-pp2-selective").model_dump()
    edit(d)
    path = _write(tmp_path, ParallelPlan.model_validate(d))
    out = tmp_path / "run.sh"
    assert main(["export", str(path), "--to", to, "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err and "--target megatron-lm" in err
    assert not out.exists() and not list(tmp_path.glob(".run.sh*"))


def test_bridge_yaml_sets_every_plan_field_on_the_gelu_or_llama_recipe(tmp_path, capsys):
    plan = case_plan("llama-pp2-vpp2-layout-selective")
    text = _export(tmp_path, capsys, plan, "--to", "megatron-bridge")
    assert "megatron.bridge.recipes.llama3_8b_pretrain_config" in text and "v0.3.1" in text
    y = yaml.safe_load(text)
    m = y["model"]
    assert (m["tensor_model_parallel_size"], m["pipeline_model_parallel_size"], m["context_parallel_size"]) == (2, 2, 1)
    assert m["virtual_pipeline_model_parallel_size"] == 2 and m["pipeline_model_parallel_layout"] == "Et*2|t|t*3|t*2L"
    assert (m["recompute_granularity"], m["recompute_modules"], m["recompute_method"]) == ("selective",
                                                                                           ["core_attn"], None)
    assert m["vocab_size"] == plan.model.padded_vocab_size and m["num_query_groups"] == 8
    assert y["train"] == {"micro_batch_size": 1, "global_batch_size": 64}
    assert y["ddp"] == {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "overlap_param_gather": False,
                        "grad_reduce_in_fp32": False}     # a runtime-priced plan: bf16 reduction, as priced
    mp = y["mixed_precision"]                              # bf16_mixed would reduce in fp32: an object instead
    assert mp["_target_"].endswith("MixedPrecisionConfig") and mp["grad_reduce_in_fp32"] is False and mp["bf16"]
    assert mp["params_dtype"] == {"_target_": "torch.bfloat16", "_call_": False}
    fp32 = plan.model_copy(update={"settings": PlanSettings(framework="megatron-bridge", grad_reduce_in_fp32=True)})
    y = yaml.safe_load(_export(tmp_path, capsys, fp32, "--to", "megatron-bridge"))
    assert y["ddp"]["grad_reduce_in_fp32"] is True and "mixed_precision" not in y   # bf16_mixed: the default
    gpt = yaml.safe_load(_export(tmp_path, capsys, case_plan("gpt-pp2-selective"), "--to", "megatron-bridge"))
    assert gpt["mixed_precision"]["fp16"] is True and gpt["mixed_precision"]["params_dtype"] == "torch.float16"
    # the section's DP defaults (Bridge's _get_optimizer_overlap_cfgs) stated as the plan's (test_bridge_comm_overlap)
    assert gpt["comm_overlap"] == {"tp_comm_overlap": False, "tp_comm_overlap_cfg": None,
                                   "defer_embedding_wgrad_compute": True, "overlap_grad_reduce": False,
                                   "overlap_param_gather": False, "align_param_gather": False,
                                   "bucket_size": 40_000_000}


def test_bridge_cli_overrides_are_one_line_of_hydra_assignments(tmp_path, capsys):
    words = shlex.split(_export(tmp_path, capsys, case_plan("gpt-pp4-layout-block1"), "--to", "megatron-bridge",
                                "--args-only"))
    assert words[:2] == ["--recipe", "gpt3_175b_pretrain_config"]
    kv = dict(w.split("=", 1) for w in words[2:])
    assert kv["model.pipeline_model_parallel_layout"] == '"Et|t*2|t*3|t*2L"'
    # Bridge's dataset.seq_length (v0.6: the field finalize() copies over sequence_length; v0.3.1: a property with a
    # setter, not in its struct-mode DictConfig, so Hydra needs ++ to add it)
    assert kv["++dataset.seq_length"] == str(case_plan("gpt-pp4-layout-block1").model.seq_length)
    assert kv["model.recompute_method"] == "block" and kv["model.recompute_num_layers"] == "1"
    assert kv["model.kv_channels"] == "64" and kv["train.micro_batch_size"] == "4"        # 2048 / 32 heads


def test_bridge_refuses_t5(tmp_path, capsys):
    path = _write(tmp_path, case_plan("t5-tp2"))
    assert main(["export", str(path), "--to", "megatron-bridge"]) == 2
    assert "no T5 pretraining recipe" in capsys.readouterr().err


def test_docs_carry_the_flag_table():
    assert mapping_table() in (ROOT / "docs" / "megatron.md").read_text()


def test_every_emitted_flag_is_in_the_table():
    documented = " ".join(row[1] for row in TABLE)
    for name in CASES:
        for w in argv(case_config(name)):
            if w.startswith("--"):
                assert w in documented, w


def test_export_writes_megatron_lm_by_default_and_the_legacy_format_when_asked(tmp_path, capsys):
    plan = uniform_plan(load_model("gpt-1.3b", num_layers=4), 2, 1, 2, 2, 16)
    out = _export(tmp_path, capsys, plan)
    assert out.startswith("#!/usr/bin/env bash\n# Megatron-LM launch script written by aceso")
    out = _export(tmp_path, capsys, plan, "--to", "aceso-legacy")
    assert '"num_ops_in_each_stage"' in out
    assert load_plan(_write(tmp_path, plan)).num_stages == 2


@pytest.mark.parametrize("version", ["0.16", "0.19"])
def test_fsdp_export_leaves_max_connections_unset_and_says_the_checkpoint_format(version, tmp_path, capsys):
    """Megatron-LM asserts CUDA_DEVICE_MAX_CONNECTIONS is not 1 with Megatron FSDP (tp 2 on H100 would set it
    otherwise); the header says its checkpoints are fsdp_dtensor only; from 0.18 the distributed optimizer runs."""
    from search.spec.cluster import parse_cluster
    from search.settings.fsdp import MegatronFSDP
    plan = uniform_plan(load_model("gpt-1.3b", num_layers=4), 1, 2, 4, 4, 64, cluster=parse_cluster("1x8-h100"),
                        overlap_grad_reduce=True, megatron_fsdp=MegatronFSDP(data_parallel_sharding_strategy="optim"))
    text = _export(tmp_path, capsys, plan, "--megatron-version", version)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in text
    assert "# Megatron FSDP saves and loads checkpoints only in the fsdp_dtensor format (--ckpt-format fsdp_dtensor)" \
        in text and "convert-torch-dist-to-fsdp-dtensor" in text
    words = shlex.split(_export(tmp_path, capsys, plan, "--megatron-version", version, "--args-only"))
    assert ("--use-distributed-optimizer" in words) == (version == "0.19")
    assert words[words.index("--ckpt-format") + 1] == "fsdp_dtensor"


@pytest.mark.parametrize("gpu,tp,cp,expect", [("h100", 2, 1, True), ("a100", 1, 2, True), ("h100", 1, 1, False),
                                              ("b200", 2, 1, False), ("gb200", 4, 1, False)])
def test_max_connections_only_with_tp_or_cp_before_blackwell(gpu, tp, cp, expect, tmp_path, capsys):
    from search.spec.cluster import parse_cluster
    plan = uniform_plan(load_model("gpt-1.3b", num_layers=4), 1, tp, 8 // (tp * cp), 8 // (tp * cp), 64, cp=cp,
                        cluster=parse_cluster(f"1x8-{gpu}"))
    text = _export(tmp_path, capsys, plan, "--to", "megatron-lm")
    assert ("export CUDA_DEVICE_MAX_CONNECTIONS=1" in text) == expect
