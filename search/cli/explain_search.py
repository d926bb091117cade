"""``explain --megatron-args``'s search lines: what ``aceso search`` returns on the same model and cluster, each line
the result of the very command explain prints (issue 32: one search behind both).

``search_argv`` writes the ``aceso search`` command line of a user's configuration: its model (a preset with
``--num-layers`` / ``--seq-length``, else a spec file), cluster, memory limit and headroom, calibration, global
batch, precision recipe, attention kernel, gradient-reduction dtype (``--grad-reduce-in-bf16``), cost model, the
candidates widened to hold the configuration's own per-rank micro-batch, virtual stages and cp, the target and the
budget. ``search_lines`` parses it with the search's own parser and runs the search's own function
(``search_cmd.find``): the drop-in line is ``--target megatron-lm`` (``megatron-bridge`` when the configuration is
priced for it), the heterogeneous line ``--target aceso``. So the number explain prints is the number that command
prints, the plan ``--save-best`` writes is the plan its ``-o`` writes, and a larger ``--budget-evals`` never
returns a slower plan. A line is offered only when its target runs the model (``capabilities.model_refusal``: the
aceso runtime has no low-precision recipes, GPT-OSS softmax offset or MoE expert bias yet); else it says why.

A configuration's DP and pipeline tuning is kept (``tuning_flags``): its DDP buckets, DP alignment, rank order and
SHARP (``settings.data_parallel``, as Megatron-LM's flags) and its interleaved p2p without overlap
(``--no-overlap-p2p-communication``); the heterogeneous line is not offered where the runtime does not run them
(``tuning_refusal``). An MoE configuration's settings are kept (``moe_flags``): its token dispatcher is the first of
``--dispatcher`` (the search runs under it; the others are priced on its finalists), its router dtype
``--moe-router-dtype``, its HybridEP SM count ``--moe-hybridep-num-sms``; its
expert shape is a candidate where it is etp 1 or the stage's tp, and its routing (forced balance, capacity,
padding: the model's ``moe`` fields) travels in the spec file the command names.

Not carried over (no search flag for them yet): an expert tp other than 1 or the stage's tp, the kernel and
overlap switches the search chooses itself (grouped GEMM, permute / router fusion, the EP and shared-expert
overlaps), megatron-core 0.19's per-rank capacity, and the exact layer layout; the search explores its own (the
uniform baseline covers the even layouts). Nor is ``--tp-comm-overlap``: the printed search prices its plans without
TP overlap (adding the flag searches under it, every tp > 1 plan with sequence parallelism).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from search.io.errors import AcesoError
from search.planner.api import FRAMEWORK_NAMES

LINES = (("megatron", "best Megatron-LM plan (drop-in)"), ("aceso", "best heterogeneous plan (aceso runtime)"))


def drop_in_target(plan, framework: str | None) -> str:
    """The target of the drop-in line: Megatron-Bridge when the configuration is priced for it, else Megatron-LM."""
    from search.settings.plan_settings import target_settings
    settings = target_settings(framework, plan.settings, plan.model.params_dtype)
    return "megatron-bridge" if settings.framework == "megatron-bridge" else "megatron-lm"


def model_flags(model) -> list[str] | None:
    """``--model NAME [--num-layers N] [--seq-length S]`` when that preset is ``model``, else None (the command needs
    the model as a spec file). Not compared: the dtype (the search's ``--precision`` sets it) and the vocabulary
    padding (Megatron-LM pads to ``--make-vocab-size-divisible-by`` x tp, and the importer records the
    configuration's tp in it; the search pads for the tp it picks)."""
    from model_specs import presets as model_presets

    from search.spec.presets import load_model
    if model.name not in model_presets.preset_names():
        return None
    preset = load_model(model.name)
    flags = ["--model", model.name]
    layers = model.num_layers if model.num_layers != preset.num_layers else None
    if layers is not None:
        flags += ["--num-layers", str(layers)]
        preset = load_model(model.name, num_layers=layers)
    if model.seq_length != preset.seq_length:
        flags += ["--seq-length", str(model.seq_length)]
        preset = preset.model_copy(update={"seq_length": model.seq_length})
    free = {"params_dtype", "make_vocab_size_divisible_by"}
    same = preset.model_dump(exclude=free) == model.model_dump(exclude=free)
    return flags if same else None


def search_argv(plan, args, target: str, budget: int, model_file: str = "SPEC.json",
                te_file: str = "TE_QUANT.yaml") -> list[str]:
    """The ``aceso search`` arguments of ``plan`` (a user's configuration) for ``target`` (see the module
    docstring); ``args``: explain's (cluster, memory limit, headroom, calibration, attention, cost model,
    framework); ``model_file``: the spec file standing for a model that is no preset; ``te_file``: the per-module
    precision overrides' YAML (``--te-precision-config-file``) where the configuration has them."""
    from ..costmodel.memory import DEFAULT_HEADROOM
    from search.settings.plan_settings import target_settings
    from ..planner.space import virtual_degrees
    from search.settings.precision import base_dtype, training_fields
    from .search_cmd import DEFAULT_CP, LONG_SEQUENCE, SPACE_TARGET, target_precision
    from search.settings.optimizer_state import to_flags as optimizer_state_flags

    m = plan.model
    argv = model_flags(m) or ["--model", model_file]
    argv += ["--cluster", args.cluster]
    if args.memory_limit_mb is not None:
        argv += ["--memory-limit-mib", f"{args.memory_limit_mb:g}"]
    if args.memory_headroom != DEFAULT_HEADROOM:
        argv += ["--memory-headroom", f"{args.memory_headroom:g}"]
    if args.calibration:
        argv += ["--calibration", args.calibration]
    argv += ["--global-batch-size", str(plan.global_batch_size)]
    prec = training_fields(plan.settings.low_precision, m.params_dtype)
    loaded = m.params_dtype if model_flags(m) is None else _preset_dtype(m.name)
    if prec["precision"] != target_precision(loaded, plan.cluster.gpu, target)[0]:   # what the search defaults to
        argv += ["--precision", prec["precision"]]
    if plan.settings.optimizer != "adam":           # (Adam: the search's default)
        argv += ["--optimizer", plan.settings.optimizer]
    argv += optimizer_state_flags(plan.settings.precision_aware_optimizer)     # numerics, kept as the search's
    if prec.get("fp8_param_gather"):
        argv += ["--fp8-param-gather"]
    if prec.get("bf16_layers_start") or prec.get("bf16_layers_end"):
        argv += ["--bf16-layers", str(prec["bf16_layers_start"]), str(prec["bf16_layers_end"])]
    if prec.get("per_module"):
        argv += ["--te-precision-config-file", te_file]
    mbs = plan.micro_batch_per_rank(0)
    if mbs not in (1, 2, 4, 8):
        argv += ["--micro-batch-sizes", *map(str, sorted({1, 2, 4, 8, mbs}))]
    cp = plan.stages[0].cp
    cps = [1] if m.seq_length < LONG_SEQUENCE else list(DEFAULT_CP)
    if cp not in cps:
        argv += ["--cp", *map(str, sorted({*cps, cp}))]
    v = plan.num_virtual_stages
    degrees = virtual_degrees(m, SPACE_TARGET[target])
    if v not in degrees:
        argv += ["--vpp", *map(str, sorted({*degrees, v}))]
    argv += tuning_flags(plan)
    argv += moe_flags(plan)
    attention = args.attention or "auto"
    if attention != "auto" and attention != _auto_attention(plan, args):
        argv += ["--attention", attention]
    if args.cost_model != "analytic":
        argv += ["--cost-model", args.cost_model] + (["--db", args.db] if args.db else [])
    if target != "aceso":
        argv += ["--target", target]
        s = target_settings(args.framework, plan.settings, m.params_dtype)
        if s.framework != "runtime" and base_dtype(prec["precision"]) == "bf16" and not s.grad_reduce_in_fp32:
            argv += ["--grad-reduce-in-bf16"]
    argv += ["--budget-evals", str(budget)]
    return argv


def tuning_flags(plan) -> list[str]:
    """The search flags that keep a configuration's DP and pipeline tuning in every plan of the search: its DDP
    buckets, DP alignment, rank order and SHARP (Megatron-LM's flags, ``data_parallel.to_flags``) and its
    interleaved schedule's p2p without overlap (``--no-overlap-p2p-communication``)."""
    from search.settings.data_parallel import to_flags
    s = plan.settings
    return to_flags(s.data_parallel) + (["--no-overlap-p2p-communication"] if s.overlap_p2p_comm is False else [])


def moe_flags(plan) -> list[str]:
    """The search flags that keep an MoE configuration's own settings in the search: its token dispatcher first in
    ``--dispatcher`` (the one the search runs under, so the uniform baseline holds the configuration; the others
    after it, priced on the finalists) and its router dtype (``--moe-router-dtype``: numerics, which the search
    does not choose). Its expert shapes (ep, etp 1 or tp) and routing (the model's ``moe`` fields, in the spec the
    command names) are in the search already."""
    if plan.model.moe is None or plan.moe is None:
        return []
    from ..planner.dispatchers import DISPATCHERS
    own = plan.moe.token_dispatcher
    out = []
    if own != DISPATCHERS[0]:
        gpu = plan.cluster.gpu.name != "cpu"
        out += ["--dispatcher", own, *[d for d in DISPATCHERS if d != own and (gpu or d != "flex")]]
    out += ["--moe-router-dtype", plan.moe.router_dtype or "model"]
    out += ["--moe-hybridep-num-sms", str(plan.moe.hybridep_num_sms)] if plan.moe.hybridep_num_sms else []
    return out


def _preset_dtype(name: str) -> str:
    from search.spec.presets import load_model
    return load_model(name).params_dtype


def _auto_attention(plan, args) -> str:
    """What ``--attention auto`` means on the plan's GPUs under the analytic model (flash / unfused)."""
    from search.pricing import cost_model
    from search.spec.training import TrainingSpec
    try:
        cm = cost_model(plan.model, plan.cluster, TrainingSpec(global_batch_size=plan.global_batch_size))
    except (AcesoError, ValueError):
        return "auto"
    return "flash" if getattr(cm.source, "flash", False) else "unfused"


def search_lines(plan, config_ms: float, args, budget: int, save_best: str | None = None) -> dict:
    """``{"config_ms", "budget_evals", "megatron": line, "aceso": line}``; a line is ``{"target", "command",
    "iteration_ms", "speedup", "plan"}``, or ``{"target", "command", "not_offered": why}`` where its target runs
    no plan of the model, or ``{"target", "command", "no_plan": why}`` where the search finds none (nothing fits)."""
    from search.targets.capabilities import model_refusal
    from .search_cmd import find, parse_args

    low = plan.settings.low_precision
    custom = model_flags(plan.model) is None
    model_file = _model_file(save_best) if custom and save_best else "SPEC.json"
    te_file = saved_paths(save_best)["te"] if save_best else "TE_QUANT.yaml"
    out = {"config_ms": config_ms, "budget_evals": budget}
    for key, target in (("megatron", drop_in_target(plan, args.framework)), ("aceso", "aceso")):
        argv = search_argv(plan, args, target, budget, model_file, te_file)
        line = {"target": target, "command": "aceso search " + shlex.join(argv)}
        out[key] = line
        why = model_refusal(target, plan.model, low, plan.model.params_dtype, plan.cluster.gpu,
                            plan.settings.optimizer, plan.settings.precision_aware_optimizer) or \
            tuning_refusal(plan, target)
        if why is not None:
            line["not_offered"] = why
            continue
        try:
            ns = parse_args(argv)
            ns.per_module = low.per_module if low is not None else ()     # the file the command names, as held
            found = find(ns, model=plan.model if custom else None, quiet=True)
        except AcesoError as e:
            line["no_plan"] = str(e)
            continue
        ms = found.best.iteration_ms
        line.update(iteration_ms=ms, speedup=config_ms / ms, plan=found.out_plans[0])
    behind = behind_drop_in(out["megatron"], out["aceso"])
    if behind is not None:
        out["aceso"]["slower_than_drop_in"] = behind
    return out


def tuning_refusal(plan, target: str) -> str | None:
    """Why ``target`` runs no plan with the configuration's DP tuning (the aceso runtime: ``--ddp-num-buckets``,
    ``--use-tp-pp-dp-mapping``, ``--use-sharp``; ``data_parallel.runtime_refusal``), or None."""
    from search.settings.data_parallel import FLAGS, runtime_refusal
    why = runtime_refusal(plan.settings.data_parallel) if target == "aceso" else None
    return f"the configuration's {FLAGS[why[0]]}: {why[1]}" if why else None


def behind_drop_in(drop_in: dict, het: dict) -> str | None:
    """Why the heterogeneous line is slower than the drop-in line (None when it is not): what of the drop-in plan
    the aceso runtime does not run (the capability table's first refusal), else that the drop-in plan runs there
    too (the heterogeneous command's own Megatron-LM sub-search gets a quarter of the budget and prices as the
    runtime runs, so it can miss it)."""
    if "iteration_ms" not in drop_in or "iteration_ms" not in het or het["iteration_ms"] <= drop_in["iteration_ms"]:
        return None
    from search.targets.capabilities import RUNTIME
    from search.targets.preflight import planner_checks, target_device
    plan = drop_in["plan"]
    try:
        planner_checks(plan, target_device(plan), RUNTIME)
    except AcesoError as e:
        return f"the drop-in plan is the faster: the aceso runtime does not run it ({e})"
    return ("the drop-in plan is the faster, and the aceso runtime runs it too (aceso launch it); this command's "
            "Megatron-LM sub-search, a quarter of the budget, did not reach it")


def _model_file(save_best: str) -> str:
    p = Path(save_best)
    return str(p.with_name(f"{p.stem}.model.json"))


def saved_paths(save_best: str) -> dict:
    """Where ``--save-best FILE`` writes: the drop-in plan to FILE, the heterogeneous one beside it
    (``FILE.aceso.json``), a model that is no preset as ``FILE.model.json`` and per-module precision overrides as
    ``FILE.te_quant.yaml`` (the commands name them)."""
    p = Path(save_best)
    return {"megatron": save_best, "aceso": str(p.with_name(f"{p.stem}.aceso{p.suffix or '.json'}")),
            "model": _model_file(save_best), "te": str(p.with_name(f"{p.stem}.te_quant.yaml"))}


def save(lines: dict, plan, save_best: str) -> list[str]:
    """Write the plans of the offered lines (and a custom model's spec); the paths written."""
    from search.spec.presets import spec_text
    from .common import write_outputs

    paths = saved_paths(save_best)
    files = [(lines[k]["plan"].to_json(), paths[k], "--save-best") for k, _ in LINES if "plan" in lines[k]]
    if files and model_flags(plan.model) is None:
        files.append((spec_text(plan.model, "json", title=plan.model.name), paths["model"], "--save-best"))
    low = plan.settings.low_precision
    if files and low is not None and low.per_module:      # the commands' --te-precision-config-file
        from search.settings.precision_overrides import write_yaml
        files.append((write_yaml(low.per_module), paths["te"], "--save-best"))
    write_outputs(files)
    return [f[1] for f in files]


def check_save_best(save_best: str | None) -> None:
    """``--save-best`` checked before any work (its paths)."""
    if save_best is None:
        return
    from .common import check_output
    if save_best == "-":
        raise AcesoError("--save-best -: give a file (two plans are written: FILE and FILE.aceso.json)")
    for path in saved_paths(save_best).values():
        check_output(path, "--save-best")


def verdict(sp: float) -> str:
    if abs(sp - 1) < 5e-4:
        return "as fast as yours"
    return f"{sp:.3f}x faster" if sp > 1 else f"{1 / sp:.3f}x slower (nothing better found in this budget)"


def text_lines(g: dict, saved: list[str] | None = None) -> list[str]:
    """The lines explain prints under its table: the configuration, then each line with the command that gives it."""
    lines = [f"your Megatron-LM configuration:          {g['config_ms']:10.1f} ms per iteration"]
    for key, what in LINES:
        line = g[key]
        what = what.replace("Megatron-LM", FRAMEWORK_NAMES.get(line["target"], "Megatron-LM"))   # Bridge drop-in
        if "not_offered" in line:
            lines.append(f"{what + ':':40s} not offered: {line['not_offered']}")
            continue
        if "no_plan" in line:
            lines.append(f"{what + ':':40s} none: {line['no_plan']}")
        else:
            lines.append(f"{what + ':':40s} {line['iteration_ms']:10.1f} ms per iteration, "
                         f"{verdict(line['speedup'])}")
            if "slower_than_drop_in" in line:
                lines.append(f"  ({line['slower_than_drop_in']})")
        lines.append(f"  {line['command']} -o plan.json")
    then = [f"aceso export plan.json --to {g['megatron']['target']}"] if "plan" in g["megatron"] else []
    then += ["aceso launch plan.json (the heterogeneous plan)"] if "plan" in g["aceso"] else []
    lines.append("  (each command returns exactly that plan; a larger --budget-evals never a slower one"
                 + (f"; then {', or '.join(then)})" if then else ")"))
    if saved:
        lines.append("  wrote " + ", ".join(saved))
    return lines
