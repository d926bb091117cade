"""`aceso launch`: plan-vs-machine checks, torchrun commands and SLURM scripts, read as text (torch-free)."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from search.cli import main
from search.spec.cluster import parse_cluster
from search.spec.model import ModelSpec
from search.spec.plan import ParallelPlan, StageSpec, uniform_plan
from tests.conftest import ROOT
from tests.unit.test_torch_free import run_blocked

TINY = ModelSpec(name="tiny", family="gpt", num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                 seq_length=32, vocab_size=512, params_dtype="bf16")   # (no fp16 on H100s: runtime_rules.fp16_on_gpu)


def write_plan(tmp_path, plan: ParallelPlan, name: str = "plan.json") -> str:
    path = tmp_path / name
    path.write_text(plan.to_json())
    return str(path)


@pytest.fixture
def plan8(tmp_path):
    """8 GPUs on one node: 2 stages of tp 2 x dp 2."""
    return write_plan(tmp_path, uniform_plan(TINY, 2, 2, 2, 4, 16, cluster=parse_cluster("1x8-h100")), "p8.json")


@pytest.fixture
def plan32(tmp_path):
    """32 GPUs on 4 nodes of 8: 4 stages of tp 2 x dp 4."""
    return write_plan(tmp_path, uniform_plan(TINY, 4, 2, 4, 4, 16, cluster=parse_cluster("4x8-h100")), "p32.json")


MOCK = ("--", "--mock-data", "--train-iters", "2")   # train arguments that pass launch's checks


def launch(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["launch", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_dry_run_one_node_prints_torchrun_with_one_process_per_gpu(capsys, plan8):
    rc, out, err = launch(capsys, plan8, "--dry-run", "--python", "python", *MOCK, "--lr", "1e-4")
    assert rc == 0, err
    assert shlex.split(out.strip()) == [
        "python", "-m", "torch.distributed.run", "--nproc-per-node", "8", "--standalone",
        "-m", "aceso_megatron.training.train", plan8, "--mock-data", "--train-iters", "2", "--lr", "1e-4"]


def test_dry_run_four_nodes_names_this_node_and_the_rendezvous(capsys, plan32):
    rc, out, err = launch(capsys, plan32, "--nnodes", "4", "--node-rank", "2", "--master-addr", "node0",
                          "--master-port", "6000", "--dry-run", "--python", "python", *MOCK)
    assert rc == 0, err
    argv = shlex.split(out.strip())
    assert argv[:3] == ["python", "-m", "torch.distributed.run"]
    opts = dict(zip(argv[3:13:2], argv[4:13:2], strict=True))
    assert opts == {"--nproc-per-node": "8", "--nnodes": "4", "--node-rank": "2", "--master-addr": "node0",
                    "--master-port": "6000"}
    assert argv[13:] == ["-m", "aceso_megatron.training.train", plan32, "--mock-data", "--train-iters", "2"]


@pytest.mark.parametrize("nodes", [1, 4])
def test_slurm_script_runs_one_torchrun_per_node_with_slurm_rendezvous(capsys, tmp_path, plan8, plan32, nodes,
                                                                       monkeypatch):
    plan = plan8 if nodes == 1 else plan32
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for ext in (".bin", ".idx"):     # launch checks that the data prefix exists
        (tmp_path / "data" / f"my corpus{ext}").write_bytes(b"")
    rc, out, err = launch(capsys, plan, "--nnodes", str(nodes), "--slurm", "-", "--python", "python",
                          "--", "--data-path", "data/my corpus", "--train-iters", "5")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert f"#SBATCH --nodes={nodes}" in lines and "#SBATCH --ntasks-per-node=1" in lines
    assert "#SBATCH --gpus-per-node=8" in lines
    assert 'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in lines
    srun = [ln for ln in lines if ln.startswith("srun ")]
    assert len(srun) == 1
    words = shlex.split(srun[0])
    inner = words[words.index("-c") + 1]
    assert '--node-rank "$SLURM_NODEID"' in inner and '--nnodes "$SLURM_NNODES"' in inner
    assert '--master-addr "$MASTER_ADDR"' in inner and "--nproc-per-node 8" in inner
    # the train arguments survive quoting as separate words, the path with a space as one
    assert words[words.index("-c") + 2:] == ["torchrun", "-m", "aceso_megatron.training.train", plan, "--data-path",
                                              "data/my corpus", "--train-iters", "5"]
    assert "##SBATCH --partition=PARTITION" in lines and "##SBATCH --time=HH:MM:SS" in lines  # site placeholders
    script = tmp_path / "job.sbatch"
    script.write_text(out)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_slurm_script_written_to_a_file(capsys, tmp_path, plan32):
    dest = tmp_path / "job.sbatch"
    rc, out, err = launch(capsys, plan32, "--slurm", str(dest), *MOCK)     # --nnodes: the plan's 4 nodes
    assert rc == 0 and dest.read_text().startswith("#!/bin/bash") and "sbatch" in err
    assert "#SBATCH --nodes=4" in dest.read_text()


def test_plan_for_8_gpus_launched_with_4_exits_2_with_one_line(capsys, plan8):
    rc, out, err = launch(capsys, plan8, "--nproc-per-node", "4", "--cpu", *MOCK)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1
    assert "needs 8 GPUs" in err and "starts 4" in err


def test_plan_for_other_gpus_per_node_is_explained(capsys, plan32):
    rc, _, err = launch(capsys, plan32, "--nnodes", "2", "--nproc-per-node", "16", "--dry-run", *MOCK)
    assert rc == 2 and "4x8-h100" in err and "--nproc-per-node 8" in err


def test_tp_group_across_nodes_is_refused(capsys, tmp_path):
    # stage 0 has 1 GPU, stage 1 has tp 2 on ranks 1-2: with 2 processes per node it straddles nodes 0 and 1
    st = [StageSpec(num_gpus=1, tp=1, dp=1, start_unit=0, end_unit=4, recompute=["none"] * 4),
          StageSpec(num_gpus=2, tp=2, dp=1, start_unit=4, end_unit=6, recompute=["none"] * 2),
          StageSpec(num_gpus=1, tp=1, dp=1, start_unit=6, end_unit=8, recompute=["none"] * 2)]
    plan = write_plan(tmp_path, ParallelPlan(model=TINY, micro_batch_size=2, global_batch_size=4, stages=st))
    rc, _, err = launch(capsys, plan, "--nnodes", "2", "--nproc-per-node", "2", "--dry-run", *MOCK)
    assert rc == 2 and "ranks 1..2" in err and "two nodes" in err
    rc, _, _ = launch(capsys, plan, "--nnodes", "1", "--nproc-per-node", "4", "--dry-run", *MOCK)
    assert rc == 0


def test_no_gpus_without_cpu_flag_is_refused(capsys, plan8, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    rc, _, err = launch(capsys, plan8, *MOCK)
    assert rc == 2 and "0 visible GPU" in err and "--cpu" in err


def test_cpu_launch_passes_cpu_to_train(capsys, plan8):
    rc, out, _ = launch(capsys, plan8, "--cpu", "--dry-run", *MOCK)
    assert rc == 0 and shlex.split(out)[-2:] == ["2", "--cpu"]


def test_launch_is_torch_free_and_wrapper_calls_it(plan8):
    r = run_blocked(f"""
        import sys
        from search.cli import main
        sys.exit(main(['launch', {plan8!r}, '--dry-run', '--', '--mock-data', '--train-iters', '2']))
    """)
    assert r.returncode == 0, r.stderr
    assert "-m aceso_megatron.training.train" in r.stdout
    env_cmd = f"{sys.executable} -m search"
    w = subprocess.run(["bash", str(ROOT / "launch" / "torchrun.sh"), plan8, "--dry-run", *MOCK],
                       capture_output=True, text=True, cwd=ROOT, env={"ACESO": env_cmd, "PATH": "/usr/bin:/bin"})
    assert w.returncode == 0, w.stderr
    assert "--nproc-per-node 8" in w.stdout
    assert subprocess.run(["bash", "-n", str(ROOT / "launch" / "slurm.sbatch")]).returncode == 0


@pytest.mark.parametrize("flag, value", [("--master-addr", "node7"), ("--node-rank", "0"), ("--node-rank", "3")])
def test_slurm_refuses_the_rendezvous_slurm_decides(capsys, tmp_path, plan32, flag, value):
    """The --slurm script takes MASTER_ADDR from the job's first host and the node rank from $SLURM_NODEID (docs/
    train.md), so --master-addr / --node-rank given with it were silently dropped: refused, nothing written."""
    dest = tmp_path / "job.sbatch"
    rc, out, err = launch(capsys, plan32, "--slurm", str(dest), flag, value, *MOCK)
    assert rc == 2 and out == "" and not dest.exists()
    assert err.count("\n") == 1 and f"{flag} {value}: with --slurm, SLURM decides it" in err and f"drop {flag}" in err
    # without --slurm they name this node and the rendezvous; --master-port stays the script's default port
    rc, out, err = launch(capsys, plan32, "--slurm", "-", "--master-port", "6001", *MOCK)
    assert rc == 0 and "MASTER_PORT=${MASTER_PORT:-6001}" in out
