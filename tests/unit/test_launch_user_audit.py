"""`aceso launch` as a user meets it (issue "Right answers", user audit 2): the node count it takes from the plan
when only --nproc-per-node is given, and the environment megatron-core needs for tensor parallelism.

References: docs/train.md (`--nnodes` defaults to the plan's cluster) and megatron-core's
`tensor_parallel/layers.py` (its TP linears rely on CUDA_DEVICE_MAX_CONNECTIONS=1 and warn without it; Megatron-LM
core_v0.19.0's `validate_args` asserts it for tp/cp > 1 before Blackwell, and asserts the opposite with FSDP)."""

from __future__ import annotations

import shlex
import subprocess

import pytest

from search.cli import main
from search.spec.cluster import parse_cluster
from search.spec.model import ModelSpec
from search.spec.plan import uniform_plan

TINY = ModelSpec(name="tiny", family="gpt", num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                 seq_length=32, vocab_size=512, params_dtype="bf16")
MOCK = ("--", "--mock-data", "--train-iters", "2")


def write(tmp_path, name, pp, tp, dp, cluster):
    path = tmp_path / name
    path.write_text(uniform_plan(TINY, pp, tp, dp, 8, 16, cluster=parse_cluster(cluster)).to_json())
    return str(path)


def launch(capsys, *argv):
    rc = main(["launch", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_nproc_per_node_alone_keeps_the_plans_node_count(capsys, tmp_path):
    # a 4x8 plan started on node 1 with the plan's own --nproc-per-node 8: 4 nodes, as documented (it was refused:
    # "--node-rank (1) must be in [0, 1) for --nnodes 1")
    plan = write(tmp_path, "p32.json", 4, 2, 4, "4x8-h100")
    rc, out, err = launch(capsys, plan, "--nproc-per-node", "8", "--node-rank", "1", "--master-addr", "n0",
                          "--dry-run", "--python", "python", *MOCK)
    assert rc == 0, err
    argv = shlex.split(out.strip())
    assert argv[argv.index("--nnodes") + 1] == "4" and argv[argv.index("--node-rank") + 1] == "1"


def test_tensor_parallel_gpu_launch_sets_max_connections(capsys, tmp_path, monkeypatch):
    plan = write(tmp_path, "tp2.json", 2, 2, 2, "1x8-h100")
    seen = {}

    def fake_run(cmd, extra_pythonpath=None, env=None, **kw):
        seen["env"] = env
        return 0

    monkeypatch.setattr("launch.commands.run_torchrun", fake_run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    rc, _, err = launch(capsys, plan, "--python", "python", *MOCK)
    assert rc == 0, err
    assert seen["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in err
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")      # the user's own value wins
    assert launch(capsys, plan, "--python", "python", *MOCK)[0] == 0
    assert seen["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"


@pytest.mark.parametrize("tp, cluster, wanted", [(2, "4x8-h100", True), (1, "4x8-h100", False),
                                                 (2, "4x8-b200", False)])
def test_slurm_script_exports_max_connections_for_tp_before_blackwell(capsys, tmp_path, tp, cluster, wanted):
    plan = write(tmp_path, "p.json", 4, tp, 8 // tp, cluster)
    rc, out, err = launch(capsys, plan, "--slurm", "-", "--python", "python", *MOCK)
    assert rc == 0, err
    lines = out.splitlines()
    export = [ln for ln in lines if ln.startswith("export CUDA_DEVICE_MAX_CONNECTIONS=")]
    assert bool(export) == wanted
    if wanted:   # before srun, so every node's torchrun and its workers inherit it; a job's own value wins
        assert lines.index(export[0]) < next(i for i, ln in enumerate(lines) if ln.startswith("srun "))
        script = tmp_path / "job.sbatch"
        script.write_text(out)
        got = subprocess.run(["bash", "-c", f"{export[0]}\necho $CUDA_DEVICE_MAX_CONNECTIONS"],
                             capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}).stdout.strip()
        assert got == "1"
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_tp_group_of_a_context_parallel_stage_across_nodes_is_refused(capsys, tmp_path):
    # ranks inside a stage go tp-cp-dp (aceso_megatron/parallel/layout.py: first + t + tp * (c + cp * j)); stage 1
    # (tp 2, cp 2) holds ranks 1-4: TP groups {1, 2} and {3, 4}, and {3, 4} straddles nodes of 4 (it was not checked:
    # only the dp groups of the first cp index were)
    from search.spec.plan import ParallelPlan, StageSpec
    st = [StageSpec(num_gpus=1, tp=1, dp=1, start_unit=0, end_unit=2, recompute=["none"] * 2),
          StageSpec(num_gpus=4, tp=2, cp=2, dp=1, start_unit=2, end_unit=6, recompute=["none"] * 4),
          StageSpec(num_gpus=3, tp=1, dp=3, start_unit=6, end_unit=8, recompute=["none"] * 2)]
    path = tmp_path / "cp.json"
    path.write_text(ParallelPlan(model=TINY, micro_batch_size=3, global_batch_size=6, stages=st).to_json())
    rc, _, err = launch(capsys, str(path), "--nnodes", "2", "--nproc-per-node", "4", "--dry-run", *MOCK)
    assert rc == 2 and "ranks 3..4" in err and "two nodes" in err
    assert launch(capsys, str(path), "--nnodes", "1", "--nproc-per-node", "8", "--dry-run", *MOCK)[0] == 0
