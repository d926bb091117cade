"""Published Megatron-Bridge MoE runs under our cost model, and the search against each published configuration.

Every MoE row of ../shared/published/megatron-bridge-25.09-25.11.json (Megatron-Bridge's performance tables of the
25.09 and 25.11 containers, measured tokens/s/GPU and TFLOP/s/GPU) is written as a plan and priced:

- plan (``row_plan``): the row's own Megatron-LM arguments imported by ``read_megatron`` (the one row -> plan path,
  ``aceso import --from megatron-lm``; bench/lowprec_published.py prices the dense rows the same way), so the model
  (vocabulary padding, GPT-OSS's ``--window-size 128,0``, DeepSeek's aux-loss coefficient, the token-drop capacity),
  the layers per model chunk (``--pipeline-model-parallel-layout``, first/last, or the embedding/loss split), the
  expert shape, recompute, the MoE settings, the distributed optimizer and overlaps are exactly what the flags mean;
  the importer's notes say what it approximates (e.g. ``--recompute-modules mla_up_proj`` is priced unrecomputed);
- cluster: the row's ``cluster`` string (GB200/GB300: NVL72 racks of 64 used GPUs); a GPU we have no preset for is
  "waits for issue 24" with the parser's reason; a precision ``TrainingSpec`` refuses likewise
  (``precision_support``), so the rows price once the recipes exist, with no list here to update;
- priced as ``aceso explain`` prices an imported plan: ``precision_of`` (the recipe, ``--fp8-param-gather``) and
  ``run_settings`` (gradients reduced in bf16 with ``--grad-reduce-in-bf16``, Megatron-LM's rule);
- predicted tokens/s/GPU = ``gbs x seq / iteration / GPUs``; TFLOP/s/GPU by the row's own FLOP count (the
  published TFLOP/s scaled by predicted / measured tokens, so both columns share one error); error = predicted /
  measured - 1; memory: whether every stage fits the GPU and the fullest stage's peak / the GPU's capacity
  (``GiB/GPU``); per run over the GPU, that stage's memory terms (``memory_breakdown``) with the importer's notes
  and the table's own checks, printed under the table.

Then, on every priced row, two searches under the row's MoE settings (``search_row``), each with the speedup over
the published configuration (the median and lowest over the rows), its plan and CPU seconds: seeded with the
published plan (``planner.aceso.search``; never slower under our own model unless that plan is outside the search
space, which the table says), and unseeded (the uniform baseline and the search's own initial plans, as ``aceso
search`` starts: the honest measure of the search; how many rows reach 1.0x). The target is ``aceso`` (per-stage
shapes) for bf16 rows and ``megatron-lm`` for low-precision ones (the aceso runtime runs no FP8/FP4 recipe yet:
``search.targets.preflight.RUNTIME_LOW_PRECISION``). A published run over the GPU under our model is no fitting plan, so a
search below 1.0x there is the price of fitting (marked in the table).

Then the "folding paper" group (``run_folding``): bench/data/moe_folding_paper.json's rows, the MoE parallel
folding paper's and NVIDIA's MoE report's headline numbers (no settings stated: listed, not priced) and the
Megatron-MoE-ModelZoo's and Megatron-LM's DeepSeek-V3 GB200 guide's measured runs, each with the Megatron-LM
arguments it passes, priced the same way (``prepare``); TFLOP/s by Megatron-LM's own FLOP count
(``megatron_moe_flops``), error per row, the MAE over the rows with every setting stated, and the search on each.

A row the cost model refuses says so in the table. The search-time line: DeepSeek-V3 on 256 H100s (32x8-h100, global batch 4096, one worker,
the default budget), target 60 s on one core. Run: ``python bench/moe_published.py`` (table and the time line;
bench/results/moe_published.json); ``--no-search`` prices only; ``--budget-s`` caps each row's searches (3000 evaluations each; the cap is wall-clock, so on a loaded machine it
binds first: the per-row CPU seconds say how much search each got); ``--json`` writes elsewhere;
``--breakdown`` adds each priced row's iteration by stage; ``--walk TO FROM`` decomposes a published pair (rows of
either shared table): row FROM priced, then moved to TO's release and flags one setting at a time, each step's
breakdown in ms (docs/costmodel.md, "The Qwen3-30B GB300 pair, term by term"). Each row is priced as its own release (``release`` = the
row's container: ``search/costmodel/release_constants.py``), with its own command line's stack flags (CUDA graphs,
the EP overlap, delayed weight gradients: ``bench/recipes.py`` drops only what megatron-core refuses with the
row's settings); the constants are fitted per release by ``python bench/published_runs.py --fit-release``
(bench/release_fit.py, whose ``KEPT_OUT`` lists the rows kept out of the fits with their published evidence).
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from search.io.argparser import AcesoParser  # noqa: E402  (no abbreviations, one-line errors)
from search.spec.cluster import parse_cluster  # noqa: E402
from search.pricing import make_cost_model  # noqa: E402
from search.io.errors import AcesoError  # noqa: E402
from search.megatron.config import NO_RECOMPUTE, Recompute  # noqa: E402
from search.megatron.flops import num_floating_point_operations  # noqa: E402
from search.megatron.importer import read_megatron  # noqa: E402
from search.spec.plan import ParallelPlan  # noqa: E402
from search.costmodel.plan_view import run_settings  # noqa: E402
from search.costmodel.plan_view import precision_of  # noqa: E402
from search.spec.presets import load_model  # noqa: E402
from search.spec.training import TrainingSpec  # noqa: E402
from recipes import own_args  # noqa: E402

BRIDGE = ROOT.parent / "shared" / "published" / "megatron-bridge-25.09-25.11.json"
WAITS = "waits for issue 24"


# ----- what a row needs ---------------------------------------------------------------------------------------------
def load_rows(path: Path = BRIDGE) -> list[dict]:
    """The MoE rows of the Megatron-Bridge file."""
    return [r for r in json.loads(Path(path).read_text())["rows"] if r.get("moe")]


def precision_name(label: str) -> str:
    """Our recipe name of a Bridge precision label (the low-precision branch's ``LABELS`` where it exists)."""
    try:
        from search.settings.precision import LABELS
    except ImportError:
        LABELS = {}
    return LABELS.get(label, label)


def precision_support(label: str) -> str | None:
    """None if ``TrainingSpec`` takes the row's precision, else the reason (its own validation, no list here)."""
    name = precision_name(label)
    try:
        TrainingSpec(global_batch_size=1, precision=name)
    except ValueError:
        return f"precision {label}: no {name} kernels in the cost model yet"
    return None


def search_target(label: str) -> str:
    """``megatron-lm`` for a low-precision recipe (the runtime runs none yet), else ``aceso``."""
    try:
        from search.settings.precision import is_low
        return "megatron-lm" if is_low(precision_name(label)) else "aceso"
    except (ImportError, KeyError):
        return "aceso"


def flags(args: str) -> dict[str, list[str]]:
    """``--flag v ...`` of a command line as a dict (values as given; a bare flag maps to [])."""
    out: dict[str, list[str]] = {}
    name = None
    for tok in shlex.split(args):
        if tok.startswith("--"):
            name, _, val = tok.partition("=")
            out[name] = [val] if val else []
        elif name is not None:
            out[name].append(tok)
    return out


def _int(f: dict, name: str, default: int | None = None) -> int | None:
    return int(f[name][0]) if f.get(name) else default


def recompute_of(f: dict) -> Recompute:
    gran = (f.get("--recompute-granularity") or [None])[0]
    if gran == "selective":
        return Recompute("selective", modules=tuple(f.get("--recompute-modules") or ["core_attn"]))
    if gran == "full":
        return Recompute("full", (f.get("--recompute-method") or ["uniform"])[0], _int(f, "--recompute-num-layers", 1))
    return NO_RECOMPUTE


def row_import(row: dict, cluster=None):
    """The row's arguments imported (``read_megatron``: the one row -> plan path, ``aceso import --from
    megatron-lm``) as its own release runs them (``release``: the row's container; ``recipes.own_args``: the stack
    flags of a recipe later than the container are not what ran): the plan, its Megatron config, notes and ignored
    flags."""
    from recipes import own_args
    args, _ = own_args(row)
    return read_megatron(args, cluster=cluster, world_size=row["gpus"], release=row.get("version"),
                         version="core_v0.16.1")      # the rows' args are core_v0.16.1 lines (published/README.md)


def row_plan(row: dict, cluster=None) -> ParallelPlan:
    """The row's published configuration as the plan its flags mean."""
    return row_import(row, cluster).plan


def _reason(e: Exception) -> str:
    """One line of an error (a pydantic validation error: its first message)."""
    errs = getattr(e, "errors", None)
    if callable(errs):
        try:
            return str(errs()[0]["msg"]).removeprefix("Value error, ")
        except Exception:  # noqa: BLE001 - not a pydantic error after all
            pass
    return str(e).splitlines()[0]


def prepare(row: dict) -> dict:
    """The row's plan, cluster and training spec, or ``{"status": why not}``."""
    whys = [precision_support(row["precision"])]
    try:
        cluster = parse_cluster(row["cluster"])
    except AcesoError as e:
        whys.append(str(e).split(";")[0].split(": ", 1)[-1])
        cluster = None
    plan, built = None, "no arguments: " + (row.get("why_not") or "the row has no command line")
    if row["args"]:
        try:
            imported = row_import(row, cluster)
            plan, built = imported.plan, "plan builds"
        except (AcesoError, ValueError) as e:
            built = f"not buildable: {_reason(e).removeprefix('megatron-lm arguments: ')}"
    if any(whys):
        return {"status": f"{WAITS}: " + "; ".join(w for w in whys if w) + f" ({built.split(':')[0]})"}
    if plan is None:
        return {"status": built}
    training = TrainingSpec(global_batch_size=plan.global_batch_size,
                            micro_batch_sizes=sorted({1, 2, 4, 8, row["mbs"]}), **precision_of(plan),
                            distributed_optimizer=plan.distributed_optimizer, attention="flash",
                            tp_comm_overlap=plan.tp_comm_overlap,   # the search keeps the row's --tp-comm-overlap
                            virtual_stages=None)      # every degree Megatron-LM accepts (the rows use up to 24)
    return {"status": "ok", "plan": plan, "cluster": cluster, "training": training,
            "settings": run_settings(plan.settings, training.precision), "notes": imported.notes}


# ----- pricing and searching ----------------------------------------------------------------------------------------
def price_row(row: dict, search_budget_s: float | None = None) -> dict:
    out = {"id": row["id"], "model": row["model"], "cluster": row["cluster"], "precision": row["precision"],
           "config": f"tp{row['tp']} pp{row['pp']} cp{row['cp']} ep{row['ep']} vp{row['vp']} mbs{row['mbs']} "
                     f"gbs{row['gbs']}", "measured_tokens": row["tokens_per_s_per_gpu"],
           "measured_tflops": row["tflops_per_gpu"],
           "recompute": recompute_of(flags(row["args"])).label if row["args"] else None,
           "dropped_flags": own_args(row)[1] or None,
           "dispatch": "padded" if "--moe-pad-expert-input-to-capacity" in (row["args"] or "") else "dropless"}
    prep = prepare(row)
    if prep["status"] != "ok":
        return {**out, "status": prep["status"]}
    out.update(price_prepared(prep, row["precision"], search_budget_s))
    if out["status"] != "priced":
        return out
    tokens = row["gbs"] * prep["plan"].model.seq_length / (out["iteration_ms"] / 1000) / row["gpus"]
    meas = row["tokens_per_s_per_gpu"]
    out.update(tokens=tokens, checks=row.get("checks") or [], error=(tokens / meas - 1) if meas else None,
               tflops=row["tflops_per_gpu"] * tokens / meas if meas and row["tflops_per_gpu"] else None)
    return out


def price_prepared(prep: dict, precision: str, search_budget_s: float | None = None) -> dict:
    """A prepared row's plan (``prepare``) under our cost model: its iteration time, memory (the fullest stage's
    terms), the importer's notes and, with a budget, the search against it; or ``{"status": why not}``."""
    plan, training = prep["plan"], prep["training"]
    try:
        cm = make_cost_model(plan.model, prep["cluster"], training, settings=prep["settings"])
        cost = cm.evaluate(plan)
    except AcesoError as e:
        return {"status": f"not priced: {_reason(e).split(';')[0]}"}
    worst = max(range(len(cost.stages)), key=lambda i: cost.stages[i].memory_mb)
    out = {"status": "priced", "iteration_ms": cost.iteration_ms, "fits": cost.fits,
           "max_memory_gib": cost.max_memory_mb / 1024, "limit_gib": cost.memory_limit_mb / 1024,
           "memory_stage": worst, "memory_gib": {k: v / 1024 for k, v in cost.stages[worst].memory_breakdown.items()},
           "notes": prep["notes"]}
    if search_budget_s is not None:
        out.update(search_row(cm, training, plan, cost.iteration_ms, search_budget_s, search_target(precision)))
    return out


def search_row(cm, training, plan, published_ms: float, budget_s: float, target: str = "aceso") -> dict:
    """Two searches under the published MoE settings (``Space.moe``): seeded with the published plan (``search_*``:
    never slower under our own model unless the plan is outside the space), and unseeded (``free_*``: the uniform
    baseline and the search's own initial plans, as ``aceso search`` starts, so the honest measure of the search).
    Each: its time, the speedup over the published plan, the plan's shape and CPU seconds."""
    from search.planner.api import make_space, runtime_training
    from search.planner.baseline import best_uniform
    from search.planner.state import from_plan
    if target != "megatron-lm":
        training = runtime_training(training, strict=False)
    space = make_space(cm, training, target, moe=plan.moe)      # the published MoE settings on every state
    seed = from_plan(plan)[0]
    out = {"search_target": target}
    if not space.legal(space.normalize(seed)):
        out.update(search_ms=None, speedup=None, search_s=0.0,
                   search_note="the published plan is outside the search space")
    else:
        out.update(_searched(cm, training, space, [seed], published_ms, budget_s, "search"))
    c0 = time.process_time()
    base = best_uniform(cm, training.global_batch_size, space, cm.model)
    seeds = [base.state] if base is not None and base.fits else []
    free = _searched(cm, training, space, seeds, published_ms, budget_s, "free")
    free["free_s"] += time.process_time() - c0 - free["free_s"]      # the baseline's seconds included
    return {**out, **free}


def _searched(cm, training, space, seeds, published_ms: float, budget_s: float, key: str) -> dict:
    from search.planner.aceso import SearchOptions, search
    c0 = time.process_time()
    res = search(cm, training.global_batch_size, space, SearchOptions(budget_evals=3000, budget_s=budget_s,
                                                                      seeds=list(seeds)))
    best = res.plans[0] if res.plans else None
    if best is None or not best.fits:
        return {f"{key}_ms": None, f"{key}_speedup" if key != "search" else "speedup": None,
                f"{key}_s": time.process_time() - c0}
    shapes = " | ".join(sorted({f"tp{s.tp} dp{s.dp} ep{s.ep} etp{s.expert_tp}" for s in best.state.shapes}))
    disp = best.moe.token_dispatcher if best.moe is not None else "alltoall"
    return {f"{key}_ms": best.iteration_ms, "speedup" if key == "search" else f"{key}_speedup":
            published_ms / best.iteration_ms,
            f"{key}_shape": f"pp{best.state.num_stages} v{best.state.num_chunks} m{best.state.mbs} {shapes} "
                            f"{disp}", f"{key}_s": time.process_time() - c0}


def search_time(model: str = "deepseek-v3", cluster: str = "32x8-h100", gbs: int = 4096, cap_s: float = 600.0) -> dict:
    """Seconds of one default search (one worker, 3000 evaluations; stopped at ``cap_s``) of ``model`` on
    ``cluster``."""
    from search.planner.aceso import SearchOptions, search
    from search.planner.api import make_space
    m, cl = load_model(model), parse_cluster(cluster)
    training = TrainingSpec(global_batch_size=gbs)
    out = {"model": model, "cluster": cluster, "gbs": gbs, "target_s": 60.0}
    try:
        cm = make_cost_model(m, cl, training)
    except AcesoError as e:
        return {**out, "status": f"not priced: {_reason(e).split(';')[0]}"}
    space = make_space(cm, training)
    t0, c0 = time.monotonic(), time.process_time()
    res = search(cm, gbs, space, SearchOptions(budget_s=cap_s))
    best = res.plans[0] if res.plans else None
    return {**out, "status": "searched", "seconds": time.monotonic() - t0, "cpu_s": time.process_time() - c0,
            "evaluations": res.evals,
            "iteration_ms": best.iteration_ms if best is not None and best.fits else None}


def summarize(rows: list[dict]) -> dict:
    priced = [r for r in rows if r["status"] == "priced" and r.get("error") is not None]
    speed = [r["speedup"] for r in rows if r.get("speedup") is not None]
    free = [r["free_speedup"] for r in rows if r.get("free_speedup") is not None]
    searched = [r for r in rows if "free_s" in r]
    return {"rows": len(rows), "priced": len(priced),
            "mae": statistics.fmean(abs(r["error"]) for r in priced) if priced else None,
            "all_fit": all(r["fits"] for r in priced) if priced else None,
            "median_speedup": statistics.median(speed) if speed else None,
            "min_speedup": min(speed) if speed else None,
            "outside_space": sum("search_note" in r for r in rows),
            "median_free_speedup": statistics.median(free) if free else None,
            "min_free_speedup": min(free) if free else None,
            "free_at_least_1": sum(x >= 1.0 - 1e-9 for x in free), "free_rows": len(searched),
            "waiting": sum(r["status"].startswith(WAITS) for r in rows)}


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _gib(r: dict) -> str:
    """Predicted peak GiB per GPU / the GPU's capacity."""
    return f"{r['max_memory_gib']:.0f}/{r['limit_gib']:.0f}" if "max_memory_gib" in r else "-"


def print_memory(rows: list[dict]) -> None:
    """Per priced run over the GPU: its fullest stage's memory terms (GiB) and what the importer approximated."""
    over = [r for r in rows if r["status"] == "priced" and not r["fits"]]
    if not over:
        return
    print("\nruns over the GPU (fullest stage, GiB per GPU; memory.py / moe_cost.py terms):")
    for r in over:
        terms = " ".join(f"{k} {v:.1f}" for k, v in r["memory_gib"].items() if v >= 0.05)
        print(f"  {r['id']}: stage {r['memory_stage']} {r['max_memory_gib']:.1f} of {r['limit_gib']:.1f}: {terms}")
        for note in r["notes"]:
            print(f"    importer: {note}")
        for note in r["checks"]:
            print(f"    the table's own check: {note}")


def print_table(rows: list[dict], summary: dict) -> None:
    print(f"{'model':16}{'cluster':11}{'prec':14}{'config':36}{'meas tok':>9}{'pred tok':>9}{'err':>7}"
          f"{'TFLOP/s':>8}{'fits':>5}{'GiB/GPU':>10}{'speedup':>8}  status")
    for r in rows:
        print(f"{r['model']:16}{r['cluster']:11}{r['precision']:14}{r['config']:36}"
              f"{_fmt(r['measured_tokens'], '9.0f', '        -')}{_fmt(r.get('tokens'), '9.0f', '        -')}"
              f"{_fmt(r.get('error'), '+7.1%', '      -')}{_fmt(r.get('tflops'), '8.0f', '       -')}"
              f"{('yes' if r.get('fits') else 'no') if 'fits' in r else '-':>5}"
              f"{_gib(r):>10}"
              f"{_fmt(r.get('speedup'), '7.2f', '      -') + ('x' if r.get('speedup') else ' ')}  {r['status']}")
    s = summary
    print(f"\n{s['priced']} of {s['rows']} MoE rows priced; MAE {_fmt(s['mae'], '.1%')}; every priced run fits: "
          f"{s['all_fit']}; search vs published: median {_fmt(s['median_speedup'], '.3f')}x, lowest "
          f"{_fmt(s['min_speedup'], '.3f')}x; {s['waiting']} rows {WAITS}")
    if s["free_rows"]:
        print(f"unseeded search vs published: median {_fmt(s['median_free_speedup'], '.3f')}x, lowest "
              f"{_fmt(s['min_free_speedup'], '.3f')}x, >= 1.0x on {s['free_at_least_1']} of {s['free_rows']} rows; "
              f"published plan outside the search space: {s['outside_space']} rows")


def print_search(rows: list[dict]) -> None:
    """Per searched row: published ms, the seeded and the unseeded search (ms, speedup, plan shape, CPU s)."""
    rows = [r for r in rows if "free_s" in r]
    if not rows:
        return
    print(f"\nsearch per row (ms per iteration under our model; CPU s, the baseline's included in unseeded)\n"
          f"{'model':16}{'cluster':11}{'prec':9}{'target':12}{'published':>10}{'seeded':>10}{'x':>7}{'s':>6}"
          f"{'unseeded':>10}{'x':>7}{'s':>6}  seeded plan / unseeded plan")
    for r in rows:
        print(f"{r['model']:16}{r['cluster']:11}{r['precision'][:8]:9}{r['search_target']:12}"
              f"{r['iteration_ms']:10.0f}{_fmt(r.get('search_ms'), '10.0f', '         -')}"
              f"{_fmt(r.get('speedup'), '7.3f', '      -')}{r['search_s']:6.0f}"
              f"{_fmt(r.get('free_ms'), '10.0f', '         -')}{_fmt(r.get('free_speedup'), '7.3f', '      -')}"
              f"{r['free_s']:6.0f}  {r.get('search_shape') or r.get('search_note', '-')} / {r.get('free_shape', '-')}"
              + ("" if r["fits"] else "  (published plan over the GPU under our model)"))


def main(argv: list[str] | None = None) -> int:
    ap = AcesoParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bridge", default=str(BRIDGE), help="the Megatron-Bridge published-runs file")
    ap.add_argument("--folding", default=str(FOLDING), help="the other published MoE runs (the folding paper, "
                    "NVIDIA's MoE report, the ModelZoo): bench/data/moe_folding_paper.json")
    ap.add_argument("--no-search", action="store_true", help="price the published configurations only")
    ap.add_argument("--budget-s", type=float, default=60.0, help="wall-clock cap of each row's search (s)")
    ap.add_argument("--only", default=None, help="only rows whose id contains this")
    ap.add_argument("--breakdown", action="store_true", help="also print each priced row's stage breakdown")
    ap.add_argument("--fit", action="store_true", help="fit the MoE time constants (moe_cost.py) and stop")
    ap.add_argument("--markdown", action="store_true", help="also print the per-row table of docs/costmodel.md")
    ap.add_argument("--host-scan", action="store_true",
                    help="print the HOST_LAUNCH_MS each dropless row implies (scan_host) and stop")
    ap.add_argument("--json", default=None, help="where to write the results (default bench/results/moe_published.json)")
    ap.add_argument("--walk", nargs=2, metavar=("TO", "FROM"), default=None,
                    help="decompose a published pair: price row FROM, then move it to row TO's release and flags one "
                         "setting at a time, with the breakdown of each step (row ids of either shared table), and stop")
    args = ap.parse_args(argv)
    path = Path(args.bridge)
    if not path.is_file():
        print(f"--bridge {path}: no such file (../shared/published/ beside the worktree); give the file")
        return 2
    if args.walk:
        by_id = {r["id"]: r for f in (path, NEWER) if f.is_file() for r in load_rows(f)}
        missing = [i for i in args.walk if i not in by_id]
        if missing:
            print(f"--walk: no row {missing[0]!r} in {path.name} or {NEWER.name}; give two row ids as the bench prints them")
            return 2
        try:
            print_walk(by_id[args.walk[0]], by_id[args.walk[1]])
        except ValueError as e:
            print(f"--walk: {e}")
            return 2
        return 0
    raw = [r for r in load_rows(path) if args.only is None or args.only in r["id"]]
    if args.fit:
        fit(raw)
        return 0
    if args.host_scan:
        print("HOST_LAUNCH_MS each dropless row implies (its error 0 at that constant; '-': device time alone is "
              "slower):")
        scan_host(raw)
        return 0
    rows = [price_row(r, None if args.no_search else args.budget_s) for r in raw]
    summary = summarize(rows)
    print_table(rows, summary)
    print_search(rows)
    print_memory(rows)
    summary["fit"] = fit_summary(rows)
    print_fit_summary(summary["fit"], rows)
    if args.breakdown:
        print_breakdown(rows, raw)
    if args.markdown:
        print_markdown(rows)
    folding = {"rows": [], "summary": {"status": f"{args.folding}: no such file"}}
    if Path(args.folding).is_file():
        folding = run_folding(Path(args.folding), args.only, args.breakdown, None if args.no_search else args.budget_s)
    summary["folding"] = folding["summary"]
    timing = search_time() if not args.no_search else {"status": "skipped (--no-search)"}
    summary["search_time"] = timing
    print(f"search time, {timing.get('model', 'deepseek-v3')} on {timing.get('cluster', '32x8-h100')} (target 60 s): "
          + (f"{timing['seconds']:.1f} s wall, {timing['cpu_s']:.1f} s CPU, {timing['evaluations']} evaluations"
             if "seconds" in timing else timing["status"]))
    dest = Path(args.json) if args.json else ROOT / "bench" / "results" / "moe_published.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps({"rows": rows, "summary": summary, "folding_rows": folding["rows"]}, indent=2) + "\n")
    print(f"\nwrote {dest}")
    return 0


# ----- --breakdown: where each priced row's iteration goes (issue 22, moetime) --------------------------------------
BREAKDOWN = ("attention", "experts", "a2a", "router", "shared", "host", "other", "p2p", "sync", "bubble")


def breakdown(row: dict) -> dict | None:
    """ms of one iteration on the pipeline's busiest stage by stage of the layer: the MoE unit's parts
    (``moe_cost.moe_parts``: expert GEMMs, exposed all-to-all, router / permute, shared expert and its TP
    collectives), the host-bound wait (``moe_cost.host_layers``), the attention units, the rest of the stage's compute (embedding, head, dense
    layers, MTP, recompute), exposed p2p, the per-iteration sync (DP / EDP gradients, step, parameter gather) and
    the bubble (iteration - the stage's busy time). None: the row is not priced."""
    from search.costmodel.analytic import _lp_unit
    from search.costmodel.moe_cost import moe_parts
    from search.costmodel.types import Features
    from search.settings.moe_plan import moe_settings
    prep = prepare(row)
    if prep["status"] != "ok":
        return None
    plan = prep["plan"]
    try:
        cm = make_cost_model(plan.model, prep["cluster"], prep["training"], settings=prep["settings"])
        cost = cm.evaluate(plan)
    except AcesoError:
        return None
    i = cost.pipeline.bottleneck
    st, sc, m, M = plan.stages[i], cost.stages[i], plan.model, plan.num_micro_batches
    b, cfg = plan.micro_batch_size / st.dp, moe_settings(plan)
    feats = Features.of_plan(plan)
    ov = feats.tp_comm_overlap and st.sequence_parallel and st.tp > 1
    table = cm.unit_table(b, st.tp, st.cp, st.sequence_parallel, ov, st.ep, st.etp or 0, cfg, feats)
    units = [u for a, e in st.spans for u in range(a, e)]
    moe_units = [u for u in units if m.units[u].kind == "moe"]
    att = sum(table.fwd_ms[u] + table.bwd_ms[u] for u in units if m.units[u].kind == "attention") * M
    out = dict.fromkeys(BREAKDOWN, 0.0)
    if moe_units:
        parts = moe_parts(cm.source, b, m.seq_length // st.cp, st.tp, st.sequence_parallel, st.ep, st.etp or 0,
                          cfg, ov, _lp_unit(cm.source, m.units[moe_units[0]]))
        for name in ("experts", "router"):
            out[name] = sum(parts[name]) * len(moe_units) * M
        out["shared"] = (sum(parts["shared"]) + sum(parts["tp"])) * len(moe_units) * M
        out["a2a"] = sum(table.ep_comm_ms[u] for u in moe_units) * M if table.ep_comm_ms is not None else 0.0
        out["host"] = sum(table.host_ms[u] for u in moe_units) * M if table.host_ms is not None else 0.0
    out["attention"] = att
    busy = (sc.fwd_ms + sc.bwd_ms + sc.recompute_ms) * M
    out["other"] = busy - sum(out[n] for n in ("attention", "experts", "a2a", "router", "shared", "host"))
    out["p2p"] = sc.p2p_ms * M
    out["sync"] = cost.pipeline.stage_busy_ms[i] - busy - out["p2p"] if cost.pipeline.stage_busy_ms else \
        sc.dp_sync_ms + sc.optimizer_ms + sc.prologue_ms
    out["bubble"] = cost.iteration_ms - cost.pipeline.stage_busy_ms[i] if cost.pipeline.stage_busy_ms else 0.0
    return {"stage": i, "iteration_ms": cost.iteration_ms, **out}


def print_breakdown(rows: list[dict], raw: list[dict]) -> None:
    """The per-row stage breakdown (percent of the iteration) under the table."""
    print(f"\nbreakdown: % of the iteration on the busiest stage\n{'model':16}{'cluster':11}{'prec':9}{'mbs':>4}"
          f"{'err':>7}{'iter ms':>9}" + "".join(f"{n[:7]:>8}" for n in BREAKDOWN))
    for r, src in zip(rows, raw):
        bd = breakdown(src) if r["status"] == "priced" else None
        if bd is None:
            continue
        it = bd["iteration_ms"]
        print(f"{r['model']:16}{r['cluster']:11}{r['precision'][:8]:9}{src['mbs']:>4}{r['error']:+7.1%}{it:9.0f}"
              + "".join(f"{100 * bd[n] / it:8.1f}" for n in BREAKDOWN))


# ----- --walk: a published pair decomposed one setting at a time (issue 34) ----------------------------------------
# Flags that are one setting together (a dispatcher and its flex backend, a graph implementation and its scope)
WALK_GROUPS = {"--moe-token-dispatcher-type": "dispatcher", "--moe-flex-dispatcher-backend": "dispatcher",
               "--cuda-graph-impl": "cuda_graphs", "--cuda-graph-scope": "cuda_graphs",
               **dict.fromkeys(("--pipeline-model-parallel-size", "--pipeline-model-parallel-layout",
                                "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
                                "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"), "layout"),
               "--seq-length": "sequence", "--max-position-embeddings": "sequence"}
NEWER = ROOT.parent / "shared" / "published" / "megatron-bridge-26.02-26.04.json"


def walk(a: dict, b: dict) -> list[tuple[str, dict]]:
    """Row ``b`` moved to row ``a`` one setting at a time: (what changed, the row) per step, ``b`` first, then its
    release set to ``a``'s, then each flag (``WALK_GROUPS``: flags that are one setting) that differs, in ``b``'s
    order then ``a``'s; the last step has ``a``'s release and flags. The two rows must be one model on one cluster
    at one global batch (what a published pair of the same configuration holds fixed)."""
    key = ("model", "cluster", "gpus", "gbs")
    if any(a[k] != b[k] for k in key):
        raise ValueError("a walk needs two rows of one model, cluster, GPU count and global batch: "
                         + ", ".join(f"{k} {b[k]} vs {a[k]}" for k in key if a[k] != b[k]))
    fa, fb = flags(a["args"]), flags(b["args"])
    diff = [k for k in [*fb, *(k for k in fa if k not in fb)] if fa.get(k) != fb.get(k)]
    groups = list(dict.fromkeys(WALK_GROUPS.get(k, k) for k in diff))
    cur, cf = dict(b), dict(fb)
    steps = [(f"{b['version']} as published", cur)]
    if a["version"] != b["version"]:
        cur = {**cur, "version": a["version"]}
        steps.append((f"release {b['version']} -> {a['version']}", cur))
    for g in groups:
        keys = [k for k in diff if WALK_GROUPS.get(k, k) == g]
        was = " ".join(" ".join(fb.get(k, [])) for k in keys).strip() or ("on" if all(k in fb for k in keys) else "off")
        now = " ".join(" ".join(fa.get(k, [])) for k in keys).strip() or ("on" if all(k in fa for k in keys) else "off")
        for k in keys:
            if k in fa:
                cf[k] = fa[k]
            else:
                cf.pop(k, None)
        cur = {**cur, "args": " ".join(shlex.join([k, *v]) for k, v in cf.items())}
        if "--micro-batch-size" in keys:
            cur["mbs"] = a["mbs"]
        if "--seq-length" in keys:
            cur["seq"] = a["seq"]
        steps.append((f"{g.lstrip('-')} {was} -> {now}", cur))
    return steps


def print_walk(a: dict, b: dict) -> list[dict]:
    """The walk from ``b`` to ``a`` (``walk``): per step the priced iteration (ms), its tokens/s per GPU and the
    busiest stage's breakdown in ms (``breakdown``), then each term's change over the walk; returns the steps."""
    out = []
    print(f"walk: {b['id']} (measured {b['tokens_per_s_per_gpu']} tok/s/GPU) -> {a['id']} (measured "
          f"{a['tokens_per_s_per_gpu']}): measured ratio {a['tokens_per_s_per_gpu'] / b['tokens_per_s_per_gpu']:.3f}")
    print(f"  {'step':58}{'iter ms':>9}{'tok/s':>7}" + "".join(f"{n[:7]:>8}" for n in BREAKDOWN))
    for label, row in walk(a, b):
        bd = breakdown(row)
        if bd is None:
            print(f"  {label[:58]:58}  not priced: {price_row(row)['status']}")
            continue
        tok = row["gbs"] * row["seq"] / (bd["iteration_ms"] / 1000) / row["gpus"]
        out.append({"step": label, "tokens": tok, **bd})
        print(f"  {label[:58]:58}{bd['iteration_ms']:9.0f}{tok:7.0f}" + "".join(f"{bd[n]:8.0f}" for n in BREAKDOWN))
    if len(out) > 1 and out[-1]["step"] == label:
        print(f"  {'change over the walk (ms)':58}{out[-1]['iteration_ms'] - out[0]['iteration_ms']:+9.0f}{'':7}"
              + "".join(f"{out[-1][n] - out[0][n]:+8.0f}" for n in BREAKDOWN))
        print(f"  predicted ratio {out[-1]['tokens'] / out[0]['tokens']:.3f}")
    return out


# ----- rows kept out of the fit (bench/release_fit.py KEPT_OUT: one list for every Bridge row) -------------------
def fit_note(row: dict) -> str | None:
    """Why a priced row is kept out of the fits and targets (None: it counts): ``release_fit.kept_out``, each
    with its published evidence."""
    from release_fit import kept_out
    return kept_out(row)


def fit_summary(rows: list[dict]) -> dict:
    """MAE over the fitted rows, and the rows kept out with their errors and reasons."""
    priced = [r for r in rows if r["status"] == "priced" and r.get("error") is not None]
    fitted = [r for r in priced if fit_note(r) is None]
    return {"fit_rows": len(fitted), "fit_mae": statistics.fmean(abs(r["error"]) for r in fitted) if fitted else None,
            "out_of_fit": [{"id": r["id"], "error": r["error"], "why": fit_note(r)} for r in priced if fit_note(r)]}


def print_fit_summary(fs: dict, rows: list[dict] = ()) -> None:
    print(f"fitted rows: {fs['fit_rows']}, MAE {_fmt(fs['fit_mae'], '.1%')}; kept out of the fit:")
    for r in fs["out_of_fit"]:
        print(f"  {r['error']:+7.1%}  {r['id']}: {r['why']}")
    for r in rows:
        if r.get("dropped_flags"):
            print(f"  priced without {' '.join(r['dropped_flags'])}, which megatron-core refuses with the row's "
                  f"other settings (recipes.own_args): {r['id']}")


def fit(raw: list[dict]) -> None:
    """The MoE time constants are per release now (``search/costmodel/release_constants.py``): fitted, with the
    dense low-precision ones, by ``python bench/published_runs.py --fit-release GROUPS`` (bench/release_fit.py)."""
    print("the MoE time constants are per release: python bench/published_runs.py --fit-release "
          "25.09,25.11,26.02.01,26.04.01 (bench/release_fit.py)")


def print_markdown(rows: list[dict]) -> None:
    """The per-row table of docs/costmodel.md "MoE calibration" (every priced row, its error and whether it is
    fitted; the out-of-fit label is the reason's text before its first colon)."""
    print("| release model | cluster | precision | config | dispatch | measured tok/s/GPU | predicted | error | fit "
          "| fits (peak / GPU) |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["status"] != "priced" or r.get("error") is None:
            continue
        note = fit_note(r)
        fit_col = f"out: {note.split(':')[0]}" if note else "fit"
        if r.get("dropped_flags"):
            fit_col += " (without " + " ".join(r["dropped_flags"]).replace("--", "") + ": refused)"
        print(f"| {r['id'].split('/')[0]} {r['model']} | {r['cluster']} | {r['precision']} | {r['config']} | "
              f"{r['dispatch']} | {r['measured_tokens']:.0f} | {r['tokens']:.0f} | "
              f"{r['error']:+.1%} | {fit_col} | {'yes' if r['fits'] else 'no'} ({_gib(r)} GiB) |")


def scan_host(raw: list[dict], hi: float = 1.0) -> list[dict]:
    """Per dropless row (the dispatcher syncs: ``moe_cost.syncs``), the ``HOST_LAUNCH_MS`` of its release
    (``release_constants``) that would make its error 0 (bisection; None where the device time alone already prices
    it slower than measured): the host time per kernel launch each row implies (``host.py``), to see whether one
    constant per release can serve them all. Prints one line per row and restores the constants."""
    from search.costmodel import moe_cost as mc
    from search.costmodel import release_constants as rc
    out = []
    for row in raw:
        prep = prepare(row)
        if prep["status"] != "ok" or not prep["plan"].model.moe or not mc.syncs(prep["plan"].model, prep["plan"].moe) \
                or not row["tokens_per_s_per_gpu"]:
            continue
        group = rc.FITS[rc.fit_of(row["version"])][1]
        keep = group.get("HOST_LAUNCH_MS")
        try:
            def err(h: float) -> float:
                group["HOST_LAUNCH_MS"] = h
                return price_row(row)["error"]
            e0, implied = err(0.0), None
            if e0 > 0 and err(hi) < 0:
                lo, up = 0.0, hi
                for _ in range(20):
                    mid = (lo + up) / 2
                    lo, up = (mid, up) if err(mid) > 0 else (lo, mid)
                implied = lo
        finally:
            if keep is None:
                group.pop("HOST_LAUNCH_MS", None)
            else:
                group["HOST_LAUNCH_MS"] = keep
        out.append({"id": row["id"], "error_device_only": e0, "implied_host_launch_ms": implied})
        print(f"  {_fmt(implied, '6.3f', '     -')} ms  (device only {e0:+7.1%})  {row['id']}"
              + (f"  [{fit_note(row)[:40]}...]" if fit_note(row) else ""))
    return out


# ----- other published MoE runs: the folding paper, NVIDIA's MoE report, the ModelZoo (issue 22, folding) ----------
FOLDING = ROOT / "bench" / "data" / "moe_folding_paper.json"
# The release each system's ModelZoo runs are priced as (release_constants; the rows state none): the ModelZoo's
# Dockerfiles at e8650517 build transformer-engine from source, H100 at 07afda98 (2.6.0.dev0, 2025-07-16: older
# than every listed container, so the oldest, 25.09), GB200 / GB300 at 99df8810 (2.12.0.dev0: 26.02 ships 2.12)
FOLDING_RELEASE = {"H100": "25.09", "GB200": "26.02", "GB300": "26.02"}


def load_folding_rows(path: Path = FOLDING) -> list[dict]:
    """The rows of bench/data/moe_folding_paper.json (its ``about`` says what each field is)."""
    return json.loads(Path(path).read_text())["rows"]


# Megatron-LM's own FLOP count for --log-throughput (core_v0.16.1 training.py num_floating_point_operations): the
# ModelZoo's and the DeepSeek guide's TFLOP/s are this count over the measured step time
megatron_moe_flops = num_floating_point_operations


def price_folding_row(row: dict, search_budget_s: float | None = None) -> dict:
    """A row of bench/data/moe_folding_paper.json priced through the Bridge rows' path (``prepare``: the row's
    Megatron-LM arguments imported by ``read_megatron``, its cluster and precision): predicted TFLOP/s/GPU =
    ``megatron_moe_flops`` / predicted iteration / GPUs; error = predicted / measured TFLOP/s - 1 (the step time's
    error beside it where the source gives one). MFU-only rows have no arguments and say what is missing."""
    meas = row["measured"]
    shape = " ".join(f"{k}{row[k]}" for k in ("tp", "pp", "vp", "cp", "ep") if row.get(k) is not None)
    out = {"id": row["id"], "model": row.get("model") or row["model_label"], "system": row.get("system") or "-",
           "cluster": row.get("cluster") or "-",
           "precision": row.get("precision") or "-", "config": shape + (f" mbs{row['mbs']} gbs{row['gbs']} "
                                                                      f"seq{row['seq']}" if row.get("gbs") else ""),
           "measured": row["measured_as_published"], "measured_tflops": meas.get("tflops_per_gpu"),
           "missing": row.get("missing") or [], "source": row["source"]["url"]}
    if not row.get("args"):
        return {**out, "status": "not priced: " + (row.get("why_not") or "no arguments")}
    prep = prepare(dict(row, why_not=row.get("why_not"), version=FOLDING_RELEASE.get(row.get("system"))))
    if prep["status"] != "ok":
        return {**out, "status": prep["status"]}
    out.update(price_prepared(prep, row["precision"], search_budget_s))
    if out["status"] != "priced":
        return out
    plan, it = prep["plan"], out["iteration_ms"]
    tflops = megatron_moe_flops(plan.model, plan.global_batch_size) / (it / 1e3) / row["gpus"] / 1e12
    out.update(tflops=tflops, checks=[],
               error=tflops / meas["tflops_per_gpu"] - 1 if meas.get("tflops_per_gpu") else None,
               step_error=meas["step_s"] * 1e3 / it - 1 if meas.get("step_s") else None)
    return out


def summarize_folding(rows: list[dict]) -> dict:
    """MAE over the priced rows whose settings are all stated, and over every priced row."""
    priced = [r for r in rows if r["status"] == "priced" and r.get("error") is not None]
    full = [r for r in priced if not r["missing"]]
    mae = (lambda rs: statistics.fmean(abs(r["error"]) for r in rs) if rs else None)
    speed = [r["speedup"] for r in rows if r.get("speedup") is not None]
    return {"rows": len(rows), "priced": len(priced), "complete": len(full), "mae_complete": mae(full),
            "median_speedup": statistics.median(speed) if speed else None, "min_speedup": min(speed) if speed else None,
            "mae_all": mae(priced), "all_fit": all(r["fits"] for r in priced) if priced else None,
            "waiting": sum(r["status"].startswith(WAITS) for r in rows),
            "missing_settings": sum(r["status"].startswith("not priced: settings not stated") for r in rows)}


def print_folding(rows: list[dict], s: dict) -> None:
    print(f"\nfolding paper and other published MoE runs (bench/data/moe_folding_paper.json; TFLOP/s by Megatron-LM's "
          f"own FLOP count)\n{'model':18}{'system':7}{'prec':14}{'config':44}{'measured':>18}{'pred TF':>8}"
          f"{'err':>7}{'step err':>9}{'fits':>5}{'GiB/GPU':>9}{'speedup':>8}  status")
    for r in rows:
        status = r["status"] + (f" (unstated: {'; '.join(m.split(':')[0] for m in r['missing'])})"
                                if r["status"] == "priced" and r["missing"] else "")
        print(f"{r['model'][:17]:18}{r['system']:7}{r['precision']:14}{r['config'][:43]:44}{r['measured'][:17]:>18}"
              f"{_fmt(r.get('tflops'), '8.0f', '       -')}{_fmt(r.get('error'), '+7.1%', '      -')}"
              f"{_fmt(r.get('step_error'), '+9.1%', '        -')}"
              f"{('yes' if r.get('fits') else 'no') if 'fits' in r else '-':>5}{_gib(r):>9}"
              f"{_fmt(r.get('speedup'), '7.2f', '      -') + ('x' if r.get('speedup') else ' ')}  {status}")
    print(f"folding group: {s['priced']} of {s['rows']} rows priced; MAE {_fmt(s['mae_complete'], '.1%')} over the "
          f"{s['complete']} with every setting stated, {_fmt(s['mae_all'], '.1%')} over all priced; every priced run "
          f"fits: {s['all_fit']}; search vs published: median {_fmt(s['median_speedup'], '.3f')}x, lowest "
          f"{_fmt(s['min_speedup'], '.3f')}x; {s['missing_settings']} rows without their settings; {s['waiting']} rows "
          f"{WAITS}")


def run_folding(path: Path = FOLDING, only: str | None = None, with_breakdown: bool = False,
                search_budget_s: float | None = None) -> dict:
    raw = [r for r in load_folding_rows(path) if only is None or only in r["id"]]
    rows = [price_folding_row(r, search_budget_s) for r in raw]
    summary = summarize_folding(rows)
    print_folding(rows, summary)
    print_memory(rows)
    if with_breakdown:
        print_breakdown(rows, raw)
    return {"rows": rows, "summary": summary}


if __name__ == "__main__":
    sys.exit(main())
