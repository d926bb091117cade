"""Launch `aceso train` for a plan: check it against the machine, then run torchrun or write a SLURM script.

  aceso launch plan.json --cpu -- --mock-data --train-iters 20          # gloo processes on this machine
  aceso launch plan.json --dry-run -- --data-path data/corpus           # print the torchrun command only
  aceso launch plan.json --nnodes 4 --node-rank 0 --master-addr node0 -- ...
  aceso launch plan.json --nnodes 4 --slurm job.sbatch -- ...           # then: sbatch job.sbatch

The plan's world size (sum of stages[].num_gpus) must equal nodes x processes per node, and the processes per
node must match the plan's cluster; a mismatch is one line and exit 2 before anything starts. Arguments after
`--` go to `aceso train` (see `aceso train --help`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from search.plan import load_plan

from .common import write_output


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan file (from `aceso search`)")
    _add_options(p)
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then arguments for `aceso train`")


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank (default 0)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="processes (GPUs) per node; default: the plan's cluster, else world size / nodes")
    p.add_argument("--master-addr", default=None, help="rendezvous host (multi-node)")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port (default 29500)")
    p.add_argument("--slurm", metavar="FILE", default=None, help="write a SLURM batch script to FILE (- = stdout)")
    p.add_argument("--cpu", action="store_true", help="CPU processes on gloo (tests, laptops); passes --cpu to train")
    p.add_argument("--dry-run", action="store_true", help="check and print the command; start nothing")
    p.add_argument("--python", default=sys.executable, help="python interpreter for the workers")


def _split_remainder(args: argparse.Namespace) -> list[str]:
    """argparse's REMAINDER swallows launch options written after PLAN: parse those here, return train args."""
    rest = list(args.train_args)
    cut = rest.index("--") if "--" in rest else len(rest)
    if cut:
        opts = argparse.ArgumentParser(prog="aceso launch PLAN", add_help=False)
        _add_options(opts)
        opts.parse_args(rest[:cut], namespace=args)
    return rest[cut + 1:]


def run(args: argparse.Namespace) -> int:
    from launch.commands import (LaunchSpec, check_plan_fits, count_visible_gpus, resolve_nproc, run_torchrun,
                                 shell_line, slurm_script, torchrun_command)

    train_args = _split_remainder(args)
    plan = load_plan(args.plan)
    nproc = resolve_nproc(plan, args.nnodes, args.nproc_per_node, args.cpu)
    spec = LaunchSpec(plan_path=args.plan, nnodes=args.nnodes, node_rank=args.node_rank, nproc_per_node=nproc,
                      master_addr=args.master_addr, master_port=args.master_port, cpu=args.cpu,
                      python=args.python, train_args=train_args)
    starts_here = not args.dry_run and args.slurm is None
    check_plan_fits(plan, spec, visible_gpus=count_visible_gpus() if starts_here and not args.cpu else None)
    if args.slurm is not None:
        text = slurm_script(spec)
        if args.dry_run or args.slurm == "-":
            sys.stdout.write(text)
        else:
            write_output(text, args.slurm)
            print(f"wrote {args.slurm}; submit it with: sbatch {args.slurm}", file=sys.stderr)
        return 0
    cmd = torchrun_command(spec)
    print(shell_line(cmd), flush=True)
    if args.dry_run:
        return 0
    return run_torchrun(cmd, extra_pythonpath=_checkout_root())  # torchrun's status (2: a worker's bad input)


def _checkout_root() -> str | None:
    """The repository root when running from a checkout (so workers import ``aceso_megatron`` from it)."""
    root = Path(__file__).resolve().parents[2]
    return str(root) if (root / "aceso_megatron").is_dir() else None
