"""Picture speed: ``aceso explain --plot`` from small plans up to 64 stages x 500 micro-batches, and the search picture.

For each plan: the cost-model evaluation, the timeline boxes (``timeline.boxes``: the cost model's events cut into
their terms) and the drawing + PNG write, each the best and median of ``--repeat`` runs (a shared machine is
noisy: read the best, and the CPU seconds, which load inflates least). Target: the biggest pipeline under 10 s end to
end on one core. Needs matplotlib.

Prints a table and writes ``bench/results/plot_bench.json``.

    python bench/plot_bench.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from search.io.argparser import AcesoParser  # noqa: E402  (no abbreviations, one-line errors)

from search.cli.explain import report
from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.spec.plan import uniform_plan
from search.plots import Target, pyplot, timeline
from search.plots import explain as explain_figure
from search.spec.presets import load_model
from search.spec.training import TrainingSpec

CASES = [  # name, model, cluster, stages, tp, dp, micro-batch, global batch, recompute, virtual stages
    ("gpt-1.3b 2 stages x 16", "gpt-1.3b", "1x8-h100", 2, 2, 2, 4, 64, "selective", 1),
    ("gpt-1.3b 12 stages x 48", "gpt-1.3b", "1x12-h100", 12, 1, 1, 1, 48, "none", 1),
    ("gpt-1.3b 4 stages x 16, 3 chunks", "gpt-1.3b", "1x8-h100", 4, 2, 1, 2, 32, "selective", 3),
    ("gpt-175b 64 stages x 500", "gpt-175b", "64x8-h100", 64, 8, 1, 1, 500, "full", 1),
]


def one(case, out: Path) -> dict:
    name, model, cluster, S, tp, dp, mbs, gbs, rc, v = case
    plan = uniform_plan(load_model(model), S, tp, dp, mbs, gbs, recompute=rc, cluster=parse_cluster(cluster),
                        num_virtual_stages=v)
    c0, t0 = time.process_time(), time.perf_counter()
    cm = make_cost_model(plan.model, plan.cluster, TrainingSpec(global_batch_size=gbs, precision="bf16"))
    cost = cm.evaluate(plan)
    t1 = time.perf_counter()
    boxes = timeline.boxes(cm, cost.stages, plan.num_micro_batches)
    t2 = time.perf_counter()
    shapes = [{"num_gpus": st.num_gpus, "tp": st.tp, "dp": st.dp,
               "units": [st.chunks[0].start_unit, st.chunks[-1].end_unit], "recompute": {}} for st in plan.stages]
    rep = dict(report(cost, shapes, plan.model.name, mbs, gbs), cluster=plan.cluster.label)
    explain_figure.draw(Target(out, "png"), cm, cost, rep, plan)
    t3 = time.perf_counter()
    return {"evaluate_s": t1 - t0, "boxes_s": t2 - t1, "draw_s": t3 - t2, "total_s": t3 - t0,
            "cpu_s": time.process_time() - c0,
            "num_boxes": len(boxes), "png_bytes": out.stat().st_size}


def search_picture(out: Path) -> dict:
    from search.cli import main
    t0 = time.perf_counter()
    rc = main(["search", "--model", "gpt-1.3b", "--cluster", "1x8-h100", "--global-batch-size", "512", "--json",
               "--plot", str(out)])
    return {"total_s": time.perf_counter() - t0, "rc": rc, "png_bytes": out.stat().st_size}


def main() -> int:
    ap = AcesoParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        pyplot()                     # the matplotlib import, once, outside the timings
        for case in CASES:
            runs = [one(case, Path(d) / "x.png") for _ in range(args.repeat)]
            row = {"plan": case[0], "num_boxes": runs[0]["num_boxes"], "png_bytes": runs[0]["png_bytes"]}
            for k in ("evaluate_s", "boxes_s", "draw_s", "total_s", "cpu_s"):
                vals = [r[k] for r in runs]
                row[k.replace("_s", "_best_s")] = min(vals)
                row[k.replace("_s", "_median_s")] = statistics.median(vals)
            rows.append(row)
        with contextlib.redirect_stdout(io.StringIO()):
            s = [search_picture(Path(d) / "s.png") for _ in range(args.repeat)]
    print("explain --plot, seconds (best / median of", args.repeat, "runs; shared machine)")
    print(f"  {'plan':<36}{'boxes':>8}{'evaluate':>14}{'boxes':>14}{'draw+write':>14}{'total':>14}"
          f"{'CPU':>14}{'PNG KB':>8}")
    for r in rows:
        cells = "".join(f"{r[k + '_best_s']:>7.2f}/{r[k + '_median_s']:<6.2f}"
                        for k in ("evaluate", "boxes", "draw", "total", "cpu"))
        print(f"  {r['plan']:<36}{r['num_boxes']:>8}{cells}{r['png_bytes'] / 1024:>8.0f}")
    times = [x["total_s"] for x in s]
    print(f"search --plot (gpt-1.3b, 1x8-h100, gbs 512, search included): best {min(times):.2f} s, "
          f"median {statistics.median(times):.2f} s")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    res = {"explain": rows, "search": {"best_s": min(times), "median_s": statistics.median(times)},
           "target": "64 stages x 500 micro-batches: total under 10 s"}
    (out / "plot_bench.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out / 'plot_bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
