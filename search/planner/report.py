"""What ``aceso search`` / ``aceso baseline`` print: progress bar, per-stage table, the report lines,
infeasibility hints.

Every search report ends with four lines, each with its predicted time and speedup over the first:

    uniform Megatron-LM   the best uniform configuration (``baseline``): what a tuned Megatron-LM user runs
    Megatron-LM plan      the best plan stock Megatron-LM can run (``--target megatron-lm``: uneven layers,
                          virtual stages, Megatron's recompute settings; ``aceso export --to megatron-lm``)
    Megatron-LM |-pattern the Megatron-LM plans with stage cuts at any unit, as Megatron-LM 0.17+ runs a GPT model
                          as a hybrid layer pattern (``hybrid_cuts.py``; ``aceso export --hybrid-pattern``)
    heterogeneous plan    the best plan on the aceso runtime (per-stage shapes, unit cuts, per-unit recompute)
"""

from __future__ import annotations

import contextlib
import sys

from ..costmodel.types import RC
from search.spec.plan import span_text
from search.io.text import shape
from search.costmodel.throughput import Throughput, throughput
from .state import Evaluation
from .state import to_plan as _to_plan

LINES = (("uniform", "uniform Megatron-LM"), ("megatron_lm", "Megatron-LM plan"),
         ("megatron_lm_pattern", "Megatron-LM |-pattern"), ("aceso", "heterogeneous plan"))


@contextlib.contextmanager
def progress(total: int, quiet: bool = False):
    """A rich progress bar on stderr; yields the callback taking the number of evaluations done."""
    if quiet or not sys.stderr.isatty():
        yield lambda n: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    with Progress(TextColumn("searching"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=__import__("rich.console").console.Console(stderr=True), transient=True) as bar:
        task = bar.add_task("search", total=total)
        last = [0]

        def tick(n: int) -> None:
            if n - last[0] >= 25 or n >= total:
                bar.update(task, completed=min(n, total))
                last[0] = n
        yield tick


def to_plan(ev: Evaluation, model, cluster, training, cm, settings=None):
    """The plan of an evaluation; ``settings``: the ``PlanSettings`` the cost model priced it under. The plan's
    model has the precision it was priced in (``--precision``), so explain and export run that one."""
    if model.params_dtype != training.dtype:
        model = model.model_copy(update={"params_dtype": training.dtype})
    return _to_plan(ev, model, cluster, training.global_batch_size, getattr(cm, "kind", "analytic"),
                    attention=assumed_attention(cm), settings=settings)


def assumed_attention(cm) -> str | None:
    """The attention kernel a cost model assumed: flash / unfused for the analytic model, else None (measured)."""
    flash = getattr(getattr(cm, "source", None), "flash", None)
    return None if flash is None else ("flash" if flash else "unfused")


def _rc_text(rc) -> str:
    from search.spec.plan import recompute_text
    return recompute_text({RC[c]: int((rc == c).sum()) for c in range(len(RC))})


def _experts(s) -> str:
    """`` ep8 etp1`` for a stage shape with an expert shape (MoE), else empty."""
    return f" ep{s.ep} etp{s.expert_tp}" if s.ep > 1 or s.etp else ""


def units_text(model) -> str:
    """What a unit of ``model`` is, for report footers: ``half layers`` for a dense GPT (attention / MLP halves),
    else the unit kinds it has (``ModelSpec.units``): an MoE layer's halves are attention and moe, each MTP layer
    one mtp unit, a T5 decoder layer three."""
    kinds = list(dict.fromkeys(u.kind for u in model.units))
    if set(kinds) <= {"attention", "mlp"}:
        return "half layers"
    return "layer parts: " + " / ".join(kinds)


def _dispatcher(ev: Evaluation) -> list[str]:
    """``dispatcher allgather`` when an MoE plan runs another token dispatcher than the default alltoall."""
    d = getattr(ev.moe, "token_dispatcher", "alltoall")
    return [] if d == "alltoall" else [f"dispatcher {d}"]


def describe(ev: Evaluation) -> str:
    """One line for a plan: shapes (compressed when repeated), micro-batch, chunks, switches, recompute setting."""
    st = ev.state
    shapes, runs = [], []
    for s in st.shapes:
        text = shape(s) + _experts(s)
        if runs and runs[-1][0] == text:
            runs[-1][1] += 1
        else:
            runs.append([text, 1])
    for text, n in runs:
        shapes.append(f"{n}x({text})" if n > 1 else f"({text})")
    f = st.features
    per_rank = "/".join(str(n) for n in dict.fromkeys(st.mbs // s.dp for s in st.shapes))
    parts = [f"pp {st.num_stages}", " ".join(shapes), f"micro-batch {st.mbs} ({per_rank} per rank)"]
    parts += [f"vpp {st.num_chunks}"] if st.num_chunks > 1 else []
    parts += ["dist-opt"] if f.distributed_optimizer else []
    parts += ["overlap"] if f.overlap_grad_reduce or f.overlap_param_gather else []
    parts += ["tp-comm-overlap"] if f.tp_comm_overlap else []
    parts += [f"fsdp {f.fsdp}"] if f.fsdp else []
    parts += [f"offload {f.offload_layers} layers"] if f.offload_layers else []
    parts += _dispatcher(ev)
    if ev.setting is not None:
        parts.append(f"recompute {ev.setting.label}")
    return ", ".join(parts)


def stage_rows(ev: Evaluation) -> list[dict]:
    st = ev.state
    rows = []
    for i, s in enumerate(st.shapes):
        e = ev.stages[i]
        rows.append({"stage": i, "gpus": s.num_gpus, "tp": s.tp, "cp": s.cp, "dp": s.dp, "sp": s.sp,
                     "micro_batch_per_rank": st.mbs // s.dp, "units": [list(x) for x in st.spans(i)],
                     "recompute": _rc_text(e.rc), "time_ms": round(ev.stage_total_ms[i], 3),
                     "time_per_microbatch_ms": round(e.cost.time_per_microbatch_ms, 4),
                     "memory_mib": round(e.cost.memory_mb, 1),
                     **({"ep": s.ep, "etp": s.expert_tp} if _experts(s) else {})})
    return rows


def line(ev: Evaluation | None, base_ms: float | None) -> dict | None:
    if ev is None or not ev.fits:
        return None
    out = {"iteration_ms": round(ev.iteration_ms, 4), "plan": describe(ev)}
    if base_ms:
        out["speedup"] = round(base_ms / ev.iteration_ms, 4)
    return out


def three_lines(plans, model) -> dict:
    """The report's lines (``api.Plans``) as dicts (None where nothing fits)."""
    base = plans.uniform.evaluation if plans.uniform is not None and plans.uniform.fits else None
    base_ms = base.iteration_ms if base is not None else None
    return {"uniform": line(base, base_ms),
            "megatron_lm": line(plans.megatron.plans[0] if plans.megatron.plans else None, base_ms),
            "megatron_lm_pattern": pattern_line(plans.pattern, plans.megatron.plans[0] if plans.megatron.plans
                                                else None, base_ms, model),
            "aceso": line(plans.aceso.plans[0] if plans.aceso.plans else None, base_ms)}


def pattern_line(ev: Evaluation | None, mlm: Evaluation | None, base_ms: float | None, model) -> dict | None:
    """The ``|``-pattern line (``hybrid_cuts.py``): ``line`` with the hybrid layers per stage, its gain over the
    Megatron-LM plan, the framework it is priced for (Megatron-LM, also in a Megatron-Bridge search: an alternative
    to the Bridge lines, ``aceso export --to megatron-lm --hybrid-pattern``) and the ``--hybrid-layer-pattern``
    Megatron-LM runs."""
    out = line(ev, base_ms)
    if out is None:
        return None
    from ..megatron.hybrid_pattern import MTP, PIPE, mtp_pattern, unit_pattern
    st = ev.state
    out["plan"] += ", hybrid layers per stage " + " ".join(
        str(sum(len(unit_pattern(model, a, b)) for a, b in st.spans(i))) for i in range(st.num_stages))
    if mlm is not None and mlm.fits:
        out["vs_megatron_lm"] = round(mlm.iteration_ms / ev.iteration_ms, 4)
    out["framework"] = "megatron-lm"     # priced as Megatron-LM runs it, also in a Megatron-Bridge search
    out["hybrid_layer_pattern"] = PIPE.join(unit_pattern(model, a, b) for a, b in zip(st.bounds, st.bounds[1:])) \
        + "".join(MTP + mtp_pattern(model) for _ in range(model.mtp_num_layers or 0))
    return out


def summary(plan, ev: Evaluation, plans, result, cm, wall_s: float | None = None) -> dict:
    out = {"model": plan.model.name, "cluster": plan.cluster.label if plan.cluster else None,
           "cost_model": getattr(cm, "kind", "analytic"), "target": plans.target,
           "iteration_ms": round(ev.iteration_ms, 4),
           **{k: round(v, 4) for k, v in plan_throughput(plan, ev.iteration_ms, cm)._asdict().items()
              if v is not None},
           "micro_batch_size": plan.micro_batch_size, "num_stages": plan.num_stages,
           "num_virtual_stages": plan.num_virtual_stages, "stages": stage_rows(ev),
           "search_s": round(result.seconds, 3), **({"wall_s": round(wall_s, 3)} if wall_s is not None else {}),
           "evaluated_plans": result.evals,
           "interrupted": result.interrupted, "lines": three_lines(plans, plan.model),
           "not_offered": dict(plans.not_offered)}
    from .api import slower_note
    if (note := slower_note(plans)) is not None:
        out["aceso_slower"] = note
    base = plans.uniform
    if base is not None and base.fits:
        out["baseline"] = {"iteration_ms": round(base.iteration_ms, 4), "pp": base.pp, "tp": base.tp,
                           "cp": base.cp, "dp": base.dp, "micro_batch_size": base.mbs,
                           "micro_batch_per_rank": base.micro_batch_per_rank,
                           "sequence_parallel": base.shape.sp, "virtual_stages": base.state.num_chunks,
                           "recompute": base.recompute, "layers_per_chunk": list(base.layers)}
        out["speedup"] = round(base.iteration_ms / ev.iteration_ms, 4)
    return out


def print_table(plan, ev: Evaluation, plans, result, cm, file=None, wall_s: float | None = None) -> None:
    from rich.console import Console
    from rich.table import Table
    con = Console(file=file or sys.stdout, width=140)
    t = Table(title=f"{plan.model.name} on {plan.cluster.label if plan.cluster else f'{plan.world_size} GPUs'} "
                    f"({getattr(cm, 'kind', 'analytic')}, target {plans.space.evaluator_target}), pipeline micro-batch "
                    f"{plan.micro_batch_size}, global batch {plan.global_batch_size}")
    for col in ("stage", "GPUs", "tp", "cp", "dp", "sp", "mbs/rank", "units", "recompute", "total ms",
                "ms/micro-batch", "memory MiB"):
        t.add_column(col, justify="right" if col not in ("recompute", "units") else "left")
    for r in stage_rows(ev):
        t.add_row(str(r["stage"]), str(r["gpus"]), str(r["tp"]), str(r["cp"]), str(r["dp"]),
                  "on" if r["sp"] else "", str(r["micro_batch_per_rank"]),
                  " ".join(span_text(a, b) for a, b in r["units"]), r["recompute"], f"{r['time_ms']:.1f}",
                  f"{r['time_per_microbatch_ms']:.2f}", f"{r['memory_mib']:.0f}")
    con.print(t)
    f = ev.state.features
    switches = [n for n, on in (("distributed optimizer", f.distributed_optimizer),
                                ("overlap grad reduce", f.overlap_grad_reduce),
                                ("overlap param gather", f.overlap_param_gather),
                                ("tp comm overlap", f.tp_comm_overlap),
                                (f"megatron fsdp {f.fsdp}", f.fsdp),
                                (f"offload {f.offload_layers} layers", f.offload_layers)) if on]
    con.print(f"virtual stages {ev.state.num_chunks}; " + (", ".join(switches) if switches else "no switches on"))
    con.print(f"predicted iteration {ev.iteration_ms:.2f} ms, {plan_throughput(plan, ev.iteration_ms, cm).text()}")
    lines = three_lines(plans, plan.model)
    from .api import FRAMEWORK_NAMES
    drop_in = FRAMEWORK_NAMES[plans.drop_in]      # a Bridge search's uniform and plan lines are Bridge's
    labels = {key: label if key == "megatron_lm_pattern" else label.replace("Megatron-LM", drop_in)
              for key, label in LINES}
    if drop_in != "Megatron-LM":  # the |-pattern line is priced as Megatron-LM runs it, whatever the search's target
        labels["megatron_lm_pattern"] = "Megatron-LM alternative |-pattern"
    width = max(21, *map(len, labels.values()))
    for key, label in labels.items():
        x = lines[key]
        if key in plans.not_offered:
            con.print(f"{label:<{width}} not offered: {plans.not_offered[key]}")
            continue
        if x is None:
            con.print(f"{label:<{width}} nothing fits")
            continue
        sp = f"{x['speedup']:.3f}x" if "speedup" in x else "-"
        con.print(f"{label:<{width}} {x['iteration_ms']:>12.2f} ms  {sp:>7}   {x['plan']}")
    from .api import slower_note
    if (note := slower_note(plans)) is not None:
        con.print(f"note: {note}")
    wall = f" ({wall_s:.1f} s wall in all, with the uniform and {drop_in} lines)" if wall_s is not None else ""
    con.print(f"search {result.seconds:.2f} s{wall}, {result.evals} plans evaluated (units: "
              f"{units_text(plan.model)}; mbs/rank: Megatron's --micro-batch-size)")


def plan_throughput(plan, iteration_ms: float, cm) -> Throughput:
    """``search.costmodel.throughput`` of ``plan`` at ``iteration_ms`` on its GPUs (MFU at the cost model's training dtype)."""
    training = getattr(cm, "training", None)
    peak = cm.cluster.gpu.peak_tflops(training.dtype) if training is not None and plan.cluster else None
    return throughput(plan.model, plan.global_batch_size, iteration_ms, plan.world_size, peak)


def infeasible_hint(best: Evaluation | None, cm, cluster, training, space) -> str:
    """One line: what would make the problem fit."""
    if best is None:
        return (f"no valid plan for {space.num_units} units on {cluster.num_gpus} GPUs with per-rank micro-batch "
                f"sizes {list(space.batches)}; check --micro-batch-sizes and the cluster")
    if best.max_memory_mb == float("inf"):
        return "no plan fits in memory: no plan could be priced"
    if space.runs_on and best.max_memory_mb <= cm.memory_limit_mb:   # it fits, but its target does not run it
        return _target_refuses(best, cm, training, space.runs_on)
    return memory_fix("no plan fits in memory: the best plan found", best.max_memory_mb, cm, cluster, training,
                      space.batches)


def _target_refuses(best: Evaluation, cm, training, runs_on: str) -> str:
    """One line: the plans that fit are ones ``runs_on`` refuses (its capability rules), the best one's reason."""
    from search.targets.capabilities import plan_refusal
    from .state import to_plan
    plan = to_plan(best, cm.model, cm.cluster, training.global_batch_size, getattr(cm, "kind", "analytic"),
                   predicted=False)
    return (f"no plan {runs_on} runs fits in memory: the best plan found that fits is one it refuses "
            f"({plan_refusal(plan, runs_on)}); search with --target megatron-lm, or give more GPUs")


def min_gpus(model, training, usable_mb: float) -> int:
    """A lower bound on the GPUs ``model`` needs: its weights, gradients and optimizer states
    (``memory.state_bytes_per_param``, 16 bytes per parameter in bf16 / fp16 with Adam; 1-byte weights with
    ``--fp8-param-gather``) sharded over every GPU with nothing replicated (Megatron FSDP's optim_grads_params),
    within ``usable_mb`` per GPU; activations come on top."""
    import math

    from ..costmodel.memory import MB, state_bytes_per_param
    from search.settings.precision import base_dtype
    w, g, o = state_bytes_per_param(base_dtype(training.precision), False, 1)
    w = 1.0 if getattr(training, "fp8_param_gather", False) else w
    return max(1, math.ceil(model.num_parameters * (w + g + o) / (usable_mb * MB)))


def memory_fix(what: str, need_mb: float, cm, cluster, training, batches) -> str:
    """One line for a search or baseline where nothing fits: ``what`` needs ``need_mb`` per GPU. Over the GPU's own
    memory (under the headroom), raising ``--memory-limit-mib`` cannot help: the line says the model does not fit
    on this many GPUs and how many it needs at least (``min_gpus``), as a cluster string to try."""
    import math

    from ..costmodel.memory import RESERVE_MB
    budget = cm.memory_limit_mb
    share = budget / cluster.memory_mb                      # 1 - the headroom the budget keeps free
    gpu_mb = cluster.gpu.memory_gib * 1024
    head = f"{what} needs {need_mb:.0f} MiB per GPU (budget {budget:.0f} MiB)"
    small = "; or allow a smaller micro-batch (--micro-batch-sizes 1 ...)" if min(batches) > 1 else ""
    if need_mb <= gpu_mb * share:                           # a --memory-limit-mib below the GPU binds
        return f"{head}: raise --memory-limit-mib to {math.ceil(need_mb / share)} (the {cluster.gpu.name} has " \
               f"{gpu_mb:.0f} MiB){small}"
    model, n = cm.model, cluster.num_gpus
    need_gpus = min_gpus(model, training, gpu_mb * share - RESERVE_MB)
    if need_gpus <= n:
        return (f"{head}, more than a {cluster.gpu.name} has ({gpu_mb:.0f} MiB): use more GPUs than {n} "
                f"(activations, not model states, are what does not fit){small}")
    gpn = cluster.gpus_per_node
    nodes = math.ceil(need_gpus / gpn)
    return (f"{head}: {model.name} does not fit on {n} {cluster.gpu.name} GPU{'s' if n > 1 else ''} ({gpu_mb:.0f} MiB "
            f"each); its "
            f"{model.num_parameters / 1e9:.1f}B parameters' weights, gradients and optimizer states alone need at "
            f"least {need_gpus} GPUs: try --cluster {nodes}x{gpn}-{cluster.gpu.name} or more")
