"""Convert an Aceso reference op-level config to a plan: `aceso import REFCONFIG.json -o plan.json [--snap]`.

Stage boundaries must fall on unit boundaries (else an error naming the stage; `--snap` moves each to the nearest
unit boundary). Each stage needs one tp/dp for all its ops and algo 0. Op recompute flags that are not exactly a
unit's none/selective/full pattern take the smallest choice covering them; such approximations are reported on
stderr. The model comes from model_name/model_size (the preset with that aceso_db_key). With `--db DIR` the plan
carries the aceso-compat prediction (`predicted`), and stderr compares it with the reference's own evaluation of
the config when the import changed it. See docs/compat.md.
"""

from __future__ import annotations

import argparse
import sys

from .common import check_output, write_output


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="reference config JSON (the Aceso artifact's op-level format)")
    p.add_argument("-o", "--output", default="-", help="plan file to write, or - for stdout")
    p.add_argument("--snap", action="store_true", help="move stage boundaries to the nearest unit boundary")
    p.add_argument("--cluster", default=None, help="record this cluster in the plan (NODESxGPUS-gpu)")
    p.add_argument("--db", default=None,
                   help="Aceso database folder: add the aceso-compat prediction to the plan (cluster: --cluster, "
                        "else one node of V100s, the artifact's machine)")


def run(args: argparse.Namespace) -> int:
    from ..cluster import parse_cluster
    from ..compat.mapping import ref_to_plan
    from ..compat.refconfig import load_ref_config

    check_output(args.output)
    cfg = load_ref_config(args.config)
    cluster = parse_cluster(args.cluster) if args.cluster else None
    plan, notes = ref_to_plan(cfg, snap=args.snap, cluster=cluster, src=args.config)
    if args.db:
        plan, note = _predict(plan, cfg, args.db, cluster, changed=bool(notes))
        notes.append(note)
    write_output(plan.to_json(), args.output)
    for note in notes:
        print(f"aceso import: note: {note}", file=sys.stderr)
    return 0


def _predict(plan, cfg, db_dir: str, cluster, changed: bool):
    from ..cluster import parse_cluster
    from ..compat.costmodel import make_compat_cost_model
    from ..compat.evaluate import evaluate_ref_config
    from ..plan import PlanPrediction
    from ..training import TrainingSpec

    cluster = cluster or parse_cluster(f"1x{plan.world_size}-v100")
    cm = make_compat_cost_model(plan.model, cluster, TrainingSpec(global_batch_size=plan.global_batch_size,
                                                                   micro_batch_sizes=[plan.micro_batch_size]), db_dir)
    cost = cm.evaluate(plan)
    pred = PlanPrediction(cost_model="aceso-compat", iteration_time_ms=cost.iteration_ms,
                          samples_per_s=cost.samples_per_s, stage_time_ms=cost.pipeline.stage_total_ms,
                          stage_memory_mb=[s.memory_mb for s in cost.stages])
    note = f"aceso-compat predicts {cost.iteration_ms:.2f} ms per iteration"
    if changed:
        ref = evaluate_ref_config(cfg, cm.db, gpus_per_node=cluster.gpus_per_node)
        note += f" (the config as given: {ref.iteration_ms:.2f} ms)"
    return plan.model_copy(update={"predicted": pred}), note
