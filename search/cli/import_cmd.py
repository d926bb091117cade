"""Make a plan from another format: `aceso import FILE [--from aceso-legacy|megatron-lm|megatron-bridge] -o plan.json`.

--from megatron-lm: FILE is a Megatron-LM launch script or argument file (- = stdin; or --args "..."); the plan
is what Megatron-LM runs with those flags, read under the release --megatron-version names (its flags, defaults and
rules; default the newest; a flag that release does not have is refused naming the closest one). The world size comes from the script's torchrun
(--nproc-per-node x --nnodes), --world-size or --cluster; with --cluster the plan also carries the analytic
prediction. The plan's ``settings`` are Megatron-LM's gradient-reduction dtype for those flags (bf16: fp32 unless
--grad-reduce-in-bf16), and the prediction is priced under them. MoE, MLA, MTP, FP8 / FP4 recipes, Megatron FSDP
and the software-stack flags are read and priced; flags aceso does not model (torch FSDP2, FP8 attention, a
batch-size ramp-up, ...: docs/megatron.md) are refused with one line; data, schedule, logging and checkpoint flags are accepted, any other unknown flag is listed in one warning; assumptions (the
vocabulary, approximations) are notes on stderr. See docs/megatron.md.

--from megatron-bridge: FILE is the Megatron-Bridge v0.3.1 recipe overrides YAML `aceso export --to megatron-bridge`
writes for a hybrid (Nemotron-H / Nemotron-3) model; the world size comes from its torchrun comment or --world-size.
A field whose value the plan read from it would not export back is refused with one line (search/megatron/bridge_hybrid.py).

--from aceso-legacy (default): FILE is an Aceso reference op-level config. Stage boundaries must fall on unit
boundaries (else an error naming the stage; `--snap` moves each to the nearest unit boundary). Each stage needs
one tp/dp for all its ops and algo 0. Op recompute flags that are not exactly a unit's none/selective/full pattern
take the smallest choice covering them; such approximations are reported on stderr. The model comes from
model_name/model_size (the preset with that aceso_db_key). With `--db DIR` the plan carries the aceso-compat
prediction (`predicted`), and stderr compares it with the reference's own evaluation of the config when the
import changed it. See docs/compat.md.
"""

from __future__ import annotations

import argparse
import sys

from search.io.errors import AcesoError
from search.io.files import read_text
from .common import add_gpu_file_arg, add_megatron_version_arg, add_memory_limit_arg, check_output, write_output


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default=None,
                   help="aceso-legacy: reference config JSON; megatron-lm: launch script or argument file (- = stdin)")
    p.add_argument("--from", dest="source", default="aceso-legacy",
                   choices=("aceso-legacy", "megatron-lm", "megatron-bridge"),
                   help="input format (default aceso-legacy)")
    p.add_argument("-o", "--output", default="-", help="plan file to write, or - for stdout")
    p.add_argument("--cluster", default=None, help="record this cluster in the plan (NODESxGPUS-gpu)")
    add_memory_limit_arg(p, help="with --cluster: per-GPU memory budget in MiB")
    add_gpu_file_arg(p)
    g = p.add_argument_group("--from megatron-lm")
    g.add_argument("--args", default=None, help="the Megatron-LM arguments as one string (instead of FILE)")
    g.add_argument("--world-size", type=int, default=None, help="GPUs of the run, when the command line has no "
                   "torchrun process count")
    g.add_argument("--vocab-size", type=int, default=None, help="the tokenizer's vocabulary, when the command line "
                   "does not say it")
    add_megatron_version_arg(g, "the script was written for")
    g = p.add_argument_group("--from aceso-legacy")
    g.add_argument("--snap", action="store_true", help="move stage boundaries to the nearest unit boundary")
    g.add_argument("--db", default=None,
                   help="Aceso database folder: add the aceso-compat prediction to the plan (cluster: --cluster, "
                        "else one node of V100s, the artifact's machine)")


def run(args: argparse.Namespace) -> int:
    if args.source == "aceso-legacy" and not args.config:
        raise AcesoError("give the reference config JSON file")
    check_output(args.output)   # before any work, whichever the source
    if args.source in ("megatron-lm", "megatron-bridge"):
        return _run_megatron(args)
    from search.spec.cluster import parse_cluster
    from ..compat.mapping import ref_to_plan
    from ..compat.refconfig import load_ref_config

    try:
        cfg = load_ref_config(args.config)
    except AcesoError as e:
        if "not valid JSON" not in str(e):
            raise
        raise AcesoError(f"{e}; a Megatron-LM launch script or argument file: add --from megatron-lm (a Megatron-"
                         "Bridge overrides file: --from megatron-bridge; the default, --from aceso-legacy, reads "
                         "the Aceso reference's config JSON)") from None
    cluster = parse_cluster(args.cluster, memory_limit_mb=args.memory_limit_mb) if args.cluster else None
    plan, notes = ref_to_plan(cfg, snap=args.snap, cluster=cluster, src=args.config)
    if args.db:
        plan, note = _predict(plan, cfg, args.db, cluster, changed=bool(notes))
        notes.append(note)
    write_output(plan.to_json(), args.output)
    for note in notes:
        print(f"aceso import: note: {note}", file=sys.stderr)
    return 0


def read_megatron_source(path: str | None, text: str | None) -> tuple[str, str]:
    """``(text, label)`` of a Megatron-LM command line given as a file, ``-`` (stdin) or a string."""
    if text is not None:
        if path:
            raise AcesoError("give the Megatron-LM arguments as a file or as --args/--megatron-args, not both")
        return text, "the arguments"
    if not path:
        raise AcesoError("give a Megatron-LM launch script or argument file (or the arguments as a string)")
    if path == "-":
        try:
            return sys.stdin.buffer.read().decode("utf-8"), "stdin"
        except UnicodeDecodeError as e:
            raise AcesoError(f"stdin: not a text file (not UTF-8 text at byte {e.start})") from None
    return read_text(path), path          # a folder, a binary or oversized file: one line naming it


def _run_megatron(args: argparse.Namespace) -> int:
    from search.spec.cluster import parse_cluster
    from ..megatron.importer import read_megatron
    text, label = read_megatron_source(args.config, args.args)
    cluster = parse_cluster(args.cluster, memory_limit_mb=args.memory_limit_mb) if args.cluster else None
    if args.source == "megatron-bridge":     # a hybrid model's recipe overrides (search/megatron/bridge_hybrid.py)
        from ..megatron.bridge_hybrid import read_overrides
        imp = read_overrides(text, label, world_size=args.world_size, cluster=cluster)
    else:
        imp = read_megatron(text, source=label, world_size=args.world_size, cluster=cluster,
                            vocab_size=args.vocab_size, version=args.megatron_version)
    plan = imp.plan
    if cluster is not None:
        plan = plan.model_copy(update={"predicted": predict(plan, imp.config.attention)})
    write_output(plan.to_json(), args.output)
    if imp.warning:
        print(f"aceso import: warning: {imp.warning}", file=sys.stderr)
    for note in imp.notes:
        print(f"aceso import: note: {note}", file=sys.stderr)
    return 0


def predict(plan, attention: str | None, kind: str = "analytic"):
    """The analytic prediction of an imported plan (with the attention kernel its --transformer-impl runs): the one
    price (``search.pricing``) under its own settings."""
    from search.spec.plan import PlanPrediction
    from ..planner.report import assumed_attention
    from search.pricing import plan_cost_model
    cm, plan, _ = plan_cost_model(plan, kind=kind, attention=attention or "auto")
    cost = cm.evaluate(plan)
    return PlanPrediction(cost_model=kind, iteration_time_ms=cost.iteration_ms, samples_per_s=cost.samples_per_s,
                          stage_time_ms=cost.pipeline.stage_total_ms, stage_memory_mb=[s.memory_mb for s in cost.stages],
                          attention=assumed_attention(cm))


def _predict(plan, cfg, db_dir: str, cluster, changed: bool):
    from search.spec.cluster import parse_cluster
    from ..compat.costmodel import make_compat_cost_model
    from ..compat.evaluate import evaluate_ref_config
    from search.spec.plan import PlanPrediction
    from search.spec.training import TrainingSpec

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
