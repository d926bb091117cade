"""Search the best heterogeneous parallel plan (Aceso's iterative bottleneck alleviation + exact refinements).

Example: aceso search --model gpt-1.3b --cluster 1x8-h100 --global-batch-size 512 -o plan.json

The budget is counted in plan evaluations (--budget-evals), so the same inputs and --seed give the same plan on
any machine; --budget-s adds a wall-clock cap (then results may depend on the CPU). Ctrl-C stops the search and
writes the best plan found so far (SIGTERM too). Exit 2 when nothing fits, with what would make it fit.

Words: a unit is half a transformer layer (its attention or its MLP half; a T5 decoder layer has three), the
granularity of stage boundaries and recompute. The plan's micro-batch is the pipeline micro-batch: a stage with
data parallelism dp runs micro-batch / dp samples per rank (mbs/rank, Megatron-LM's --micro-batch-size).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..argtypes import positive_float, positive_int, seed
from ..errors import AcesoError
from .common import add_cluster_args, add_model_args, check_output, cluster_from_args, model_from_args, write_outputs

DEFAULT_BUDGET = 4000


def add_training_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--global-batch-size", type=positive_int, required=True, help="samples per optimizer step")
    p.add_argument("--micro-batch-sizes", type=positive_int, nargs="+", default=[1, 2, 4, 8],
                   help="candidate pipeline micro-batch sizes (default 1 2 4 8)")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default=None,
                   help="training precision (default: the model's params_dtype)")
    p.add_argument("--cost-model", choices=("analytic", "profile", "aceso-compat"), default="analytic",
                   help="analytic (default), profile (--db profile database) or aceso-compat (--db Aceso database)")
    p.add_argument("--db", default=None, help="database for --cost-model profile / aceso-compat")
    p.add_argument("--attention", choices=("auto", "flash", "unfused"), default="auto",
                   help="analytic model: attention kernel the runtime will use (flash = transformer-engine installed; "
                        "unfused = without it; auto = flash on A100/H100/H200)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_cluster_args(p)
    add_training_args(p)
    p.add_argument("--budget-evals", type=positive_int, default=DEFAULT_BUDGET,
                   help=f"plan evaluations over all stage counts (default {DEFAULT_BUDGET})")
    p.add_argument("--budget-s", type=positive_float, default=None, help="optional wall-clock cap, seconds")
    p.add_argument("--top-k", type=positive_int, default=1,
                   help="also write the k-1 next best plans (PLAN.top2.json ...)")
    p.add_argument("--seed", type=seed, default=0, help="seed (the search is deterministic for a given seed)")
    p.add_argument("--workers", type=positive_int, default=None,
                   help="worker processes over stage counts (default: CPU count, at most 8; results do not "
                        "depend on it)")
    p.add_argument("--trace", default=None, help="write the accepted moves as JSON to this file")
    p.add_argument("--json", action="store_true", help="print a machine-readable summary")
    p.add_argument("-o", "--output", default=None, help="write the best plan (ParallelPlan JSON) here; - = stdout")


def training_from_args(args, model):
    import pydantic

    from ..errors import format_validation_error
    from ..training import TrainingSpec
    if args.global_batch_size < 1:
        raise AcesoError(f"--global-batch-size ({args.global_batch_size}) must be at least 1")
    try:
        return TrainingSpec(global_batch_size=args.global_batch_size, micro_batch_sizes=args.micro_batch_sizes,
                            precision=args.precision or model.params_dtype, attention=args.attention)
    except pydantic.ValidationError as e:
        raise AcesoError(format_validation_error(e)) from None


def setup(args):
    """model, cluster, training, cost model from the shared arguments; says once on stderr which stage shapes
    the cost model does not cover (aceso-compat: unprofiled (per-GPU batch, tp) files), which plans then skip."""
    from ..planner.api import build_cost_model, describe_dropped, search_space
    model = model_from_args(args)
    cluster = cluster_from_args(args)
    training = training_from_args(args, model)
    cm = build_cost_model(model, cluster, training, args.cost_model, args.db)
    note = describe_dropped(search_space(cm, training))
    if note:
        print(f"aceso {getattr(args, 'command', None) or 'search'}: {note}", file=sys.stderr)
    return model, cluster, training, cm


def run(args: argparse.Namespace) -> int:
    from ..planner import report
    from ..planner.aceso import SearchOptions
    from ..planner.api import plan_baseline, plan_search

    if args.budget_evals < 1:
        raise AcesoError(f"--budget-evals ({args.budget_evals}) must be at least 1")
    if args.top_k < 1:
        raise AcesoError(f"--top-k ({args.top_k}) must be at least 1")
    check_output(args.output)
    check_output(args.trace, "--trace")
    model, cluster, training, cm = setup(args)
    workers = args.workers or min(os.cpu_count() or 1, 8)
    base = plan_baseline(cm, training)
    with report.progress(args.budget_evals, quiet=args.json) as tick:
        opts = SearchOptions(budget_evals=args.budget_evals, budget_s=args.budget_s, seed=args.seed,
                             workers=workers, callback=tick)
        result, space = plan_search(cm, training, opts, top_k=args.top_k,
                                    baseline=base if base is not None and base.fits else None)
    best = result.plans[0] if result.plans else None
    if best is None and args.budget_s is not None and base is not None:
        raise AcesoError(f"--budget-s {args.budget_s:g}: the search evaluated no plan in that time; raise it, or "
                         "drop it (--budget-evals alone bounds the search)")
    if best is None or not best.fits:
        raise AcesoError(report.infeasible_hint(best, cm, cluster, training, space))
    plans = [report.to_plan(e, model, cluster, training, cm) for e in result.plans if e.fits]
    out = args.output
    files = [(plans[0].to_json(), out, "-o")] if out else []   # written as one: a failing --trace writes no plan
    if out and out != "-":
        p = Path(out)
        files += [(extra.to_json(), str(p.with_name(f"{p.stem}.top{k}{p.suffix}")), "-o")
                  for k, extra in enumerate(plans[1:], start=2)]
    if args.trace:
        files.append((json.dumps([m.as_dict() for m in result.moves], indent=2) + "\n", args.trace, "--trace"))
    write_outputs(files)
    summary = report.summary(plans[0], best, base, result, cm)
    if args.json:
        sys.stdout.write(json.dumps(summary, indent=2) + "\n") if out != "-" else None
    else:
        report.print_table(plans[0], best, base, result, cm, file=sys.stderr if out == "-" else sys.stdout)
    if result.interrupted:
        print("aceso search: interrupted; wrote the best plan found so far", file=sys.stderr)
        return 130
    return 0
