"""Predict a plan's iteration time and memory per stage, and name its bottleneck.

PLAN is our plan JSON or a reference (Aceso legacy) config (one with num_ops_in_each_stage); or, instead of PLAN,
--megatron-args "ARGS..." / --megatron-args-file run.sh: a Megatron-LM command line (needs --cluster), reported like
any plan plus what a short aceso search on the same model and cluster would gain (docs/megatron.md). With
--cost-model aceso-compat a reference config is evaluated exactly as given, op by op, as the reference does;
the other cost models need our format, so it is converted with the compat importer (--snap moves boundaries that
fall inside a unit). The model, cluster and global batch size come from
the plan unless given. --cost-model analytic (default, no measurements needed), profile (--db FILE|DIR, see
docs/profile-db.md) or aceso-compat (--db DIR of an Aceso database).

The table's units are half layers (attention or MLP; T5 decoder layers have three; an MoE layer's are attention and
moe, each MTP layer one mtp unit); mbs/rank is the samples per
rank and micro-batch, Megatron-LM's --micro-batch-size (the pipeline micro-batch / the stage's dp).
A plan is priced under the settings it carries (``settings``: the framework and gradient-reduction dtype it was
searched for; none: our runtime), a Megatron-LM command line under its own flags (``--grad-reduce-in-bf16``);
--framework megatron-lm / megatron-bridge / runtime prices it with that framework's defaults instead (Megatron-LM
and Bridge reduce bf16 gradients in fp32). The report lists the plan's parallel features (SP, CP, virtual stages, distributed
optimizer, overlaps) and, per stage and iteration, every communication kind's exposed time (on the stage's critical
path) and hidden time (behind compute).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pydantic

from .. import plots
from search.io.argtypes import positive_int
from search.io.errors import AcesoError, as_aceso_error, read_json
from search.settings.fsdp import describe as fsdp_describe
from search.spec.plan import RECOMPUTE_CHOICES, ParallelPlan, check_recompute_applies, parse_plan, span_text
from search.settings.plan_settings import FRAMEWORKS
from search.settings.precision import PRECISIONS
from search.spec.training import TrainingSpec
from search.io.text import shape as stage_shape
from search.costmodel.throughput import Throughput
from .common import (add_calibration_arg, add_cluster_args, add_megatron_version_arg, add_release_arg,
                     calibrated, print_json, release_of)

CATEGORIES = ("params", "grads", "optimizer", "activations", "recompute_peak", "p2p_buffers", "grad_copy", "reserve")
SEARCH_BUDGET = 600    # explain's searches: --budget-evals in the commands it prints
COMM_KINDS = ("tp", "cp", "ep", "p2p", "dp", "edp", "param_gather", "edp_param_gather", "embedding_grads",
              "fsdp_param_gather", "fsdp_grad_reduce", "offload")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", nargs="?", default=None, help="plan JSON (ours or a reference config)")
    p.add_argument("--megatron-args", default=None, help="a Megatron-LM command line instead of PLAN (quoted)")
    p.add_argument("--megatron-args-file", default=None, help="a Megatron-LM launch script or argument file")
    p.add_argument("--world-size", type=int, default=None, help="Megatron-LM: GPUs, when the command line does "
                   "not say (default: the cluster's)")
    p.add_argument("--vocab-size", type=int, default=None, help="Megatron-LM: the tokenizer's vocabulary, when the "
                   "command line does not say")
    p.add_argument("--search-budget-evals", type=int, default=None, help="Megatron-LM: --budget-evals of the two "
                   f"searches it compares with (default {SEARCH_BUDGET}; 0 skips them)")
    p.add_argument("--save-best", default=None, metavar="FILE",
                   help="Megatron-LM: write the drop-in plan to FILE and the heterogeneous one to FILE.aceso.json "
                        "(what the printed aceso search commands write with -o)")
    add_megatron_version_arg(p, "the command line was written for")
    p.add_argument("--model", default=None, help="preset or spec file; default: the plan's model")
    p.add_argument("--num-layers", type=positive_int, default=None, help="with --model: override the preset's depth")
    add_cluster_args(p, required=False)
    add_calibration_arg(p)
    p.add_argument("--global-batch-size", type=positive_int, default=None, help="default: the plan's")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="default: the model's params_dtype")
    p.add_argument("--cost-model", choices=("analytic", "profile", "aceso-compat"), default="analytic")
    p.add_argument("--attention", choices=("auto", "flash", "unfused"), default=None,
                   help="analytic model: attention kernel (default: what the plan's prediction assumed, else auto)")
    p.add_argument("--db", default=None, help="profile database (profile) or Aceso database folder (aceso-compat)")
    p.add_argument("--framework", choices=FRAMEWORKS, default=None,
                   help="who runs the plan: default the plan's own settings (what it was priced under; none: our "
                        "runtime), with --megatron-args the command line's; another framework: its defaults "
                        "(megatron-lm / megatron-bridge with bf16: gradients reduced in fp32)")
    add_release_arg(p)
    p.add_argument("--snap", action="store_true", help="reference configs: move boundaries to unit boundaries")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    plots.add_arguments(p, "the pipeline timeline and the memory per stage")


def _read_plan(args: argparse.Namespace, raw: object) -> tuple[ParallelPlan, list[str]]:
    path = Path(args.plan)
    if isinstance(raw, dict) and "num_ops_in_each_stage" in raw:
        try:
            from ..compat.mapping import ref_to_plan
            from ..compat.refconfig import parse_ref_config
        except ImportError:
            raise AcesoError(f"{path}: a reference (Aceso legacy) config, but the compat importer is not "
                             "available in this version; convert it to our plan format first") from None
        return ref_to_plan(parse_ref_config(raw, src=str(path)), snap=args.snap, src=str(path))
    if isinstance(raw, dict) and "family" in raw and "stages" not in raw:
        raise AcesoError(f"{path}: a model spec, not a plan; explain wants a plan: make one with "
                         f"`aceso search --model {path} --cluster ... --global-batch-size ...`")
    return parse_plan(raw, source=str(path)), []


def _resolve(args: argparse.Namespace, plan: ParallelPlan):
    """(plan, cluster, attention) with the command-line overrides applied and checked."""
    from search.spec.cluster import parse_cluster
    from search.spec.presets import load_model
    recorded = plan.predicted       # the prediction is re-made here; its attention kernel is the default one
    data = plan.model_dump(exclude={"predicted"})
    if args.model:
        model = load_model(args.model, num_layers=args.num_layers)
        if model.num_units != plan.model.num_units:
            raise AcesoError(f"--model {args.model} has {model.num_units} units but the plan covers "
                             f"{plan.model.num_units}; use the plan's model or --num-layers")
        data["model"] = model.model_dump()
    if args.cluster:
        cluster = parse_cluster(args.cluster, memory_limit_mb=args.memory_limit_mb)
    elif plan.cluster is not None:
        cluster = plan.cluster
        if args.memory_limit_mb is not None:
            cluster = _with_limit(cluster, args.memory_limit_mb)
    else:
        raise AcesoError(f"{args.plan}: the plan names no cluster; give --cluster NODESxGPUS-gpu")
    cluster = calibrated(args, cluster)
    data["cluster"] = cluster.model_dump()
    if args.global_batch_size is not None:
        data["global_batch_size"] = args.global_batch_size
    release = release_of(args)
    if release is not None:          # the release priced: the plan's settings say it (search/settings/releases.py)
        data["settings"] = {**(data.get("settings") or {}), "release": release}
    try:
        plan = ParallelPlan.model_validate(data)
    except pydantic.ValidationError as e:
        raise AcesoError(f"{args.plan}: " + str(as_aceso_error(e))) from None
    attention = args.attention or (recorded.attention if recorded else None) or "auto"
    return plan, cluster, attention


def _with_limit(cluster, memory_limit_mb: float):
    from search.spec.cluster import ClusterSpec

    try:
        return ClusterSpec.model_validate({**cluster.model_dump(), "memory_limit_mib": memory_limit_mb})
    except pydantic.ValidationError as e:
        raise AcesoError(f"--memory-limit-mib {memory_limit_mb:g}: " + str(as_aceso_error(e))) from None


def report(cost, shapes: list[dict], model: str, micro_batch_size: int, global_batch_size: int,
           features: dict | None = None) -> dict:
    """The JSON form of a PlanCost; ``shapes[i]`` describes stage i (gpus, tp, dp, its span, its recompute);
    ``features``: the plan's parallel features (shown as given)."""
    num_micro_batches = global_batch_size // micro_batch_size
    pipe = cost.pipeline
    stages = []
    for i, (shape, sc) in enumerate(zip(shapes, cost.stages)):
        busy = pipe.stage_busy_ms[i] if pipe.stage_busy_ms else \
            num_micro_batches * sc.time_per_microbatch_ms + sc.dp_sync_ms + sc.optimizer_ms
        comm = {k: {"exposed_ms": e, "hidden_ms": h} for k, (e, h) in sorted(
            sc.comm.items(), key=lambda kv: COMM_KINDS.index(kv[0]) if kv[0] in COMM_KINDS else 99)}
        stages.append({
            "index": i, **shape, "micro_batch_per_rank": micro_batch_size // shape["dp"],
            "fwd_ms": sc.fwd_ms, "bwd_ms": sc.bwd_ms, "recompute_ms": sc.recompute_ms,
            "p2p_ms": sc.p2p_ms, "tp_comm_ms": sc.tp_comm_ms, "dp_sync_ms": sc.dp_sync_ms,
            "optimizer_ms": sc.optimizer_ms, "prologue_ms": getattr(sc, "prologue_ms", 0.0),
            "time_per_microbatch_ms": sc.time_per_microbatch_ms, "time_ms": pipe.stage_total_ms[i],
            "busy_ms": busy, "bubble_ms": max(0.0, cost.iteration_ms - busy),
            "comm": comm, "comm_exposed_ms": sum(e for e, _ in sc.comm.values()),
            "comm_hidden_ms": sum(h for _, h in sc.comm.values()),
            "memory_mib": sc.memory_mb, "memory_breakdown_mib": dict(sc.memory_breakdown), "fits": bool(sc.fits),
            "terms_ms": dict(getattr(sc, "terms", {}) or {})})
    return {"model": model, "cost_model": cost.cost_model, "num_micro_batches": num_micro_batches,
            "features": features or {},
            "micro_batch_size": micro_batch_size, "global_batch_size": global_batch_size,
            "iteration_time_ms": cost.iteration_ms, "samples_per_s": cost.samples_per_s,
            "bubble_ms": cost.pipeline.bubble_ms, "tokens_per_s_per_gpu": cost.tokens_per_s_per_gpu,
            "tflops_per_gpu": cost.tflops_per_gpu, "mfu": cost.mfu,
            "max_memory_mib": cost.max_memory_mb, "memory_limit_mib": cost.memory_limit_mb, "fits": bool(cost.fits),
            "bottleneck_stage": cost.bottleneck_stage, "bottleneck_resource": cost.bottleneck_resource,
            "warnings": list(cost.warnings), "stages": stages}


def _target(args: argparse.Namespace, plan):
    """``--framework``; megatron-bridge over a plan of another framework with no ``--release``: at the release the
    Bridge export of the plan runs (``bridge_hybrid.plan_core``), as ``search --target megatron-bridge`` prices it."""
    if args.framework != "megatron-bridge" or release_of(args) is not None \
            or plan.settings.framework == "megatron-bridge":
        return args.framework
    from search.settings.plan_settings import Target
    from ..megatron.bridge_hybrid import plan_core
    return Target("megatron-bridge", plan_core(plan))


def _plan_report(args: argparse.Namespace, raw: object) -> tuple[dict, list[str], str]:
    """Our plan (or a reference config converted to one) under any cost model."""
    from search.costmodel.plan_view import describe
    from search.pricing import plan_cost_model
    plan, notes = _read_plan(args, raw)
    notes = notes + _other_cost_model(plan, args.cost_model) + _framework_refusal(plan, args.framework)
    plan, cluster, attention = _resolve(args, plan)
    cm, plan, spec = plan_cost_model(plan, _target(args, plan), cluster=cluster, kind=args.cost_model, db=args.db,
                                     attention=attention, precision=args.precision)
    priced = None
    if args.cost_model != "aceso-compat":
        priced = {**spec.model_dump(), "text": describe(spec, cm.training.precision)}
    flash = getattr(getattr(cm, "source", None), "flash", None)
    check_recompute_applies(plan, flash, f"the analytic model assumes flash attention on {cluster.gpu.name} "
                                         f"(--attention {attention})")
    cost = cm.evaluate(plan)
    shapes = [_stage_shape(st) for st in plan.stages]
    out = report(cost, shapes, plan.model.name, plan.micro_batch_size, plan.global_batch_size,
                 plan_features(plan))
    if priced:
        out["settings"] = priced
    if args.cost_model != "aceso-compat":
        _headroom(out, args.memory_headroom)
    plots.draw_explain(args, cm, cost, dict(out, cluster=cluster.label), plan)
    return out, notes, cluster.label


def _framework_refusal(plan: ParallelPlan, framework: str | None) -> list[str]:
    """A note when ``--framework`` names a framework that does not run the plan as it is (the one pre-flight's
    capability table, what ``aceso validate --target`` says): the price is then what that framework's defaults would
    cost, not a run it offers."""
    if framework is None or framework == plan.settings.framework:
        return []
    from search.targets.capabilities import plan_refusal
    from search.targets.preflight import target_device
    why = plan_refusal(plan, framework, target_device(plan))
    return [f"--framework {framework} does not run this plan as it is ({why}); the price is the plan under its "
            "defaults, not a run it offers"] if why else []


def _other_cost_model(plan: ParallelPlan, kind: str) -> list[str]:
    """A note when the plan's recorded prediction came from another cost model than this price (a plan searched
    with --cost-model profile, explained without it, gets the analytic model's numbers)."""
    pred = plan.predicted
    if pred is None or not pred.cost_model or pred.cost_model == kind:
        return []
    db = " --db DB" if pred.cost_model in ("profile", "aceso-compat") else ""
    return [f"the plan was predicted with the {pred.cost_model} cost model ({pred.iteration_time_ms:.2f} ms per "
            f"iteration); this is the {kind} model's price: give --cost-model {pred.cost_model}{db} to explain that "
            "prediction"]


def _headroom(out: dict, headroom: float) -> None:
    """The --memory-headroom verdict (``memory.headroom_verdict``), in the report and among its warnings."""
    from ..costmodel.memory import headroom_verdict, memory_budget_mb

    verdict = headroom_verdict(out["max_memory_mib"], out["memory_limit_mib"], headroom)
    out.update(memory_headroom=headroom, memory_budget_mib=memory_budget_mb(out["memory_limit_mib"], headroom),
               within_headroom=verdict is None)
    if verdict:
        worst = max(range(len(out["stages"])), key=lambda i: out["stages"][i]["memory_mib"])
        out["warnings"].append(f"stage {worst} " + verdict)


def plan_features(plan: ParallelPlan) -> dict:
    """The plan's parallel features, for the report."""
    return {"sequence_parallel": [i for i, st in enumerate(plan.stages) if st.sequence_parallel],
            "context_parallel": {i: st.cp for i, st in enumerate(plan.stages) if st.cp > 1},
            "virtual_stages": plan.num_virtual_stages, "distributed_optimizer": plan.distributed_optimizer,
            "overlap_grad_reduce": plan.overlap_grad_reduce, "overlap_param_gather": plan.overlap_param_gather,
            "tp_comm_overlap": plan.tp_comm_overlap, "fsdp_offload": fsdp_describe(plan)}


def _stage_shape(st) -> dict:
    rc = st.all_recompute
    return {"num_gpus": st.num_gpus, "tp": st.tp, "cp": st.cp, "dp": st.dp, "sp": st.sequence_parallel,
            "units": [list(span) for span in st.spans] if st.num_chunks > 1 else [st.start_unit, st.end_unit],
            "recompute": {c: rc.count(c) for c in RECOMPUTE_CHOICES if rc.count(c)}}


def _ref_report(args: argparse.Namespace, raw: dict) -> tuple[dict, list[str], str]:
    """A reference config under aceso-compat, op by op (no conversion to units): the reference's own numbers."""
    from search.spec.cluster import parse_cluster
    from ..compat.costmodel import make_compat_cost_model
    from ..compat.mapping import model_for_key
    from ..compat.refconfig import parse_ref_config

    cfg = parse_ref_config(raw, src=args.plan)
    model = model_for_key(cfg.key, cfg.num_layers)
    cluster = parse_cluster(args.cluster or f"1x{sum(cfg.num_gpus)}-v100", memory_limit_mb=args.memory_limit_mb)
    training = TrainingSpec(global_batch_size=cfg.global_batch_size, micro_batch_sizes=[cfg.micro_batch_size],
                            precision="fp16")
    cm = make_compat_cost_model(model, cluster, training, args.db)
    cost = cm.evaluate_ref(cfg)
    bounds = [sum(cfg.num_ops[:i]) for i in range(cfg.num_stages + 1)]
    shapes = [{"num_gpus": cfg.num_gpus[i], "tp": max(cfg.tp[i]), "dp": max(cfg.dp[i]),
               "ops": [bounds[i], bounds[i + 1]], "recompute": {"ops": sum(cfg.recompute[i])}}
              for i in range(cfg.num_stages)]
    out = report(cost, shapes, model.name, cfg.micro_batch_size, cfg.global_batch_size)
    plots.draw_explain(args, cm, cost, dict(out, cluster=cluster.label))
    return out, ["reference config evaluated op by op, exactly as given"], cluster.label


def _megatron_plan(args: argparse.Namespace):
    """The plan a Megatron-LM command line runs (--megatron-args / --megatron-args-file), as plan JSON."""
    import json

    from search.spec.cluster import parse_cluster
    from ..megatron.importer import read_megatron
    from .import_cmd import read_megatron_source
    if args.plan:
        raise AcesoError("give PLAN or --megatron-args/--megatron-args-file, not both")
    if not args.cluster:
        raise AcesoError("--megatron-args needs --cluster NODESxGPUS-gpu (the GPUs it runs on)")
    text, label = read_megatron_source(args.megatron_args_file, args.megatron_args)
    imp = read_megatron(text, source=label, world_size=args.world_size, vocab_size=args.vocab_size,
                        cluster=parse_cluster(args.cluster, memory_limit_mb=args.memory_limit_mb),
                        version=args.megatron_version, release=release_of(args))
    args.plan = label
    args.attention = args.attention or imp.config.attention
    notes = ([imp.warning] if imp.warning else []) + imp.notes
    return json.loads(imp.plan.to_json()), notes


def run(args: argparse.Namespace) -> int:
    from .explain_search import check_save_best

    plots.target(args.plot, args.plot_format)   # before any work: a bad --plot or no matplotlib is exit 2
    megatron = args.megatron_args is not None or args.megatron_args_file is not None
    if args.save_best is not None and not megatron:
        raise AcesoError("--save-best is for --megatron-args / --megatron-args-file (the plans of the searches it "
                         "compares with); for a plan file use aceso search -o")
    check_save_best(args.save_best)
    if megatron:
        raw, mnotes = _megatron_plan(args)
    elif args.plan:
        raw = read_json(args.plan, missing="no such plan file")
    else:
        raise AcesoError("give a plan file, or --megatron-args / --megatron-args-file")
    exact = args.cost_model == "aceso-compat" and not args.snap and isinstance(raw, dict) \
        and "num_ops_in_each_stage" in raw
    out, notes, cluster = (_ref_report if exact else _plan_report)(args, raw)
    out["notes"] = (mnotes if megatron else []) + notes
    out["cluster"] = cluster
    gain, saved = _search_lines(args, raw, out) if megatron else (None, None)
    if args.json:
        print_json(out)
    else:
        from ..planner.report import units_text
        _print_table(out, "half layers" if exact else units_text(parse_plan(raw, source=args.plan).model))
        if gain:
            from .explain_search import text_lines
            print("\n".join(text_lines(gain, saved)))
    return 0


def _search_lines(args: argparse.Namespace, raw: dict, out: dict) -> tuple[dict | None, list[str] | None]:
    """The two ``aceso search`` lines (``explain_search``), in ``out["megatron_search"]``; the files written."""
    from .explain_search import save, search_lines
    budget = SEARCH_BUDGET if args.search_budget_evals is None else args.search_budget_evals
    if budget < 1:
        return None, None
    plan, _, _ = _resolve(args, parse_plan(raw, source=args.plan))
    gain = search_lines(plan, out["iteration_time_ms"], args, budget, args.save_best)
    out["megatron_search"] = {k: ({kk: vv for kk, vv in v.items() if kk != "plan"} if isinstance(v, dict) else v)
                              for k, v in gain.items()}
    saved = save(gain, plan, args.save_best) if args.save_best else None
    if saved:
        out["megatron_search"]["saved"] = saved
    return gain, saved


def _print_table(r: dict, units: str = "half layers") -> None:
    """The per-stage table in 132 columns (the memory breakdown in full: --json)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from search.spec.plan import recompute_text
    t = Table(title=f"{r['model']} on {r['cluster']} ({r['cost_model']} cost model): {r['num_micro_batches']} "
                    f"pipeline micro-batches of {r['micro_batch_size']}", box=box.SIMPLE_HEAD, padding=(0, 1),
              collapse_padding=True, pad_edge=False, show_edge=False)
    cols = ["stage", "shape", "mbs/\nrank", "units", "recompute", "fwd\nms", "bwd\nms", "recomp\nms",
            "comm ms\nexp/hid", "sync\nms", "total\nms", "states\nGiB", "act\nGiB", "mem\nGiB", "fits"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("units", "recompute", "fits") else "right", overflow="fold",
                     no_wrap=c not in ("units", "recompute"))
    for s in r["stages"]:
        mb = s["memory_breakdown_mib"]
        states = sum(mb.get(c, 0.0) for c in ("params", "grads", "optimizer")) / 1024
        per_rank = r["micro_batch_size"] // s["dp"]
        shape = stage_shape(s)
        comm = f"{s.get('comm_exposed_ms', 0.0):.0f}/{s.get('comm_hidden_ms', 0.0):.0f}" if "comm" in s else \
            f"{s['p2p_ms'] + s['tp_comm_ms']:.2f}"
        t.add_row(str(s["index"]), shape, str(per_rank), _span(s), recompute_text(s["recompute"]),
                  f"{s['fwd_ms']:.2f}", f"{s['bwd_ms']:.2f}", f"{s['recompute_ms']:.2f}",
                  comm, f"{s['dp_sync_ms'] + s['optimizer_ms']:.1f}",
                  f"{s['time_ms']:.0f}", f"{states:.2f}", f"{mb.get('activations', 0.0) / 1024:.2f}",
                  f"{s['memory_mib'] / 1024:.2f}", "yes" if s["fits"] else "[red]OVER[/red]")
    con = Console(width=132)
    if r.get("features"):
        con.print("features: " + _features_line(r["features"]))
    con.print(t)
    _print_comm(con, r)
    _print_terms(con, r)
    con.print(f"iteration {r['iteration_time_ms']:.1f} ms (bubble {r['bubble_ms']:.1f} ms), "
              + Throughput(r["samples_per_s"], r["tokens_per_s_per_gpu"], r["tflops_per_gpu"], r["mfu"]).text())
    if r.get("settings"):
        con.print(f"priced as {r['settings']['text']}")
    fit = ("fits" if r.get("within_headroom", True) else "fits, INSIDE THE HEADROOM") if r["fits"] else "DOES NOT FIT"
    con.print(f"max memory {r['max_memory_mib'] / 1024:.2f} of {r['memory_limit_mib'] / 1024:.2f} GiB "
              f"({fit}); bottleneck: stage {r['bottleneck_stage']} "
              f"({r['bottleneck_resource']})")
    con.print(f"units: {units}; mbs/rank: Megatron's --micro-batch-size; mem: states + act + recompute peak + "
              "p2p + reserve; comm: exposed / hidden behind compute, per iteration")
    for w in r["notes"] + r["warnings"]:
        con.print(f"note: {w}")


def _span(s: dict) -> str:
    if "ops" in s:
        return "ops {}-{}".format(*s["ops"])
    u = s["units"]
    return " ".join(span_text(a, b) for a, b in u) if u and isinstance(u[0], list) else span_text(*u)


def _features_line(f: dict) -> str:
    sp = f.get("sequence_parallel") or []
    cp = f.get("context_parallel") or {}
    parts = [f"SP on stages {','.join(map(str, sp))}" if sp else "no SP",
             ("CP " + ", ".join(f"{v} on stage {k}" for k, v in cp.items())) if cp else "no CP",
             f"{f.get('virtual_stages', 1)} virtual stage(s) per stage",
             "distributed optimizer" if f.get("distributed_optimizer") else "plain optimizer"]
    over = [n for n, k in (("grad reduce", "overlap_grad_reduce"), ("param gather", "overlap_param_gather"),
                           ("TP comm", "tp_comm_overlap")) if f.get(k)]
    parts.append("overlap: " + (", ".join(over) if over else "none"))
    return "; ".join(parts + ([f["fsdp_offload"]] if f.get("fsdp_offload") else []))


def _print_terms(con, r: dict) -> None:
    """Per stage, its named terms beyond the table's columns: the features' time terms (``StageCost.terms``: ms per
    iteration) and the memory terms of the breakdown other than the states, the activations and the reserve
    (``StageCost.memory_breakdown``: the recompute peak, p2p / FSDP / dispatch buffers, the gradient copy, the
    stack features' terms)."""
    shown = ("params", "grads", "optimizer", "activations", "reserve")
    for s in r["stages"]:
        terms = [f"{k} {v:.1f} ms" for k, v in s.get("terms_ms", {}).items() if v]
        mem = [f"{k} {v / 1024:+.2f} GiB" for k, v in s["memory_breakdown_mib"].items() if k not in shown and v]
        if terms or mem:
            con.print(f"stage {s['index']} terms: " + ", ".join(terms + mem))


def _print_comm(con, r: dict) -> None:
    """Per stage and iteration, each communication kind: exposed / hidden ms."""
    kinds = [k for k in COMM_KINDS if any(k in s.get("comm", {}) for s in r["stages"])]
    if not kinds:
        return
    from rich import box
    from rich.table import Table
    t = Table(title="communication per iteration, exposed / hidden behind compute (ms)", box=box.SIMPLE_HEAD,
              padding=(0, 1), collapse_padding=True, pad_edge=False, show_edge=False)
    t.add_column("stage", justify="right")
    for k in kinds:
        t.add_column(k, justify="right")
    for s in r["stages"]:
        c = s.get("comm", {})
        t.add_row(str(s["index"]), *(f"{c[k]['exposed_ms']:.1f} / {c[k]['hidden_ms']:.1f}" if k in c else "-"
                                     for k in kinds))
    con.print(t)
