"""Build the commands that start ``aceso train`` on one or many nodes: torchrun lines and SLURM batch scripts.

Torch-free on purpose: ``aceso launch`` checks a plan against the machine and prints or writes commands before
any process (or process group) exists. One process per GPU: ``python -m torch.distributed.run`` with
``--nproc-per-node`` GPUs per node runs ``python -m aceso_megatron.training.train PLAN TRAIN_ARGS`` in each. Ranks are
numbered node by node, which is the order a plan's stages own them (``search.spec.plan``), so a stage's TP group
must not straddle two nodes.

Multi-node under SLURM: one ``srun`` task per node starts torchrun there; the rendezvous comes from the SLURM
environment (``MASTER_ADDR`` = the first host of ``scontrol show hostnames $SLURM_JOB_NODELIST``, node rank =
``$SLURM_NODEID``, node count = ``$SLURM_NNODES``).

CPU runs (``--cpu``) are checked against this machine's memory first (``check_cpu_memory``): the analytic
model's per-rank memory in fp32 (what a CPU run trains in), without the GPU allocator's reserve, plus
``CPU_PROCESS_MB`` per process, summed over the node's processes, against the RAM available to us (MemAvailable,
and the cgroup limit of a container). A worker's bad input comes back as one line and exit 2 (``run_torchrun``).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from search.io.errors import AcesoError
from search.spec.plan import ParallelPlan

# max RSS of one `aceso train --cpu` process of a 64-wide 4-layer GPT (tests/distributed/test_train_gpt.py size):
# 443 MiB measured with torch 2.13 + megatron-core 0.16.1, almost all of it the libraries themselves
CPU_PROCESS_MB = 450

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
        for j in range(st.cp * st.dp):      # ranks go tp-cp-dp: every (cp, dp) index has its own TP group
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


def plan_cpu_memory_mb(plan: ParallelPlan) -> list[float]:
    """Per stage: the analytic memory of one rank in an fp32 CPU run (no GPU reserve), MiB: the one price
    (``search.pricing``) as the aceso runtime runs the plan on a CPU cluster."""
    from search.spec.cluster import parse_cluster
    from search.pricing import price

    cost = price(plan, "runtime", cluster=parse_cluster(f"1x{plan.world_size}-cpu"), precision="fp32",
                 attention="unfused")
    return [s.memory_mb - s.memory_breakdown.get("reserve", 0.0) for s in cost.stages]


def available_ram_mb() -> float | None:
    """RAM this process may still use: MemAvailable, capped by a cgroup (container) limit; None if unknown."""
    avail = None
    try:
        m = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
        avail = int(m.group(1)) / 1024 if m else None
    except OSError:
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit, usage = Path(limit_file).read_text().strip(), Path(usage_file).read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and usage.isdigit() and int(limit) < 1 << 60:
            free = (int(limit) - int(usage)) / 2**20
            avail = free if avail is None else min(avail, free)
        break
    return avail


def check_cpu_memory(plan: ParallelPlan, spec: "LaunchSpec", available_mb: float | None) -> str | None:
    """Refuse a ``--cpu`` launch whose processes would not fit in this machine's RAM; returns a note to print for a
    plan made for GPUs that does fit (None otherwise)."""
    c = plan.cluster
    made_for = f"the plan was made for {c.label}" if c is not None and c.gpu.name != "cpu" else None
    per_stage = plan_cpu_memory_mb(plan)
    first = spec.node_rank * spec.nproc_per_node
    ranks = range(first, first + spec.nproc_per_node)
    need = sum(per_stage[plan.stage_of_rank(r)] + CPU_PROCESS_MB for r in ranks)
    if available_mb is not None and need > available_mb:
        raise AcesoError(
            f"{spec.plan_path}: {made_for + '; ' if made_for else ''}its {len(ranks)} CPU processes need about "
            f"{need / 1024:.1f} GiB (fp32, analytic memory model + {CPU_PROCESS_MB} MiB each) but this machine has "
            f"{available_mb / 1024:.1f} GiB available; search a plan for --cluster 1xN-cpu with a smaller model, "
            "or run it on the GPUs it was made for (without --cpu)")
    if made_for:
        return f"{made_for}; running it as {len(ranks)} CPU processes (gloo, fp32, about {need / 1024:.1f} GiB)"
    return None


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


def launch_env(plan: ParallelPlan, cpu: bool) -> dict[str, tuple[str, str]]:
    """What megatron-core needs in the workers' environment for this plan: name -> (value, why).

    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` when a stage has tp or cp > 1 on a GPU before Blackwell: megatron-core's
    tensor-parallel linears launch their async all-gather / reduce-scatter / all-reduce before the backward GEMMs
    and rely on one hardware queue to keep that order (``tensor_parallel/layers.py``; it warns without it, and
    Megatron-LM's ``validate_args`` asserts it), which is the overlap the cost model prices. Never with Megatron
    FSDP, which needs more than one connection. The export's rule (``search.megatron.script.max_connections_rule``),
    over the plan's stages."""
    from search.megatron.script import max_connections_rule
    model_parallel = any(st.tp > 1 or st.cp > 1 for st in plan.stages)
    if cpu or not max_connections_rule(plan, model_parallel, plan.megatron_fsdp is not None):
        return {}
    return {"CUDA_DEVICE_MAX_CONNECTIONS": ("1", "tp/cp > 1 before Blackwell: megatron-core's TP communication "
                                                 "overlap relies on it")}


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


def check_slurm_options(slurm: str | None, given: dict[str, object]) -> None:
    """``--slurm``: the script's rendezvous is SLURM's (``MASTER_ADDR`` = the job's first host, node rank =
    ``$SLURM_NODEID``), so a ``--master-addr`` or ``--node-rank`` given with it would be ignored: refused instead."""
    if slurm is None:
        return
    for flag, value in given.items():
        if value is not None:
            raise AcesoError(f"{flag} {value}: with --slurm, SLURM decides it (the script's MASTER_ADDR is the job's "
                             f"first host, its node rank $SLURM_NODEID); drop {flag}, or run `aceso launch` without "
                             "--slurm on each node")


# site settings every cluster wants: disabled (##) until filled in, so the script also runs on the site's defaults
SLURM_PLACEHOLDERS = (
    "# Your site's settings: fill these in and remove one # to enable each (sbatch uses its defaults meanwhile)\n"
    "##SBATCH --partition=PARTITION\n"
    "##SBATCH --account=ACCOUNT\n"
    "##SBATCH --time=HH:MM:SS\n"
)


def slurm_script(spec: LaunchSpec, job_name: str = "aceso-train",
                 env: dict[str, tuple[str, str]] | None = None) -> str:
    """A SLURM batch script: one srun task per node, each starting torchrun with the SLURM rendezvous; ``env``
    (``launch_env``) exported unless the job's environment sets it."""
    exports = "".join(f"export {k}=${{{k}:-{v}}}   # {why}\n" for k, (v, why) in (env or {}).items())
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
        f"{SLURM_PLACEHOLDERS}"
        "set -euo pipefail\n"
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
        f"export MASTER_PORT=${{MASTER_PORT:-{spec.master_port or DEFAULT_PORT}}}\n"
        f"{exports}"
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c '{inner}' torchrun {args}\n"
    )


def shell_line(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)


def die_with_parent() -> None:
    """Linux: end this process when its parent dies (``PR_SET_PDEATHSIG``): a SIGKILLed launcher cannot stop the
    torchrun it started in its own session, nor a SIGKILLed torchrun its workers; they would go on running
    (training, or measuring into the partial file a rerun reads)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_torchrun(cmd: list[str], extra_pythonpath: str | None = None, error_env: str = "ACESO_ERROR_FILE",
                 env: dict | None = None) -> int:
    """Run torchrun in the foreground and return its exit status; a worker's bad input (written to the file named
    by ``$error_env``, see ``aceso_megatron.errors.report_bad_input``) is raised as one ``AcesoError`` line, and
    torchrun's failure report that follows it is dropped. SIGTERM or Ctrl-C stops torchrun, which stops its
    workers, before the exception goes on. ``env``: the environment (default: ours)."""
    env = dict(os.environ if env is None else env)
    if extra_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_pythonpath, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")    # torchrun's default for several processes, without its banner
    with tempfile.TemporaryDirectory(prefix="aceso-launch-") as tmp:
        err_file = Path(tmp) / "error.txt"
        env[error_env] = str(err_file)
        # its own session (signals reach it only through _ForwardSignals), but it dies with us
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=die_with_parent)
        held: list[bytes] = []
        try:
            with _ForwardSignals(proc) as forwarded:
                for line in proc.stderr:
                    if err_file.exists() or forwarded.signum:
                        held.append(line)  # torchrun's report of a failure a worker explained, or of the signal
                    else:
                        sys.stderr.buffer.write(line)
                        sys.stderr.buffer.flush()
                rc = proc.wait()
        except BaseException:
            _stop(proc)
            raise
        if forwarded.signum:   # the workers said where they stopped and how to resume
            return 128 + forwarded.signum
        if rc != 0 and err_file.exists():
            raise AcesoError(err_file.read_text().strip())
        for line in held:
            sys.stderr.buffer.write(line)
        sys.stderr.buffer.flush()
        return rc


class _ForwardSignals:
    """While torchrun runs (in its own session, so a terminal's Ctrl-C reaches it only through us): pass SIGTERM
    and SIGINT on to it once each; torchrun passes them to its workers, which finish the step, save and exit
    (``aceso_megatron.training.signals``). ``signum``: the first signal received, else 0."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.signum, self.previous, self.sent = proc, 0, {}, set()

    def _forward(self, signum: int, frame) -> None:
        self.signum = self.signum or signum
        if signum not in self.sent and self.proc.poll() is None:
            self.sent.add(signum)
            self.proc.send_signal(signum)

    def __enter__(self) -> "_ForwardSignals":
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self.previous[s] = signal.signal(s, self._forward)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def _stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to torchrun (it terminates its workers), then wait; SIGKILL only if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    except BaseException:   # a second Ctrl-C while waiting
        proc.kill()
        proc.wait()
        raise
