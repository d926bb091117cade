"""Predicted (profile cost model) vs measured (the runtime on CPU gloo) iteration time and per-stage memory.

    python bench/predict_vs_measure.py                 # profile a small GPT, then run each plan
    python bench/predict_vs_measure.py --db DB.json    # reuse a profile made with the same model and --nproc

Steps: ``aceso profile --cpu`` of the bench model (tp 1 2, per-rank micro-batches 1 2 4; ``--passes`` passes,
median kept) on ``--nproc`` processes; for each plan the profile cost model predicts the iteration time and each stage's memory; the runtime
(``aceso_megatron.training.engine.build_runtime`` on ``--nproc`` gloo processes, one thread each) runs ``--steps``
optimizer steps, in ``--rounds`` passes over all plans; the median step time (steps after ``--skip`` warm-up
steps of every pass) is the measured time.

Memory on CPU has no allocator counters, so the measured stage memory is assembled from the runtime's real
tensors: parameter bytes + DDP gradient buffer bytes + optimizer state bytes (read from the optimizer) + the peak
of live saved activations over a step (``profiler.memory.LiveSaved``: every tensor autograd keeps, recomputed
ones included), max over the stage's ranks. The prediction is compared without the parts that a CPU run does not
have or that this does not see (the GPU reserve and the p2p receive buffers). The process's max RSS is reported
too (it includes the interpreter and libraries). Prints a table and writes JSON (bench/results/).

On a 2-core machine shared with other jobs the times are noisy; the error is what it is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from search.io.argparser import AcesoParser  # noqa: E402  (no abbreviations, one-line errors)

MODEL = {"name": "bench-gpt", "family": "gpt", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
         "ffn_hidden_size": 1024, "seq_length": 128, "vocab_size": 2048, "params_dtype": "fp32"}


def st(tp, dp, lo, hi, rc=None):
    return {"num_gpus": tp * dp, "tp": tp, "dp": dp, "start_unit": lo, "end_unit": hi, "recompute": rc or ["none"] * (hi - lo)}


def plans(model: dict) -> dict[str, dict]:
    def plan(*stages, mb=2, gbs=8):
        return {"model": model, "micro_batch_size": mb, "global_batch_size": gbs, "stages": list(stages)}
    return {
        "pp2 even, mbs 2": plan(st(1, 1, 0, 4), st(1, 1, 4, 8)),
        "pp2 uneven 3|5, mbs 1": plan(st(1, 1, 0, 3), st(1, 1, 3, 8), mb=1),
        "pp2 full | selective": plan(st(1, 1, 0, 4, ["full"] * 4), st(1, 1, 4, 8, ["selective"] * 4)),
        "tp2, mbs 2": plan(st(2, 1, 0, 8)),
        "dp2, mbs 4": plan(st(1, 2, 0, 8), mb=4),
    }


# ----- measurement (one process per rank) ----------------------------------------------------------------------
def _state_bytes(rt) -> dict:
    import torch

    params = sum(p.numel() * p.element_size() for p in rt.stage_module.parameters())
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in rt.model.buffers)
    seen, opt = set(), 0
    opts = getattr(rt.optimizer, "chained_optimizers", [rt.optimizer])
    for o in opts:
        inner = getattr(o, "optimizer", o)
        for state in inner.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1 and v.data_ptr() not in seen:
                    seen.add(v.data_ptr())
                    opt += v.numel() * v.element_size()
    return {"params": params, "grads": grads, "optimizer": opt}


def measure(rank: int, world: int, raws: list[dict], steps: int, skip: int, rounds: int, out: str) -> None:
    """``rounds`` passes over all plans (a slow spell of a shared machine then hits every plan, not one)."""
    import resource

    import torch
    import torch.distributed as dist

    from aceso_megatron.training.engine import build_runtime
    from aceso_megatron.training.teardown import release
    from aceso_megatron.profiler.memory import LiveSaved
    from aceso_megatron.testing import make_batches

    times = [[] for _ in raws]
    mem = [None] * len(raws)
    for _ in range(rounds):
        for k, raw in enumerate(raws):
            rt = build_runtime(raw, rank, world, seed=7)
            batches = make_batches(rt.plan.model, rt.plan.micro_batch_size, rt.plan.global_batch_size)
            peak = 0
            for i in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                with LiveSaved(rt.stage_module.parameters()) as live:
                    rt.train_step(iter(batches))
                dist.barrier()
                if i >= skip:
                    times[k].append(time.perf_counter() - t0)
                peak = max(peak, live.peak)
            states = _state_bytes(rt)
            mine = torch.zeros(rt.plan.num_stages, 2, dtype=torch.float64)
            mine[rt.layout.stage, 0] = (sum(states.values()) + peak) / 2**20
            mine[rt.layout.stage, 1] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            mem[k] = mine
            release(rt)   # before the next plan's build: its hooks, model, buffers and optimizer (teardown)
    if rank == 0:
        res = [{"iteration_ms": 1e3 * statistics.median(t), "times_ms": [1e3 * x for x in t],
                "stage_memory_mb": m[:, 0].tolist(), "stage_rss_mb": m[:, 1].tolist()} for t, m in zip(times, mem)]
        Path(out).write_text(json.dumps(res))


# ----- prediction ----------------------------------------------------------------------------------------------
def predict(raw: dict, db: str, nproc: int) -> dict:
    from search.spec.cluster import parse_cluster
    from search.pricing import make_cost_model
    from search.spec.plan import parse_plan
    from search.spec.training import TrainingSpec

    plan = parse_plan(raw, world_size=nproc)
    tr = TrainingSpec(global_batch_size=plan.global_batch_size, micro_batch_sizes=[plan.micro_batch_size],
                      precision="fp32")
    cm = make_cost_model(plan.model, parse_cluster(f"1x{nproc}-cpu"), tr, kind="profile", db=db)
    cost = cm.evaluate(plan)
    mem = [s.memory_mb - s.memory_breakdown["reserve"] - s.memory_breakdown["p2p_buffers"] for s in cost.stages]
    return {"iteration_ms": cost.iteration_ms, "stage_memory_mb": mem, "warnings": cost.warnings}


def profile(model_file: Path, db: Path, nproc: int, repeats: int, passes: int) -> None:
    """Units (tp 1 2, per-rank batches 1 2 4), then the network merged into the same database."""
    base = [sys.executable, "-m", "search", "profile", "--model", str(model_file), "-o", str(db), "--cpu",
            "--nproc", str(nproc), "--repeats", str(repeats), "--quiet"]
    subprocess.run(base + ["--tp", "1", "2", "--micro-batch-sizes", "1", "2", "4", "--no-comm", "--fresh",
                          "--passes", str(passes)],
                   check=True, cwd=ROOT)
    subprocess.run(base + ["--comm", "--max-bytes", str(4 * 2**20)], check=True, cwd=ROOT)


def main() -> int:
    ap = AcesoParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default=None, help="an existing profile of the bench model (skip profiling)")
    ap.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per plan and round (default 6)")
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps not timed (default 2)")
    ap.add_argument("--rounds", type=int, default=2, help="passes over all plans (default 2)")
    ap.add_argument("--repeats", type=int, default=20, help="profiler repeats (default 20)")
    ap.add_argument("--passes", type=int, default=3, help="profiler passes, median kept (default 3)")
    ap.add_argument("-o", "--output", default=str(ROOT / "bench" / "results" / "predict_vs_measure.json"))
    args = ap.parse_args()
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    work = Path(tempfile.mkdtemp(prefix="pvm-"))
    model_file = work / "bench-gpt.json"
    model_file.write_text(json.dumps(MODEL))
    db = args.db or str(work / "db.json")
    t0 = time.time()
    if args.db is None:
        profile(model_file, Path(db), args.nproc, args.repeats, args.passes)
    prof_s = time.time() - t0
    todo = plans(MODEL)
    from aceso_megatron.testing import spawn

    out = work / "measured.json"
    load_before = os.getloadavg()[0]
    spawn(args.nproc, measure, list(todo.values()), args.steps, args.skip, args.rounds, str(out))
    measured = json.loads(out.read_text())
    rows = []
    for (name, raw), meas in zip(todo.items(), measured):
        pred = predict(raw, db, args.nproc)
        t_err = (pred["iteration_ms"] - meas["iteration_ms"]) / meas["iteration_ms"]
        m_err = [(p - m) / m for p, m in zip(pred["stage_memory_mb"], meas["stage_memory_mb"])]
        rows.append({"plan": name, "predicted_ms": pred["iteration_ms"], "measured_ms": meas["iteration_ms"],
                     "time_error": t_err, "predicted_stage_mb": pred["stage_memory_mb"],
                     "measured_stage_mb": meas["stage_memory_mb"], "stage_rss_mb": meas["stage_rss_mb"],
                     "memory_error": m_err, "step_times_ms": meas["times_ms"], "warnings": pred["warnings"]})
    _print(rows)
    summary = {"model": MODEL, "nproc": args.nproc, "steps": args.steps, "skip": args.skip, "rounds": args.rounds,
               "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)], "cpus": os.cpu_count(),
               "profile_seconds": round(prof_s, 1), "plans": rows,
               "max_abs_time_error": max(abs(r["time_error"]) for r in rows),
               "max_abs_memory_error": max(abs(e) for r in rows for e in r["memory_error"])}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(summary, indent=1))
    print(f"load average (1 min) before/after measuring: {summary['load_average_1min']} on {os.cpu_count()} CPUs")
    print(f"max |time error| {summary['max_abs_time_error']:.1%}, max |memory error| "
          f"{summary['max_abs_memory_error']:.1%}; wrote {args.output}")
    return 0


def _print(rows: list[dict]) -> None:
    print(f"{'plan':<24}{'pred ms':>9}{'meas ms':>9}{'err':>8}   "
          f"{'pred MB / meas MB per stage (err)'}")
    for r in rows:
        mem = "  ".join(f"{p:.1f}/{m:.1f} ({e:+.0%})" for p, m, e in
                        zip(r["predicted_stage_mb"], r["measured_stage_mb"], r["memory_error"]))
        print(f"{r['plan']:<24}{r['predicted_ms']:>9.1f}{r['measured_ms']:>9.1f}{r['time_error']:>+8.1%}   {mem}")


if __name__ == "__main__":
    sys.exit(main())
