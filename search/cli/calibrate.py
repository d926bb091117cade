"""Fit the cost model to your own short runs: `aceso calibrate --run SCRIPT LOG [--run ...] --cluster C -o FILE`.

Each --run is a configuration and its log: a Megatron-LM launch script (read as `aceso import --from megatron-lm`
reads it) with the run's stdout (the `elapsed time per iteration (ms)`, `throughput per GPU` and memory report
lines Megatron-LM prints; the script read under --megatron-version, default the newest release), or an aceso plan JSON with its `aceso train --log-file` JSON lines.
The file written holds, per GPU type, the sustained GEMM and attention efficiency, the achieved link bandwidths,
the memory reserve, and every run's error before and after; give it to search, explain, baseline, validate and
export with --calibration FILE (docs/calibrate.md).

Example: aceso calibrate --run run.sh run.log --cluster 4x8-h100 -o calib.json
"""

from __future__ import annotations

import argparse
import os
import sys

from search.io.argtypes import positive_int
from search.io.errors import AcesoError
from search.io.files import read_text
from .common import add_gpu_file_arg, add_megatron_version_arg, check_output, print_json, write_output


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", nargs=2, action="append", metavar=("CONFIG", "LOG"), required=True,
                   help="a Megatron-LM launch script (or an aceso plan JSON) and its log; repeat for more runs")
    p.add_argument("--cluster", default=None, help="NODESxGPUS-gpu the Megatron-LM runs ran on (a plan: its own)")
    add_gpu_file_arg(p)
    p.add_argument("--vocab-size", type=positive_int, default=None,
                   help="Megatron-LM: the tokenizer's vocabulary, when the script does not say")
    add_megatron_version_arg(p, "the scripts were written for")
    p.add_argument("-o", "--output", default="-", help="calibration file to write, or - for stdout")
    p.add_argument("--json", action="store_true", help="print the residuals as JSON")


def _read_run(config: str, log: str, args: argparse.Namespace):
    from search.calibration.calibrate import Run, check_log
    from search.spec.cluster import parse_cluster
    from search.calibration.megatron_log import read_run_log
    text = read_text(config, label=config, missing="no such launch script or plan")
    cluster = parse_cluster(args.cluster) if args.cluster else None
    plan = None
    if text.lstrip().startswith("{"):
        from search.spec.plan import load_plan
        plan = load_plan(config)
        cluster = cluster or plan.cluster
        if cluster is None:
            raise AcesoError(f"{config}: the plan names no cluster; give --cluster NODESxGPUS-gpu")
    elif cluster is None:
        raise AcesoError(f"{config}: a Megatron-LM run needs --cluster NODESxGPUS-gpu (the GPUs it ran on)")
    measured = read_run_log(read_text(log, label=log, missing="no such log file"), log)
    label = f"{config} + {log}"
    if plan is not None:
        run = Run(label, plan.model_copy(update={"cluster": cluster}),
                  plan.predicted.attention if plan.predicted else None, "runtime", measured, digest=plan.digest())
        padded = None
    else:
        from ..megatron.importer import read_megatron
        imp = read_megatron(text, source=config, cluster=cluster, vocab_size=args.vocab_size,
                            version=args.megatron_version)
        run = Run(label, imp.plan, imp.config.attention, "megatron-lm", measured)
        padded = imp.config.model.padded_vocab_size      # Megatron-LM's: a multiple of the divisor x tp
    if run.plan.world_size != cluster.num_gpus:
        raise AcesoError(f"{config}: it runs on {run.plan.world_size} GPUs but --cluster {cluster.label} has "
                         f"{cluster.num_gpus}; give the cluster it ran on")
    check_log(run, cluster, padded)
    return run


def run(args: argparse.Namespace) -> int:
    from search.calibration.calibrate import calibrate
    check_output(args.output)
    runs = [_read_run(c, log, args) for c, log in args.run]
    file = calibrate(runs)
    write_output(file.to_json(), args.output)
    if args.json:
        print_json({g: [r.model_dump() for r in c.runs] for g, c in file.gpus.items()})
        return 0
    out = sys.stderr if args.output in (None, "-") else sys.stdout
    for gpu, c in file.gpus.items():
        links = ", ".join(f"{k} {v:.0f} GB/s" for k, v in (("intra-node", c.intra_node_gbps),
                                                           ("inter-node", c.inter_node_gbps)) if v)
        print(f"{gpu}: GEMM {c.gemm_efficiency:.3f}, attention {c.attention_efficiency:.3f} of peak"
              f"{', ' + links if links else ''}, memory reserve {c.memory_reserve_mib:.0f} MiB "
              f"(fitted: {', '.join(c.fitted) or 'nothing'}"
              f"{'; pinned at its bound: ' + ', '.join(c.pinned) if c.pinned else ''})", file=out)
        print(f"  {'run':50}{'measured ms':>12}{'before':>9}{'after':>9}{'mem MiB':>9}{'pred':>9}", file=out)
        for r in c.runs:
            mem = f"{r.measured_memory_mb:>9.0f}{r.predicted_memory_after_mb:>9.0f}" if r.measured_memory_mb \
                is not None else f"{'-':>9}{'-':>9}"
            name = " + ".join(os.path.basename(part) for part in r.run.split(" + "))
            print(f"  {name[-50:]:50}{r.measured_iteration_ms:>12.1f}{100 * r.error_before:>8.1f}%"
                  f"{100 * r.error_after:>8.1f}%{mem}", file=out)
    return 0
