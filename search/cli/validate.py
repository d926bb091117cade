"""Check a plan file: schema, coverage of the model's units, TP/DP divisibility, fit to a cluster or world size,
and memory.

The plan passes the one pre-flight of its target (search/targets/preflight.py; --target, default the plan's own
``settings.framework``, none: the aceso runtime) on its cluster's device: the capability table
(search/targets/capabilities.py: what that target runs, megatron-core's own rules such as the padded vocabulary dividing
every tp that shards it, what a CPU cluster cannot run) and, for the aceso runtime with the runtime installed, the
model's layer specs and megatron block as the runtime builds them. ``--target aceso`` answers exactly what
``aceso launch`` does on that device (``launch --cpu`` for a CPU cluster) before it starts anything.

With a cluster (--cluster, else the plan's own) the plan must also fit in its memory under the analytic cost model
(the per-stage peak against the GPU's memory or --memory-limit-mib), under the settings the plan carries
(``settings``: framework and gradient-reduction dtype); without one only the counts are checked, and
the output says so. Exit 2 with one line naming the stage and the fix when anything does not hold.
"""

from __future__ import annotations

import argparse

from search.io.argtypes import positive_int
from search.targets.capabilities import plan_target

TARGETS = {"aceso": "runtime", "megatron-lm": "megatron-lm", "megatron-bridge": "megatron-bridge"}
from ..costmodel.memory import headroom_verdict
from search.io.errors import AcesoError
from search.spec.plan import check_fits_cluster, check_recompute_applies, load_plan, span_text
from search.targets.preflight import preflight
from search.io.text import plural, shape
from .common import (add_calibration_arg, add_gpu_file_arg, add_headroom_arg, add_memory_limit_arg, calibrated,
                     print_json)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan JSON file")
    p.add_argument("--world-size", type=positive_int, default=None,
                   help="the number of processes it will be launched with")
    p.add_argument("--cluster", default=None, help="check against this cluster (NODESxGPUS-gpu); default: the plan's")
    p.add_argument("--target", choices=tuple(TARGETS), default=None,
                   help="who will run it: aceso (the aceso runtime: what aceso launch checks), megatron-lm, "
                        "megatron-bridge; default: the plan's own settings.framework (none: aceso)")
    add_memory_limit_arg(p)
    add_gpu_file_arg(p)
    add_headroom_arg(p)
    p.add_argument("--attention", choices=("auto", "flash", "unfused"), default=None,
                   help="attention kernel for the memory check (default: what the plan's prediction assumed, "
                        "else auto)")
    add_calibration_arg(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _memory(plan, cluster, attention: str) -> tuple[list[float], float, bool]:
    """Per-stage peak MiB under the analytic model (the one price, ``search.pricing``), the limit, and whether it
    assumed flash attention."""
    from search.pricing import plan_cost_model

    cm, priced, _ = plan_cost_model(plan, cluster=cluster, attention=attention)
    flash = bool(getattr(cm.source, "flash", False))
    check_recompute_applies(plan, flash, f"the analytic model assumes flash attention on {cluster.gpu.name} "
                                         f"(--attention {attention})")
    cost = cm.evaluate(priced)
    return [s.memory_mb for s in cost.stages], cost.memory_limit_mb, flash


def run(args: argparse.Namespace) -> int:
    from search.spec.cluster import parse_cluster

    plan = load_plan(args.plan, world_size=args.world_size)
    check_recompute_applies(plan)
    cluster = parse_cluster(args.cluster, memory_limit_mb=args.memory_limit_mb) if args.cluster else plan.cluster
    if cluster is not None and args.memory_limit_mb and not args.cluster:
        cluster = cluster.model_copy(update={"memory_limit_mb": args.memory_limit_mb})
    cluster = calibrated(args, cluster)
    memory = None
    if cluster is not None:
        try:
            check_fits_cluster(plan, cluster)
        except ValueError as e:
            raise AcesoError(f"{args.plan}: {e}") from None
    device = "cpu" if cluster is not None and cluster.gpu.name == "cpu" else "cuda"
    target = args.target or {v: k for k, v in TARGETS.items()}[plan_target(plan)]
    try:
        # the one pre-flight: will the target run it, on the cluster checked (--cluster's GPU, e.g. fp16 on a V100)?
        on = plan if cluster is None or cluster == plan.cluster else plan.model_copy(update={"cluster": cluster})
        runtime_checked = preflight(on, device, target=target)
    except AcesoError as e:
        raise AcesoError(f"{args.plan}: {e}") from None
    if cluster is not None:
        attention = args.attention or (plan.predicted.attention if plan.predicted else None) or "auto"
        mem, limit, _ = _memory(plan, cluster, attention)
        worst = max(range(len(mem)), key=lambda i: mem[i])
        if mem[worst] > limit:
            raise AcesoError(
                f"{args.plan}: stages[{worst}] needs {mem[worst]:.0f} MiB per GPU (analytic cost model, "
                f"--attention {attention}) but {cluster.label} allows {limit:.0f} MiB; search the plan again for "
                "this cluster" + (f", or raise --memory-limit-mib (the {cluster.gpu.name} has {gpu_mb:.0f} MiB)"
                                  if mem[worst] <= (gpu_mb := cluster.gpu.memory_gib * 1024) else ""))
        verdict = headroom_verdict(mem[worst], limit, args.memory_headroom)
        if verdict:
            raise AcesoError(f"{args.plan}: stages[{worst}] {verdict} (analytic cost model, --attention {attention})")
        memory = {"stage_memory_mib": [round(m, 1) for m in mem], "memory_limit_mib": round(limit, 1),
                  "memory_headroom": args.memory_headroom,
                  "cost_model": "analytic", "attention": attention}
    summary = {"valid": True, "target": target, "device": device, "model": plan.model.name,
               "world_size": plan.world_size,
               "num_stages": plan.num_stages, "micro_batch_size": plan.micro_batch_size,
               "global_batch_size": plan.global_batch_size, "cluster": cluster.label if cluster else None,
               "memory_checked": memory is not None, **(memory or {}), "runtime_checked": runtime_checked,
               "stages": [{"num_gpus": s.num_gpus, "tp": s.tp, "cp": s.cp, "dp": s.dp, "micro_batch_per_rank":
                           plan.micro_batch_per_rank(i), "units": [list(span) for span in s.spans]}
                          for i, s in enumerate(plan.stages)]}
    if args.json:
        print_json(summary)
        return 0
    shapes = ", ".join(f"{s.num_gpus}gpu {shape(s)} units " + " ".join(span_text(a, b) for a, b in s.spans)
                       for s in plan.stages)
    print(f"{args.plan}: valid plan for {plan.model.name} on {plan.world_size} GPUs, "
          f"{plural(plan.num_stages, 'stage')} ({shapes}); target {target}"
          + (" (what aceso launch runs)" if target == "aceso" else ""))
    if not runtime_checked:
        print("pre-flight: the capability table's rules ran; layer specs and megatron block not fully checked: this "
              "machine lacks the runtime, transformer-engine or the megatron-core the plan needs (0.19 for a hybrid "
              "model; the workers check them before they start)")
    if memory is None:
        print("memory not checked: the plan names no cluster; give --cluster NODESxGPUS-gpu to check it")
    else:
        print(f"fits {cluster.label}: at most {max(memory['stage_memory_mib']):.0f} of "
              f"{memory['memory_limit_mib']:.0f} MiB per GPU, within the {100 * args.memory_headroom:g}% "
              "--memory-headroom (analytic cost model)")
    return 0
