"""What ``aceso search`` / ``aceso baseline`` print: progress bar, per-stage table, summary, infeasibility hints."""

from __future__ import annotations

import contextlib
import sys

from ..costmodel.types import RC
from .state import Evaluation
from .state import to_plan as _to_plan


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


def to_plan(ev: Evaluation, model, cluster, training, cm):
    return _to_plan(ev, model, cluster, training.global_batch_size, getattr(cm, "kind", "analytic"),
                    bool(training.distributed_optimizer), attention=assumed_attention(cm))


def assumed_attention(cm) -> str | None:
    """The attention kernel a cost model assumed: flash / unfused for the analytic model, else None (measured)."""
    flash = getattr(getattr(cm, "source", None), "flash", None)
    return None if flash is None else ("flash" if flash else "unfused")


def _rc_text(rc) -> str:
    from ..plan import recompute_text
    return recompute_text({RC[c]: int((rc == c).sum()) for c in range(len(RC))})


def stage_rows(ev: Evaluation) -> list[dict]:
    st = ev.state
    rows = []
    for i, (tp, dp) in enumerate(st.shapes):
        s = ev.stages[i]
        rows.append({"stage": i, "gpus": tp * dp, "tp": tp, "dp": dp, "micro_batch_per_rank": st.mbs // dp,
                     "units": [st.bounds[i], st.bounds[i + 1]],
                     "recompute": _rc_text(s.rc), "time_ms": round(ev.stage_total_ms[i], 3),
                     "time_per_microbatch_ms": round(s.cost.time_per_microbatch_ms, 4),
                     "memory_mb": round(s.cost.memory_mb, 1)})
    return rows


def summary(plan, ev: Evaluation, base, result, cm) -> dict:
    out = {"model": plan.model.name, "cluster": plan.cluster.label if plan.cluster else None,
           "cost_model": getattr(cm, "kind", "analytic"), "iteration_ms": round(ev.iteration_ms, 4),
           "samples_per_s": round(plan.global_batch_size / ev.iteration_ms * 1000, 4),
           "micro_batch_size": plan.micro_batch_size, "num_stages": plan.num_stages, "stages": stage_rows(ev),
           "search_s": round(result.seconds, 3), "evaluated_plans": result.evals,
           "interrupted": result.interrupted}
    if base is not None and base.fits:
        out["baseline"] = {"iteration_ms": round(base.iteration_ms, 4), "pp": base.pp, "tp": base.tp,
                           "dp": base.dp, "micro_batch_size": base.mbs, "recompute": base.recompute,
                           "layers_per_stage": list(base.layers)}
        out["speedup"] = round(base.iteration_ms / ev.iteration_ms, 4)
    return out


def print_table(plan, ev: Evaluation, base, result, cm, file=None) -> None:
    from rich.console import Console
    from rich.table import Table
    con = Console(file=file or sys.stdout, width=120)
    t = Table(title=f"{plan.model.name} on {plan.cluster.label if plan.cluster else plan.world_size} GPUs "
                    f"({getattr(cm, 'kind', 'analytic')}), pipeline micro-batch {plan.micro_batch_size}, "
                    f"global batch {plan.global_batch_size}")
    for col in ("stage", "GPUs", "tp", "dp", "mbs/rank", "units", "recompute", "1F1B time ms", "ms/micro-batch",
                "memory MB"):
        t.add_column(col, justify="right" if col not in ("recompute", "units") else "left")
    for r in stage_rows(ev):
        t.add_row(str(r["stage"]), str(r["gpus"]), str(r["tp"]), str(r["dp"]), str(r["micro_batch_per_rank"]),
                  f"{r['units'][0]}-{r['units'][1]}",
                  r["recompute"], f"{r['time_ms']:.1f}", f"{r['time_per_microbatch_ms']:.2f}",
                  f"{r['memory_mb']:.0f}")
    con.print(t)
    sps = plan.global_batch_size / ev.iteration_ms * 1000
    con.print(f"predicted iteration {ev.iteration_ms:.2f} ms, {sps:.2f} samples/s")
    if base is not None and base.fits:
        con.print(f"uniform baseline: pp {base.pp} tp {base.tp} dp {base.dp} micro-batch {base.mbs} "
                  f"({base.mbs // base.dp} per rank) recompute "
                  f"{base.recompute}: {base.iteration_ms:.2f} ms -> speedup {base.iteration_ms / ev.iteration_ms:.3f}x")
    else:
        con.print("uniform baseline: no uniform configuration fits")
    con.print(f"search {result.seconds:.2f} s, {result.evals} plans evaluated (units: half layers; mbs/rank: "
              "Megatron's --micro-batch-size)")


def infeasible_hint(best: Evaluation | None, cm, cluster, training, space) -> str:
    """One line: what would make the problem fit."""
    limit = cm.memory_limit_mb
    if best is None:
        return (f"no valid plan for {space.num_units} units on {cluster.num_gpus} GPUs with micro-batch sizes "
                f"{list(space.mbs_list)}; check --micro-batch-sizes and the cluster")
    need = best.max_memory_mb
    hints = [f"needs at least {need:.0f} MB per GPU (limit {limit:.0f} MB): raise --memory-limit-mb to {need:.0f}"
             if need != float("inf") else "no plan could be priced"]
    hints.append(f"use more GPUs than {cluster.num_gpus}")
    if min(space.mbs_list) > 1:
        hints.append("allow a smaller micro-batch (--micro-batch-sizes 1 ...)")
    return "no plan fits in memory: it " + "; or ".join(hints)
