"""The best unit-level plan for the reference's GPT-1.3B shape, by brute force: the bound behind search_bench's
compat GPT row.

Aceso's reference plan for GPT-1.3B on 4 V100s (../shared/aceso-reference-db, 12000 MB, GBS 512) has 4 stages of
1 GPU at micro-batch 1 and scores 58760.92 ms. This enumerates, for that shape under the aceso-compat model, every
unit partition whose stages hold 10 to 14 units (farther from 12 is slower on every stage) and, per stage, every
count of how many units of each kind (attention, MLP) take each recompute choice (units of one kind cost the same
in the op-level model; the choices go to units in the search's fill order). The result is the optimum of what a
``ParallelPlan`` can express for that shape; the search's plan is compared with it.

Run: ``python bench/compat_bound.py`` (about a minute on one core); prints the best partitions and writes
bench/results/compat_bound.json.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from search.spec.cluster import parse_cluster
from search.costmodel.types import RC
from search.pricing import cost_model
from search.planner.recompute import allowed_codes, count_assignments
from search.spec.presets import load_model
from search.spec.training import TrainingSpec

DB = ROOT.parent / "shared" / "aceso-reference-db" / "miniset"
REFERENCE_MS = 58760.92
STAGES, GBS, SIZES = 4, 512, range(10, 15)


def best_stage(cm, i, a, b):
    """(time per micro-batch, codes) of the fastest fitting per-kind recompute counts of stage i over [a, b)."""
    kinds = [(u.stack, u.kind) for u in cm.model.units[a:b]]
    _, assignments = count_assignments(kinds, allowed_codes(cm.model, a, b))
    best = (np.inf, None)
    for rc in assignments:
        c = cm.stage_cost(i, STAGES, i, a, b, 1, 1, rc, 1)
        if c.fits and c.time_per_microbatch_ms < best[0]:
            best = (c.time_per_microbatch_ms, rc)
    return best


def main() -> int:
    if not DB.is_dir():
        print(f"no reference database at {DB}")
        return 1
    model = load_model("gpt-1.3b")
    cm = cost_model(model, parse_cluster("1x4-v100", memory_limit_mb=12000),
                    TrainingSpec(global_batch_size=GBS, precision="fp16"), None, "aceso-compat", str(DB))
    U, M = model.num_units, GBS
    t0 = time.process_time()
    memo: dict = {}

    def stage(i, a, b):
        if (i, a, b) not in memo:
            memo[i, a, b] = best_stage(cm, i, a, b)
        return memo[i, a, b]
    results = []
    for sizes in itertools.product(SIZES, repeat=STAGES - 1):
        bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist() + [U]
        if not SIZES.start <= U - bounds[-2] < SIZES.stop:
            continue
        st = [stage(i, bounds[i], bounds[i + 1]) for i in range(STAGES)]
        t = [s[0] for s in st]
        if np.isfinite(t).all():
            results.append((float(max((M - 1) * x for x in t) + sum(t)), bounds, t, [s[1] for s in st]))
    results.sort(key=lambda r: r[0])
    cpu = time.process_time() - t0
    rows = [{"iteration_ms": round(it, 2), "bounds": b, "stage_ms": [round(float(x), 3) for x in t],
             "recompute": [[RC[c] for c in rc] for rc in rcs]} for it, b, t, rcs in results[:5]]
    for r in rows:
        print(f"{r['iteration_ms']:10.2f} ms  bounds {r['bounds']}  per micro-batch {r['stage_ms']}")
    best = rows[0]["iteration_ms"]
    print(f"best unit-level plan {best:.2f} ms vs the reference's op-level plan {REFERENCE_MS} ms "
          f"({(best / REFERENCE_MS - 1) * 100:+.2f}%); {len(memo)} stages enumerated in {cpu:.0f} CPU s")
    out = ROOT / "bench" / "results" / "compat_bound.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"reference_ms": REFERENCE_MS, "best": rows, "cpu_s": round(cpu, 1)}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
