"""Best uniform Megatron configuration (the same pp/tp/cp/dp/SP/VPP/recompute everywhere) under the same cost model.

Example: aceso baseline --model gpt-1.3b --cluster 1x8-h100 --global-batch-size 512 -o baseline.json

--target aceso (default) prices and checks it for the aceso runtime (DDP / the distributed optimizer, activations
on the GPU); --target megatron-lm / megatron-bridge as that framework runs it, Megatron FSDP and CPU activation
offload included (--megatron-fsdp on: only FSDP configurations). Each target's limits apply to it only
(search/targets/capabilities.py).
"""

from __future__ import annotations

import argparse
import json
import sys

from search.io.errors import AcesoError
from .common import check_output, write_output
from .search_cmd import add_problem_args, settings_from_args, setup


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_problem_args(p)
    p.add_argument("--json", action="store_true", help="print a machine-readable summary")
    p.add_argument("-o", "--output", default=None, help="write it as a ParallelPlan JSON here; - = stdout")


def run(args: argparse.Namespace) -> int:
    from ..planner.api import plan_baseline
    from ..planner.report import plan_throughput, to_plan
    check_output(args.output)
    # the plan it writes runs on its target; for the aceso runtime (DDP, no offload) in the cost model's training
    # spec too (the Megatron-LM settings it tries read the offload switch there)
    model, cluster, training, cm = setup(args, runtime=args.target == "aceso")
    res = plan_baseline(cm, training, args.target)
    if res is None:
        raise AcesoError(f"no uniform configuration exists for {cluster.num_gpus} GPUs with per-rank micro-batch "
                         f"sizes {args.micro_batch_sizes}; check the cluster and --micro-batch-sizes")
    if not res.fits:
        from ..planner.report import memory_fix
        raise AcesoError(memory_fix("no uniform configuration fits in memory: the least", max(res.stage_memory_mb),
                                    cm, cluster, training, training.micro_batch_sizes))
    plan = to_plan(res.evaluation, model, cluster, training, cm,
                   settings_from_args(args, training, model))     # the model in the precision it was priced
    from search.targets.preflight import preflight

    preflight(plan, target=args.target)     # the one pre-flight: it writes only a plan its target runs
    if args.output:
        write_output(plan.to_json(), args.output)
    f = res.state.features
    info = {"iteration_ms": round(res.iteration_ms, 4),
            **{k: round(v, 4) for k, v in plan_throughput(plan, res.iteration_ms, cm)._asdict().items()
               if v is not None}, "pp": res.pp,
            "tp": res.tp, "cp": res.cp, "dp": res.dp, "micro_batch_size": res.mbs,
            "micro_batch_per_rank": res.micro_batch_per_rank, "sequence_parallel": res.shape.sp,
            "virtual_stages": res.state.num_chunks, "distributed_optimizer": f.distributed_optimizer,
            "overlap_grad_reduce": f.overlap_grad_reduce, "overlap_param_gather": f.overlap_param_gather,
            "megatron_fsdp": f.fsdp or None, "activation_offload_layers": f.offload_layers or None,
            "target": args.target, "recompute": res.recompute, "layers_per_chunk": list(res.layers),
            "stage_time_ms": [round(t, 3) for t in res.stage_total_ms],
            "stage_memory_mib": [round(m, 1) for m in res.stage_memory_mb], "configs_evaluated": res.evaluated}
    if args.json:
        if args.output != "-":
            sys.stdout.write(json.dumps(info, indent=2) + "\n")
        return 0
    from rich.console import Console
    from rich.table import Table
    con = Console(file=sys.stderr if args.output == "-" else sys.stdout, width=140)
    t = Table(title=f"best uniform configuration: {model.name} on {cluster.label}, global batch "
                    f"{training.global_batch_size}")
    for col in ("pp", "tp", "cp", "dp", "micro-\nbatch", "mbs/\nrank", "sp", "vpp", "dist-\nopt", "over-\nlap",
                "recompute", "layers\nper chunk", "iteration\nms", "samples\n/s", "tokens/s\nper GPU", "MFU",
                "max mem\nMiB"):
        t.add_column(col, justify="right", overflow="fold")
    t.add_row(str(res.pp), str(res.tp), str(res.cp), str(res.dp), str(res.mbs), str(res.micro_batch_per_rank),
              "on" if res.shape.sp else "off", str(res.state.num_chunks), "on" if f.distributed_optimizer else "off",
              "on" if f.overlap_grad_reduce else "off", res.recompute, " ".join(map(str, res.layers)),
              f"{res.iteration_ms:.2f}", f"{info['samples_per_s']:.2f}", f"{info['tokens_per_s_per_gpu']:,.0f}",
              f"{100 * info['mfu']:.1f}%" if "mfu" in info else "-", f"{max(res.stage_memory_mb):.0f}")
    con.print(t)
    extra = [x for x in (f"megatron fsdp {f.fsdp}" if f.fsdp else "",
                         f"activation offload of {f.offload_layers} layers" if f.offload_layers else "") if x]
    con.print(f"{res.evaluated} uniform configurations priced in full" + (f"; {', '.join(extra)}" if extra else "")
              + f" (target {args.target})")
    return 0
