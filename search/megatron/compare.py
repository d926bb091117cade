"""What ``aceso search`` would gain over a user's Megatron-LM configuration, on the same model, cluster, global
batch, precision and attention kernel (``aceso explain --megatron-args``).

The searches are ``aceso search``'s own (``planner.api.plan_all``: the Megatron-LM-expressible search, then the
heterogeneous one seeded with it) over the default search space widened to contain the user's configuration
(its per-rank micro-batch, virtual stages and cp), both also started from it, with a small fixed budget (plan
evaluations: the same answer on any machine), so neither line is slower than the configuration as the search
prices it.
Each plan is priced for the framework that runs it: the user's configuration and the Megatron-LM plan as
the configuration's own settings run them (``plan_settings``: its gradient-reduction flags, unless ``explain
--framework`` says otherwise), the heterogeneous plan on the aceso runtime (the search's own pricing). ``speedup`` > 1: faster than
the user's configuration.
"""

from __future__ import annotations

from ..plan import ParallelPlan
from ..plan_settings import plan_precision, run_settings, settings_for

DEFAULT_BUDGET = 600


def search_gain(plan: ParallelPlan, config_ms: float, attention: str | None, cost_model: str = "analytic",
                db=None, budget_evals: int = DEFAULT_BUDGET, settings=None) -> dict:
    """``{"config_ms", "budget_evals", "megatron": line, "aceso": line}``; a line is ``{"iteration_ms",
    "speedup", "plan"}`` or None when nothing fits."""
    from ..planner.aceso import SearchOptions
    from ..planner.api import build_cost_model, plan_all
    from ..planner.report import to_plan
    from ..training import TrainingSpec
    from ..planner.state import from_plan
    st = plan.stages[0]
    base = TrainingSpec(global_batch_size=plan.global_batch_size)     # the default candidates ...
    training = TrainingSpec(                                         # ... widened to hold the given configuration
        global_batch_size=plan.global_batch_size, **plan_precision(plan), attention=attention or "auto",
        micro_batch_sizes=sorted({*base.micro_batch_sizes, plan.micro_batch_per_rank(0)}),
        virtual_stages=sorted({*base.virtual_stages, plan.num_virtual_stages}),
        context_parallel_sizes=sorted({*base.context_parallel_sizes, st.cp}))
    cm = build_cost_model(plan.model, plan.cluster, training, cost_model, db)
    opts = SearchOptions(budget_evals=budget_evals, seeds=[from_plan(plan)[0]])    # start from theirs, too
    plans = plan_all(cm, training, opts, target="megatron-lm")
    out = {"config_ms": config_ms, "budget_evals": budget_evals, "megatron": None, "aceso": None}
    for key, result in (("megatron", plans.megatron), ("aceso", plans.aceso)):
        best = result.plans[0] if result.plans and result.plans[0].fits else None
        if best is None:
            continue
        p = to_plan(best, plan.model, plan.cluster, training, cm)
        ms = best.iteration_ms
        if key == "megatron" and cost_model != "aceso-compat":
            ms = _priced(p, training, cost_model, db, settings or settings_for(plan, "megatron-lm"))
        out[key] = {"iteration_ms": ms, "speedup": config_ms / ms, "plan": p}
    return out


def _priced(plan: ParallelPlan, training, cost_model: str, db, settings) -> float:
    from ..costmodel import make_cost_model
    return make_cost_model(plan.model, plan.cluster, training, cost_model, db,
                           settings=run_settings(settings, training.precision)).evaluate(plan).iteration_ms


def _verdict(sp: float) -> str:
    if abs(sp - 1) < 5e-4:
        return "as fast as yours"
    return f"{sp:.3f}x faster" if sp > 1 else f"{1 / sp:.3f}x slower (nothing better found in this budget)"


def gain_lines(g: dict, plan: ParallelPlan) -> list[str]:
    lines = [f"your Megatron-LM configuration:          {g['config_ms']:10.1f} ms per iteration"]
    for key, what in (("megatron", "best Megatron-LM plan (drop-in)"),
                      ("aceso", "best heterogeneous plan (aceso runtime)")):
        line = g[key]
        if line is None:
            lines.append(f"{what + ':':40s} no plan fits in memory")
            continue
        lines.append(f"{what + ':':40s} {line['iteration_ms']:10.1f} ms per iteration, {_verdict(line['speedup'])}")
    lines.append(f"  ({g['budget_evals']} plan evaluations; to get them: {search_command(plan)} [--target "
                 "megatron-lm] -o plan.json, then aceso export plan.json --to megatron-lm or aceso launch plan.json)")
    return lines


def search_command(plan: ParallelPlan) -> str:
    import model_specs

    from ..presets import load_model
    m = plan.model
    preset = m.name in model_specs.preset_names()
    model = m.name if preset else "SPEC.json"
    depth = f" --num-layers {m.num_layers}" if preset and load_model(m.name).num_layers != m.num_layers else ""
    cluster = f" --cluster {plan.cluster.label}" if plan.cluster else ""
    low = (plan.settings.low_precision if plan.settings else None)
    prec = ""
    if low is not None:
        prec = f" --precision {low.recipe}" + (" --fp8-param-gather" if low.param_gather else "")
        if low.bf16_layers_start or low.bf16_layers_end:
            prec += f" --bf16-layers {low.bf16_layers_start} {low.bf16_layers_end}"
    return f"aceso search --model {model}{depth}{cluster} --global-batch-size {plan.global_batch_size}{prec}"
