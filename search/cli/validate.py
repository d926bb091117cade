"""Check a plan file: schema, coverage of the model's units, TP/DP divisibility, fit to a cluster or world size."""

from __future__ import annotations

import argparse

from ..errors import AcesoError
from ..plan import check_fits_cluster, load_plan
from .common import print_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan JSON file")
    p.add_argument("--world-size", type=int, default=None, help="the number of processes it will be launched with")
    p.add_argument("--cluster", default=None, help="check against this cluster (NODESxGPUS-gpu)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan, world_size=args.world_size)
    if args.cluster:
        from ..cluster import parse_cluster
        try:
            check_fits_cluster(plan, parse_cluster(args.cluster))
        except ValueError as e:
            raise AcesoError(f"{args.plan}: {e}") from None
    summary = {"valid": True, "model": plan.model.name, "world_size": plan.world_size,
               "num_stages": plan.num_stages, "micro_batch_size": plan.micro_batch_size,
               "global_batch_size": plan.global_batch_size,
               "stages": [{"num_gpus": s.num_gpus, "tp": s.tp, "dp": s.dp, "units": [s.start_unit, s.end_unit]}
                          for s in plan.stages]}
    if args.json:
        print_json(summary)
    else:
        shapes = ", ".join(f"{s.num_gpus}gpu tp{s.tp} dp{s.dp} units {s.start_unit}-{s.end_unit}" for s in plan.stages)
        print(f"{args.plan}: valid plan for {plan.model.name} on {plan.world_size} GPUs, "
              f"{plan.num_stages} stages ({shapes})")
    return 0
