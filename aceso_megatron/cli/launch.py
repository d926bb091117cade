"""Launch `aceso train` for a plan: check it against the machine, then run torchrun or write a SLURM script.

  aceso launch plan.json --cpu -- --mock-data --train-iters 20          # gloo processes on this machine
  aceso launch plan.json --dry-run -- --data-path data/corpus           # print the torchrun command only
  aceso launch plan.json --node-rank 0 --master-addr node0 -- ...       # one node of a multi-node plan
  aceso launch plan.json --slurm job.sbatch -- ...                      # then: sbatch job.sbatch

Everything after `--` goes to `aceso train` (see `aceso train --help`); the options before it may come in any
order. Before anything starts (also with --dry-run and --slurm), and as one line with exit 2: the train
arguments are parsed and checked (data prefixes, split, checkpoint to resume), the plan passes the one pre-flight
for the aceso runtime (`aceso validate --target aceso`'s: vocabulary per tp, what the device cannot run, layer
specs, megatron block), the plan's world size (sum of
stages[].num_gpus) must equal nodes x processes per node, the processes per node must match the plan's cluster,
and with --cpu the processes must fit in this machine's RAM. --nnodes defaults to the plan's cluster. A worker
that stops on bad input comes back as its one line and exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from search import plots
from search.io.argtypes import nonnegative_int, port, positive_int
from search.spec.plan import load_plan
from search.targets.preflight import preflight

from .common import check_output, write_output

PASSTHROUGH = "train_args"   # the dispatcher puts everything after `--` here, untouched


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan file (from `aceso search`)")
    p.add_argument("--nnodes", type=positive_int, default=None,
                   help="number of nodes (default: the plan's cluster; 1 with --cpu or without a cluster)")
    p.add_argument("--node-rank", type=nonnegative_int, default=None,
                   help="this node's rank (default 0; with --slurm, SLURM's $SLURM_NODEID)")
    p.add_argument("--nproc-per-node", type=positive_int, default=None,
                   help="processes (GPUs) per node; default: the plan's cluster, else world size / nodes")
    p.add_argument("--master-addr", default=None,
                   help="rendezvous host (multi-node; with --slurm, the job's first host)")
    p.add_argument("--master-port", type=port, default=None, help="rendezvous port (default 29500)")
    p.add_argument("--slurm", metavar="FILE", default=None, help="write a SLURM batch script to FILE (- = stdout)")
    p.add_argument("--cpu", action="store_true", help="CPU processes on gloo (tests, laptops); passes --cpu to train")
    p.add_argument("--dry-run", action="store_true", help="check and print the command; start nothing")
    p.add_argument("--python", default=sys.executable, help="python interpreter for the workers")
    plots.add_arguments(p, "the run's loss, step time and memory per stage at the end (passed to `aceso train`, "
                           "which needs --log-file)")
    p.epilog = "-- TRAIN_ARGS: the arguments for `aceso train` (after a literal --)"


def _nnodes(args: argparse.Namespace, plan) -> int:
    if args.nnodes is not None:
        return args.nnodes
    if plan.cluster is not None and not args.cpu:   # also with --nproc-per-node (it is checked against the cluster)
        return plan.cluster.num_nodes
    return 1


def run(args: argparse.Namespace) -> int:
    from launch.commands import (LaunchSpec, available_ram_mb, check_cpu_memory, check_plan_fits,
                                 check_slurm_options, count_visible_gpus, launch_env, resolve_nproc, run_torchrun, shell_line,
                                 slurm_script, torchrun_command)

    from ..training.args import check_train_args, parse_train_args

    check_slurm_options(args.slurm, {"--master-addr": args.master_addr, "--node-rank": args.node_rank})
    train_args = list(getattr(args, "train_args", None) or []) + plots.train_args(args)
    plan = load_plan(args.plan)
    check_train_args(parse_train_args(args.plan, [*train_args, *(["--cpu"] if args.cpu else [])]), plan)
    # the one pre-flight (search.targets.preflight) before any process, for the aceso runtime whatever the plan was priced
    # for: the plan, its model and what the device cannot run (--cpu: the capability table's CPU rules, those each
    # worker applies again before its process group); validate --target aceso answers the same
    preflight(plan, "cpu" if args.cpu else "cuda", target="aceso")
    if args.slurm is not None and not args.dry_run:
        check_output(args.slurm, "--slurm")
    nnodes = _nnodes(args, plan)
    nproc = resolve_nproc(plan, nnodes, args.nproc_per_node, args.cpu)
    spec = LaunchSpec(plan_path=args.plan, nnodes=nnodes, node_rank=args.node_rank or 0, nproc_per_node=nproc,
                      master_addr=args.master_addr, master_port=args.master_port, cpu=args.cpu,
                      python=args.python, train_args=train_args)
    starts_here = not args.dry_run and args.slurm is None
    check_plan_fits(plan, spec, visible_gpus=count_visible_gpus() if starts_here and not args.cpu else None)
    note = check_cpu_memory(plan, spec, available_ram_mb()) if args.cpu and args.slurm is None else None
    if args.slurm is not None:
        text = slurm_script(spec, env=launch_env(plan, args.cpu))
        if args.dry_run or args.slurm == "-":
            sys.stdout.write(text)
        else:
            write_output(text, args.slurm, "--slurm")
            print(f"wrote {args.slurm}; fill in its #SBATCH placeholders, then submit it with: sbatch {args.slurm}",
                  file=sys.stderr)
        return 0
    if note:
        print(f"aceso launch: note: {note}", file=sys.stderr)
    env = launch_env(plan, args.cpu)
    for name, (value, why) in env.items():
        print(f"aceso launch: with {name}={value} in the workers' environment ({why})", file=sys.stderr)
    cmd = torchrun_command(spec)
    print(shell_line(cmd), flush=True)
    if args.dry_run:
        return 0
    work_env = dict(os.environ)
    for name, (value, _) in env.items():
        work_env.setdefault(name, value)   # a value the user set wins
    return run_torchrun(cmd, extra_pythonpath=_checkout_root(), env=work_env)  # a worker's bad input: exit 2


def _checkout_root() -> str | None:
    """The repository root when running from a checkout (so workers import ``aceso_megatron`` from it)."""
    root = Path(__file__).resolve().parents[2]
    return str(root) if (root / "aceso_megatron").is_dir() else None
