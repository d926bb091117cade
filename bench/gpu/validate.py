"""Profile -> predict -> measure on one GPU: the profile cost model's error on 1-GPU plans.

    bash bench/gpu/validate.sh                      # on a machine with an NVIDIA GPU (results under $OUT)
    python bench/gpu/validate.py --dry-run          # print the plans and commands only
    python bench/gpu/validate.py --cpu --tiny       # the same pipeline on CPU with a tiny GPT (tests)

1. ``aceso profile`` of a GPT-1.3B-like model (gpt-1.3b, bf16) at tp 1 and per-rank micro-batches 1 and 2.
2. Six 1-GPU plans: recompute none / selective / full x micro-batch 1 and 2, global batch 8 (one stage, all
   units). The profile cost model predicts each plan's iteration time and memory.
3. ``aceso train PLAN --mock-data`` runs each plan for ``--steps`` steps, logging every step; the measured time
   is the median step after the first two (warm-up), the memory ``torch.cuda.max_memory_allocated``.
4. Prints predicted vs measured with the errors (targets: time within 3 %, memory within 5 %) and writes JSON.
The memory compared is the prediction without the GPU reserve (CUDA context and library workspaces, which
``max_memory_allocated`` does not see). On CPU the measured memory is the process's RSS: not compared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from search.io.argparser import AcesoParser  # noqa: E402  (no abbreviations, one-line errors)

TINY = {"name": "tiny-gpt", "family": "gpt", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "ffn_hidden_size": 256, "seq_length": 32, "vocab_size": 256, "params_dtype": "fp32"}
TIME_TARGET, MEMORY_TARGET = 0.03, 0.05


def model_spec(tiny: bool) -> dict:
    if tiny:
        return dict(TINY)
    from search.spec.presets import load_model

    spec = load_model("gpt-1.3b").model_dump()
    spec.update(name="gpt-1.3b-bf16", params_dtype="bf16")
    return spec


def plans(model: dict, gbs: int) -> dict[str, dict]:
    from search.spec.model import ModelSpec

    from search.spec.plan import RECOMPUTE_CHOICES, recompute_allowed

    spec = ModelSpec.model_validate(model)
    units = spec.units
    out = {}
    for mbs in (1, 2):
        for rc in RECOMPUTE_CHOICES:  # attn_dropout on the attention units, MLP units none
            per_unit = [rc if rc in recompute_allowed(u.kind, spec) else "none" for u in units]
            if rc != "none" and rc not in per_unit:
                continue              # a choice no unit of this model takes (mla_up_proj without MLA)
            out[f"mbs{mbs}-{rc}"] = {"model": model, "micro_batch_size": mbs, "global_batch_size": gbs, "stages": [
                {"num_gpus": 1, "tp": 1, "dp": 1, "start_unit": 0, "end_unit": len(units), "recompute": per_unit}]}
    return out


def predict(raw: dict, db: Path, gpu: str) -> dict:
    from search.spec.cluster import parse_cluster
    from search.pricing import make_cost_model
    from search.spec.plan import parse_plan
    from search.spec.training import TrainingSpec

    plan = parse_plan(raw, world_size=1)
    dtype = json.loads(db.read_text())["dtype"]
    tr = TrainingSpec(global_batch_size=plan.global_batch_size, micro_batch_sizes=[plan.micro_batch_size],
                      precision=dtype)
    cost = make_cost_model(plan.model, parse_cluster(f"1x1-{gpu}"), tr, kind="profile", db=db).evaluate(plan)
    st = cost.stages[0]
    return {"iteration_ms": cost.iteration_ms, "memory_mb": st.memory_mb,
            "memory_mb_without_reserve": st.memory_mb - st.memory_breakdown["reserve"],
            "breakdown": st.memory_breakdown, "warnings": cost.warnings}


def commands(args, spec_file: Path, db: Path, plan_file: Path, log: Path) -> tuple[list[str], list[str]]:
    aceso = [sys.executable, "-m", "search"]
    prof = aceso + ["profile", "--model", str(spec_file), "--tp", "1", "--micro-batch-sizes", "1", "2", "-o",
                    str(db), "--no-comm", "--quiet"]
    train = aceso + ["train", str(plan_file), "--mock-data", "--train-iters", str(args.steps), "--log-interval",
                     "1", "--log-file", str(log)]
    if args.cpu:
        prof += ["--cpu", "--repeats", "5"]
        train += ["--cpu"]
    return prof, train


def measure(train_cmd: list[str], log: Path, tries: int = 3) -> dict:
    for _ in range(tries):   # a 1-process `aceso train` picks a free port that another job may take first
        if log.exists():
            log.unlink()
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        r = subprocess.run(train_cmd, cwd=ROOT, capture_output=True, text=True, check=False, env=env)
        if "EADDRINUSE" not in r.stderr:
            break
    if r.returncode != 0:
        return {"error": (r.stderr or r.stdout).strip().splitlines()[-1:] or [f"exit {r.returncode}"]}
    recs = [json.loads(ln) for ln in log.read_text().splitlines() if ln.strip()]
    s = next(x for x in recs if x.get("kind") == "summary")
    steps = [x["iteration_time_ms"] for x in recs if x.get("kind") == "train"]
    warm = 2 if len(steps) > 3 else 1 if len(steps) > 1 else 0   # the first steps pay for warm-up
    return {"iteration_ms": statistics.median(steps[warm:]), "step_ms": steps,
            "memory_mb": s["measured_stage_memory_mib"][0], "memory_kind": s["memory_kind"]}


def main() -> int:
    ap = AcesoParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="run on CPU (gloo, fp32): for testing the pipeline")
    ap.add_argument("--tiny", action="store_true", help="a tiny GPT instead of GPT-1.3B")
    ap.add_argument("--steps", type=int, default=10, help="training steps per plan (default 10)")
    ap.add_argument("--global-batch-size", type=int, default=8)
    ap.add_argument("--max-plans", type=int, default=None, help="run only the first N plans")
    ap.add_argument("--gpu", default=None, help="GPU preset of the cluster (default: the profile's)")
    ap.add_argument("--db", default=None, help="reuse this profile database")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results" / "gpu-validate"))
    ap.add_argument("--dry-run", action="store_true", help="print plans and commands, run nothing")
    args = ap.parse_args()
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = model_spec(args.tiny)
    spec_file = out / "model.json"
    spec_file.write_text(json.dumps(spec, indent=1))
    db = Path(args.db) if args.db else out / "profile-db.json"
    todo = plans(spec, args.global_batch_size)
    if args.max_plans:
        todo = dict(list(todo.items())[:args.max_plans])
    log = out / "train-log.jsonl"
    prof_cmd, _ = commands(args, spec_file, db, out / "plan.json", log)
    if args.dry_run:
        print(" ".join(prof_cmd))
        for name, raw in todo.items():
            pf = out / f"plan-{name}.json"
            pf.write_text(json.dumps(raw))
            print(" ".join(commands(args, spec_file, db, pf, log)[1]))
        return 0
    t0 = time.time()
    if not args.db:
        subprocess.run(prof_cmd, cwd=ROOT, check=True)
    prof_s = time.time() - t0
    gpu = args.gpu or json.loads(db.read_text())["hardware"]["gpu"]
    rows = []
    for name, raw in todo.items():
        pf = out / f"plan-{name}.json"
        pf.write_text(json.dumps(raw))
        pred = predict(raw, db, gpu)
        meas = measure(commands(args, spec_file, db, pf, log)[1], log)
        row = {"plan": name, "predicted": pred, "measured": meas}
        if "error" not in meas:
            row["time_error"] = (pred["iteration_ms"] - meas["iteration_ms"]) / meas["iteration_ms"]
            if meas["memory_kind"] == "cuda_max_allocated":
                row["memory_error"] = (pred["memory_mb_without_reserve"] - meas["memory_mb"]) / meas["memory_mb"]
        rows.append(row)
        print(_line(row), flush=True)
    summary = _summary(rows, prof_s, gpu, spec)
    (out / "validate.json").write_text(json.dumps(summary, indent=1))
    print(f"max |time error| {_pct(summary['max_abs_time_error'])} (target {TIME_TARGET:.0%}), max |memory "
          f"error| {_pct(summary['max_abs_memory_error'])} (target {MEMORY_TARGET:.0%}); wrote {out / 'validate.json'}")
    return 0 if all("error" not in r["measured"] for r in rows) else 1


def _pct(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def _line(r: dict) -> str:
    p, m = r["predicted"], r["measured"]
    if "error" in m:
        return f"{r['plan']:<16} predicted {p['iteration_ms']:9.1f} ms  FAILED: {m['error']}"
    mem = (f"{p['memory_mb_without_reserve']:9.0f} MB vs {m['memory_mb']:9.0f} MB ({_pct(r.get('memory_error'))})"
           if "memory_error" in r else f"memory not compared ({m['memory_kind']})")
    return (f"{r['plan']:<16} time {p['iteration_ms']:9.1f} ms vs {m['iteration_ms']:9.1f} ms "
            f"({r['time_error']:+.1%})   {mem}")


def _summary(rows, prof_s, gpu, spec) -> dict:
    te = [abs(r["time_error"]) for r in rows if "time_error" in r]
    me = [abs(r["memory_error"]) for r in rows if "memory_error" in r]
    return {"gpu": gpu, "model": spec, "profile_seconds": round(prof_s, 1), "plans": rows,
            "max_abs_time_error": max(te) if te else None, "max_abs_memory_error": max(me) if me else None,
            "targets": {"time": TIME_TARGET, "memory": MEMORY_TARGET}}


if __name__ == "__main__":
    sys.exit(main())
