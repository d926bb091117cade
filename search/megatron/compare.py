"""What ``aceso search`` would gain over a user's Megatron-LM configuration, on the same model, cluster, global
batch, precision and attention kernel, under the same cost model (``aceso explain --megatron-args``).

The search runs with a small fixed budget (plan evaluations, so the answer is the same on any machine) and starts
from the uniform baseline as ``aceso search`` does; its best plan may be heterogeneous (it runs with ``aceso
train``). ``speedup`` > 1 means the search's plan is faster than the given configuration.
"""

from __future__ import annotations

from ..plan import ParallelPlan

DEFAULT_BUDGET = 600


def search_gain(plan: ParallelPlan, config_ms: float, attention: str | None, cost_model: str = "analytic",
                db=None, budget_evals: int = DEFAULT_BUDGET) -> dict:
    """``{"config_ms", "search_ms", "speedup", "budget_evals", "search_plan"}`` (search_ms None: nothing fits)."""
    from ..planner.aceso import SearchOptions
    from ..planner.api import build_cost_model, plan_baseline, plan_search
    from ..planner.report import to_plan
    from ..training import TrainingSpec
    training = TrainingSpec(global_batch_size=plan.global_batch_size, precision=plan.model.params_dtype,
                            attention=attention or "auto")
    cm = build_cost_model(plan.model, plan.cluster, training, cost_model, db)
    base = plan_baseline(cm, training)
    result, _ = plan_search(cm, training, SearchOptions(budget_evals=budget_evals),
                            baseline=base if base is not None and base.fits else None)
    best = result.plans[0] if result.plans and result.plans[0].fits else None
    out = {"config_ms": config_ms, "budget_evals": budget_evals, "search_ms": None, "speedup": None,
           "search_plan": None}
    if best is not None:
        out.update(search_ms=best.iteration_ms, speedup=config_ms / best.iteration_ms,
                   search_plan=to_plan(best, plan.model, plan.cluster, training, cm))
    return out


def gain_lines(g: dict, plan: ParallelPlan) -> list[str]:
    lines = [f"your Megatron-LM configuration: {g['config_ms']:.1f} ms per iteration"]
    head = f"aceso search ({g['budget_evals']} plan evaluations)"
    if g["search_ms"] is None:
        return lines + [f"{head}: no plan fits in memory"]
    sp = g["speedup"]
    if abs(sp - 1) < 5e-4:
        verdict = "as fast: your configuration is as good as the search's best"
    elif sp > 1:
        verdict = f"{sp:.3f}x faster"
    else:
        verdict = f"{1 / sp:.3f}x slower: the search found nothing better in this budget"
    lines.append(f"{head}: {g['search_ms']:.1f} ms per iteration, {verdict}")
    if sp > 1 + 5e-4:
        lines.append(f"  to get it: {search_command(plan)} -o plan.json (then aceso train, or export --to "
                     "megatron-lm if it is expressible)")
    return lines


def search_command(plan: ParallelPlan) -> str:
    import model_specs

    from ..presets import load_model
    m = plan.model
    preset = m.name in model_specs.preset_names()
    model = m.name if preset else "SPEC.json"
    depth = f" --num-layers {m.num_layers}" if preset and load_model(m.name).num_layers != m.num_layers else ""
    cluster = f" --cluster {plan.cluster.label}" if plan.cluster else ""
    return f"aceso search --model {model}{depth}{cluster} --global-batch-size {plan.global_batch_size}"
