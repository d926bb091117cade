"""Search benchmark: plan quality against the reference search and the uniform baseline, search time, optimality.

1. compat: the Aceso reference database (../shared/aceso-reference-db, 4 V100, limit 12000 MB, GBS 512,
   micro-batches 1 2 4 8): GPT-1.3B (reference search plan 58760.92 ms, best uniform 73654.74 ms) and T5-770M
   (reference 33659.50 ms, uniform 52169.67 ms). Our plan is exported to the reference's config format
   (``search.compat.mapping.plan_to_ref``, what ``aceso export --to aceso-legacy`` writes) and scored by the compat
   evaluator (``evaluate_ref_config``). Target: <= the reference plan's time, in <= 10 s.
2. analytic: GPT-1.3B/6.7B/13B/175B and Llama-3-70B on 8 to 1024 H100s, T5-11B on 32: search time (target <= 20 s up
   to 32 GPUs, <= 60 s at 1024) and predicted speedup over the best uniform Megatron configuration.
3. scale: gpt-scale-layer with 1024 layers on 8 GPUs (target <= 30 s; the reference needs ~250 s): analytic on
   H100s, and with ``--full-db DIR`` (the artifact's full V100 database, ``profiler/profiled-time-eurosys`` of
   microsoft/SuperScaler branch Aceso; only its miniset is in ../shared) also aceso-compat on V100s.
4. optimality: random tiny problems (<= 4 GPUs, <= 4 layers, 2 micro-batch sizes): search = exhaustive optimum.

Run: ``python bench/search_bench.py [--only compat,analytic,scale,optimality] [--quick] [--full-db DIR]``; prints a
table and writes bench/results/search_bench.json. Times are wall-clock and process CPU seconds (the CPU time is what
matters on a loaded machine); the search itself is deterministic (budget in plan evaluations).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from search.cluster import parse_cluster
from search.planner.aceso import SearchOptions, search
from search.planner.api import build_cost_model, plan_baseline, plan_search
from search.planner.state import to_plan
from search.presets import load_model
from search.training import TrainingSpec

DB = ROOT.parent / "shared" / "aceso-reference-db"
COMPAT = [("gpt-1.3b", 58760.92, 73654.74), ("t5-770m", 33659.50, 52169.67)]
ANALYTIC = [  # model, cluster, global batch
    ("gpt-1.3b", "1x8-h100", 512), ("gpt-6.7b", "2x8-h100", 1024), ("gpt-13b", "4x8-h100", 1024),
    ("t5-11b", "4x8-h100", 1024), ("llama3-70b", "8x8-h100", 1024), ("gpt-175b", "128x8-h100", 2048),
    ("llama3-70b", "128x8-h100", 2048),
]
QUICK = {("gpt-1.3b", "1x8-h100"), ("gpt-13b", "4x8-h100"), ("gpt-175b", "128x8-h100")}


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def run_case(model_name, cluster, gbs, kind="analytic", db=None, limit=None, num_layers=None, budget=4000):
    model = load_model(model_name, num_layers=num_layers)
    cl = parse_cluster(cluster, memory_limit_mb=limit)
    tr = TrainingSpec(global_batch_size=gbs, precision=model.params_dtype)
    cm = build_cost_model(model, cl, tr, kind, db)

    def go():
        base = plan_baseline(cm, tr)
        res, _ = plan_search(cm, tr, SearchOptions(budget_evals=budget, workers=1),
                             baseline=base if base is not None and base.fits else None)
        return base, res
    (base, res), wall, cpu = timed(go)
    best = res.plans[0]
    plan = to_plan(best, model, cl, gbs, kind)
    return {"model": model_name + (f" L{num_layers}" if num_layers else ""), "cluster": cluster, "gbs": gbs,
            "cost_model": kind, "iteration_ms": round(best.iteration_ms, 2) if best.fits else None,
            "baseline_ms": round(base.iteration_ms, 2) if base is not None and base.fits else None,
            "speedup": round(base.iteration_ms / best.iteration_ms, 3) if base is not None and base.fits and best.fits
            else None, "stages": best.state.num_stages, "mbs": best.state.mbs,
            "shapes": " ".join(f"{tp}x{dp}" for tp, dp in best.state.shapes), "evals": res.evals, "wall_s": round(wall, 2),
            "cpu_s": round(cpu, 2)}, plan


def section_compat(args):
    from search.compat import AcesoDB, evaluate_ref_config
    from search.compat.mapping import plan_to_ref
    rows = []
    for name, ref_ms, uniform_ms in COMPAT:
        row, plan = run_case(name, "1x4-v100", 512, "aceso-compat", str(DB / "miniset"), limit=12000)
        model = load_model(name)
        scored = evaluate_ref_config(plan_to_ref(plan), AcesoDB(str(DB / "miniset"), model.aceso_db_key))
        row.update(ref_search_ms=ref_ms, ref_uniform_ms=uniform_ms, exported_score_ms=round(scored.iteration_ms, 2),
                   vs_reference=round(ref_ms / scored.iteration_ms, 4),
                   target_met=bool(scored.iteration_ms <= ref_ms and row["cpu_s"] <= 10))
        rows.append(row)
    return rows


def section_analytic(args):
    rows = []
    for name, cluster, gbs in ANALYTIC:
        if args.quick and (name, cluster) not in QUICK:
            continue
        row, _ = run_case(name, cluster, gbs)
        n = parse_cluster(cluster).num_gpus
        row["target_s"] = 20 if n <= 32 else 60
        row["target_met"] = row["cpu_s"] <= row["target_s"]
        rows.append(row)
    return rows


def section_scale(args):
    cases = [("1x8-h100", "analytic", None)]
    if args.full_db:
        cases.append(("1x8-v100", "aceso-compat", args.full_db))
    rows = []
    for cluster, kind, db in cases:
        row, _ = run_case("gpt-scale-layer", cluster, 512, kind, db, num_layers=1024)
        row["target_s"], row["target_met"] = 30, row["cpu_s"] <= 30
        rows.append(row)
    return rows


def section_optimality(args):
    from search.planner.exhaustive import exhaustive_best
    from search.planner.synthetic import tiny_problem
    rows = []
    for seed in range(10 if args.quick else 30):
        cm, space, gbs = tiny_problem(seed)
        want, _, n = exhaustive_best(cm, gbs, space)
        res = search(cm, gbs, space, SearchOptions(budget_evals=400))
        got = res.plans[0].iteration_ms
        rows.append({"seed": seed, "gpus": space.num_gpus, "units": space.num_units, "plans": n,
                     "exhaustive_ms": want, "search_ms": got, "evals": res.evals,
                     "optimal": bool(got == want or abs(got - want) <= 1e-9 * max(1.0, want))})
    return rows


COLUMNS = {
    "compat": ["model", "exported_score_ms", "ref_search_ms", "vs_reference", "baseline_ms", "ref_uniform_ms",
               "speedup", "stages", "mbs", "shapes", "evals", "cpu_s", "wall_s", "target_met"],
    "analytic": ["model", "cluster", "iteration_ms", "baseline_ms", "speedup", "stages", "mbs", "evals", "cpu_s",
                 "wall_s", "target_s", "target_met"],
    "scale": ["model", "cluster", "cost_model", "iteration_ms", "baseline_ms", "speedup", "stages", "mbs", "evals",
              "cpu_s", "wall_s", "target_s", "target_met"],
}
SECTIONS = {"compat": section_compat, "analytic": section_analytic, "scale": section_scale,
            "optimality": section_optimality}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections: " + ", ".join(SECTIONS))
    ap.add_argument("--quick", action="store_true", help="a subset of the analytic cases and optimality seeds")
    ap.add_argument("--full-db", default=None,
                    help="the Aceso artifact's full database (profiler/profiled-time-eurosys): adds the aceso-compat "
                         "1024-layer scale case")
    args = ap.parse_args(argv)
    from rich.console import Console
    from rich.table import Table
    con = Console(width=160)
    out = {}
    for name in args.only.split(","):
        rows = SECTIONS[name.strip()](args)
        out[name] = rows
        if name == "optimality":
            ok = sum(r["optimal"] for r in rows)
            con.print(f"[bold]optimality[/]: search = exhaustive optimum on {ok}/{len(rows)} tiny problems "
                      f"({sum(r['plans'] for r in rows)} plans enumerated)")
            continue
        cols = COLUMNS.get(name) or [k for k in rows[0] if k != "shapes"]
        t = Table(title=name)
        for c in cols:
            t.add_column(c)
        for r in rows:
            t.add_row(*[str(r.get(c)) for c in cols])
        con.print(t)
    res_dir = ROOT / "bench" / "results"
    res_dir.mkdir(parents=True, exist_ok=True)
    (res_dir / "search_bench.json").write_text(json.dumps(out, indent=2) + "\n")
    con.print(f"wrote {res_dir / 'search_bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
