"""Build the commands that start ``aceso train`` on one or many nodes: torchrun lines and SLURM batch scripts.

Torch-free on purpose: ``aceso launch`` checks a plan against the machine and prints or writes commands before
any process (or process group) exists. One process per GPU: ``python -m torch.distributed.run`` with
``--nproc-per-node`` GPUs per node runs ``python -m aceso_megatron.training.train PLAN TRAIN_ARGS`` in each. Ranks are
numbered node by node, which is the order a plan's stages own them (``search.plan``), so a stage's TP group
must not straddle two nodes.

Multi-node under SLURM: one ``srun`` task per node starts torchrun there; the rendezvous comes from the SLURM
environment (``MASTER_ADDR`` = the first host of ``scontrol show hostnames $SLURM_JOB_NODELIST``, node rank =
``$SLURM_NODEID``, node count = ``$SLURM_NNODES``).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field

from search.errors import AcesoError
from search.plan import ParallelPlan

DEFAULT_PORT = 29500
TRAIN_MODULE = "aceso_megatron.training.train"


@dataclass
class LaunchSpec:
    """How to start a plan: the nodes, processes per node, rendezvous and the arguments for ``aceso train``."""

    plan_path: str
    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    cpu: bool = False
    python: str = "python"
    train_args: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def resolve_nproc(plan: ParallelPlan, nnodes: int, nproc_per_node: int | None, cpu: bool) -> int:
    """Processes per node: as given, else the plan's cluster (GPUs per node), else the plan's world / nodes."""
    if nproc_per_node is not None:
        return nproc_per_node
    if plan.cluster is not None and not cpu and plan.cluster.num_nodes == nnodes:
        return plan.cluster.gpus_per_node
    return max(plan.world_size // nnodes, 1)


def check_plan_fits(plan: ParallelPlan, spec: LaunchSpec, visible_gpus: int | None = None) -> None:
    """Raise ``AcesoError`` (one line) when the launch cannot run the plan."""
    if spec.nnodes < 1 or spec.nproc_per_node < 1:
        raise AcesoError(f"--nnodes ({spec.nnodes}) and --nproc-per-node ({spec.nproc_per_node}) must be >= 1")
    if not 0 <= spec.node_rank < spec.nnodes:
        raise AcesoError(f"--node-rank ({spec.node_rank}) must be in [0, {spec.nnodes}) for --nnodes {spec.nnodes}")
    if spec.world_size != plan.world_size:
        raise AcesoError(
            f"{spec.plan_path}: the plan needs {plan.world_size} GPUs (sum of stages[].num_gpus) but this launch "
            f"starts {spec.world_size} ({spec.nnodes} node(s) x {spec.nproc_per_node} per node); launch "
            f"{plan.world_size} processes or search a plan for {spec.world_size} GPUs"
        )
    c = plan.cluster
    if c is not None and not spec.cpu and c.gpus_per_node != spec.nproc_per_node:
        raise AcesoError(
            f"{spec.plan_path}: the plan was made for {c.label} ({c.gpus_per_node} GPUs per node) but this launch "
            f"uses {spec.nproc_per_node} per node; use --nproc-per-node {c.gpus_per_node} --nnodes {c.num_nodes} "
            "or search a plan for this machine"
        )
    for i, st in enumerate(plan.stages):
        first = plan.first_rank(i)
        for j in range(st.dp):
            lo, hi = first + j * st.tp, first + (j + 1) * st.tp - 1
            if lo // spec.nproc_per_node != hi // spec.nproc_per_node:
                raise AcesoError(
                    f"{spec.plan_path}: stages[{i}] TP group of ranks {lo}..{hi} would span two nodes with "
                    f"{spec.nproc_per_node} processes per node; TP groups must stay inside a node"
                )
    if visible_gpus is not None and not spec.cpu and spec.nproc_per_node > visible_gpus:
        raise AcesoError(
            f"this node has {visible_gpus} visible GPU(s) but the launch needs {spec.nproc_per_node} per node; "
            "run on a bigger node, use more nodes, or --cpu for a CPU (gloo) test run"
        )


def count_visible_gpus() -> int | None:
    """GPUs on this node without importing torch (``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi -L``); None if unknown."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return len([d for d in env.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return len([ln for ln in out.stdout.splitlines() if ln.startswith("GPU ")]) if out.returncode == 0 else 0


def train_argv(spec: LaunchSpec) -> list[str]:
    """``-m aceso_megatron.training.train PLAN ARGS`` (``--cpu`` added for CPU launches)."""
    args = list(spec.train_args)
    if spec.cpu and "--cpu" not in args:
        args.append("--cpu")
    return ["-m", TRAIN_MODULE, spec.plan_path, *args]


def torchrun_command(spec: LaunchSpec) -> list[str]:
    """The torchrun command for this node. One node without an address: ``--standalone`` (a free local port)."""
    cmd = [spec.python, "-m", "torch.distributed.run", "--nproc-per-node", str(spec.nproc_per_node)]
    if spec.nnodes == 1 and spec.master_addr is None and spec.master_port is None:
        cmd.append("--standalone")
    else:
        cmd += ["--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank),
                "--master-addr", spec.master_addr or "127.0.0.1",
                "--master-port", str(spec.master_port or DEFAULT_PORT)]
    return cmd + train_argv(spec)


def slurm_script(spec: LaunchSpec, job_name: str = "aceso-train") -> str:
    """A SLURM batch script: one srun task per node, each starting torchrun with the SLURM rendezvous."""
    gpus = "" if spec.cpu else f"#SBATCH --gpus-per-node={spec.nproc_per_node}\n"
    inner = (
        f'exec {shlex.quote(spec.python)} -m torch.distributed.run --nnodes "$SLURM_NNODES" '
        f'--node-rank "$SLURM_NODEID" --nproc-per-node {spec.nproc_per_node} '
        f'--master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" "$@"'
    )
    args = " ".join(shlex.quote(a) for a in train_argv(spec))
    return (
        "#!/bin/bash\n"
        f"# Generated by `aceso launch --slurm`: {spec.nnodes} node(s) x {spec.nproc_per_node} processes "
        f"= {spec.world_size}, the plan's world size.\n"
        f"#SBATCH --job-name={job_name}\n"
        f"#SBATCH --nodes={spec.nnodes}\n"
        "#SBATCH --ntasks-per-node=1\n"
        f"{gpus}"
        "#SBATCH --exclusive\n"
        "set -euo pipefail\n"
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
        f"export MASTER_PORT=${{MASTER_PORT:-{spec.master_port or DEFAULT_PORT}}}\n"
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c '{inner}' torchrun {args}\n"
    )


def shell_line(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)


def run_torchrun(cmd: list[str], extra_pythonpath: str | None = None) -> int:
    """Run the command in the foreground; the exit status of torchrun."""
    env = dict(os.environ)
    if extra_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_pythonpath, env.get("PYTHONPATH")) if p)
    return subprocess.run(cmd, env=env).returncode
