"""`aceso calibrate` on the published runs treated as user runs: leave-one-out error before and after, per row.

Each fully specified row of ``bench/data/published_runs.json`` (stock Megatron, not fp8, micro-batch size, virtual
stages and recompute stated: nothing to tune) is written as its plan exactly as ``bench/published_runs.py`` writes
it (same model, features, era's ``RunSettings`` and attention), and its measured throughput becomes a Megatron-LM
stdout log through the format strings of Megatron-LM core_v0.16.1 (``tests/unit/megatron_log_format.py``): the
iteration time ``flops(row formula) / (measured TFLOP/s x GPUs)``, the throughput line from Megatron-LM's own
FLOP formula. The log is read back with ``search.calibration.megatron_log.read_megatron_log`` and checked against the plan
(``search.calibration.calibrate.check_log``) like any user log.

Per row: the error of the default model ("before"), and the error after calibrating on every *other* row of the
same GPU ("leave-one-out", the figure a user gets for a configuration they did not run). The LOO fits use the
runs' Jacobian at the defaults, computed once (the chord method of ``fit_factors``: each iteration re-prices the
runs exactly; the Jacobian of the held-out row is never used). "in-sample": the fit on all rows. Error =
predicted / measured - 1 of the iteration time (positive: the model is too slow; minus the throughput error).

Run: ``python bench/calibrate_bench.py`` (table, bench/results/calibrate_bench.json); ``--only TEXT`` keeps rows
whose id contains it. About 70 s of CPU time (5 minutes on the shared 2-core machine).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests" / "unit")]

import published_runs as B  # noqa: E402
from megatron_log_format import megatron_log  # noqa: E402

from search.io.argparser import AcesoParser  # noqa: E402  (no abbreviations, one-line errors)
from search.calibration.calibrate import Run, calibrate_gpu, check_log, jacobian, megatron_flops, residual  # noqa: E402
from search.costmodel.calibration import CalibrationFile  # noqa: E402
from search.calibration.megatron_log import read_megatron_log  # noqa: E402

try:        # bench/calibration.py's definition where it exists (the calib branch): one truth for "fully specified"
    from calibration import fully_specified  # noqa: E402
except ImportError:
    def fully_specified(row: dict) -> bool:
        return not {"micro_batch_size", "vpp", "recompute"} & set(row["unknown"])


def user_runs(only: str | None = None) -> list[tuple[dict, Run]]:
    """(row, Run) for every fully specified row, its log generated from the measured number and read back."""
    out = []
    for row in B.pr.load_published_runs():
        if row["fp8"] or not row["stock_megatron"] or not fully_specified(row):
            continue
        if only and only not in row["id"]:
            continue
        (mbs, vpp, rc), = B.options_of(row)
        _, plan, _ = B.price(row, mbs, vpp, rc)
        fid = row["flop_formula"] if row["flop_formula"] in B.pr._EVALUATORS else "megatron-core-r0.8"
        flops = B.pr.flops_per_iteration(row, fid)
        meas_tflops, _ = B.measured_tflops(row, flops)
        iteration_ms = flops / (meas_tflops * 1e12 * row["num_gpus"]) * 1e3
        padded = plan.model.padded_vocab_size
        text = megatron_log(iteration_ms, megatron_flops(plan, padded), row["num_gpus"],
                            plan.global_batch_size, {"num_layers": plan.model.num_layers,
                                                     "world_size": plan.cluster.num_gpus})
        run = Run(row["id"], plan, "unfused" if B.era(row) in ("2021", "2022") else "flash", "megatron-lm",
                  read_megatron_log(text, f"{row['id']}.log"),
                  settings=B.settings_of(row, plan.model.params_dtype))
        check_log(run, plan.cluster, padded)
        out.append((row, run))
    return out


def bench(only: str | None = None) -> dict:
    pairs = user_runs(only)
    by_gpu: dict[str, list[tuple[dict, Run]]] = {}
    for row, run in pairs:
        by_gpu.setdefault(row["gpu"], []).append((row, run))
    rows, fits = [], {}
    for gpu, items in sorted(by_gpu.items()):
        runs = [r for _, r in items]
        jac = jacobian(runs, np.zeros(4))
        full = calibrate_gpu(runs, jac)
        fits[gpu] = full.model_dump(exclude={"runs"})
        for i, (row, run) in enumerate(items):
            others = [r for j, r in enumerate(runs) if j != i]
            loo = calibrate_gpu(others, jac[[j for j in range(len(runs)) if j != i]]) if others else None
            held = residual(run, CalibrationFile(gpus={gpu: loo})) if loo else None
            mine = full.runs[i]
            rows.append({"id": row["id"], "gpu": gpu, "num_gpus": row["num_gpus"],
                         "measured_ms": mine.measured_iteration_ms, "before": mine.error_before,
                         "loo_after": held.error_after if held else None, "in_sample_after": mine.error_after,
                         "loo_gemm_efficiency": loo.gemm_efficiency if loo else None})
    return {"rows": rows, "fits": fits, "summary": summarize(rows)}


def summarize(rows: list[dict]) -> dict:
    def stats(key):
        e = np.array([r[key] for r in rows if r[key] is not None])
        return {"mae": float(np.mean(np.abs(e))), "max_abs": float(np.max(np.abs(e))), "bias": float(np.mean(e))} \
            if len(e) else None
    return {"rows": len(rows), "before": stats("before"), "loo_after": stats("loo_after"),
            "in_sample_after": stats("in_sample_after")}


def print_table(res: dict) -> None:
    print("aceso calibrate on the published runs as user runs (error of the iteration time = predicted / measured - 1)")
    print(f"  {'run':46}{'GPUs':>6}{'measured ms':>13}{'before':>9}{'LOO after':>11}{'in-sample':>11}")
    for r in res["rows"]:
        loo = f"{100 * r['loo_after']:>10.1f}%" if r["loo_after"] is not None else f"{'-':>11}"
        print(f"  {r['id'][:46]:46}{r['num_gpus']:>6}{r['measured_ms']:>13.1f}{100 * r['before']:>8.1f}%{loo}"
              f"{100 * r['in_sample_after']:>10.1f}%")
    s = res["summary"]
    for key, what in (("before", "before (defaults)"), ("loo_after", "leave-one-out after"),
                      ("in_sample_after", "in-sample after")):
        if s[key]:
            print(f"  {what:22} MAE {100 * s[key]['mae']:.1f}%, max |error| {100 * s[key]['max_abs']:.1f}%, "
                  f"bias {100 * s[key]['bias']:+.1f}% on {s['rows']} rows")
    for gpu, f in res["fits"].items():
        links = ", ".join(f"{k} {f[k]:.1f} GB/s" for k in ("intra_node_gbps", "inter_node_gbps") if f[k])
        print(f"  fit on all {gpu} rows: GEMM {f['gemm_efficiency']:.3f}, attention {f['attention_efficiency']:.3f} "
              f"of peak, {links} (fitted: {', '.join(f['fitted'])})")


def main(argv: list[str] | None = None) -> int:
    ap = AcesoParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="only rows whose id contains this")
    args = ap.parse_args(argv)
    res = bench(args.only)
    print_table(res)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibrate_bench.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"\nwrote {out / 'calibrate_bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
