"""Compare-first on NVIDIA's published Megatron configurations: what `aceso explain --megatron-args` reports.

Each fully specified published run of ``bench/data/published_runs.json`` (SC'21 Table 1: GPT 1.7B-1T on 32-3072
A100s; Korthikanti et al. 2022: selective+SP and full recompute on 8-2240 A100s) is written as the Megatron-LM
command line its configuration states (core_v0.16.1 flags), read back by the importer (``read_megatron``), priced
as Megatron-LM's training script runs it (``plan_settings.target_settings``, analytic cost model) and compared with
``aceso search``'s best Megatron-LM plan (drop-in, same pricing) and best heterogeneous plan (aceso runtime), each
the result of the ``aceso search`` command explain prints for the row (``search/cli/explain_search.py``) with a
fixed budget (``--budget-evals``, default 600). The published measured iteration time
(the source's TFLOP/s per GPU and FLOP formula) is shown next to our prediction of the same configuration.
Assumed where a source is silent: fp16 for "16-bit unspecified", Adam, no overlap flags.

Run: ``python bench/megatron_bench.py [--quick] [--budget-evals N]``; prints a table and writes
bench/results/megatron_bench.json. Seconds are wall-clock per row (import, pricing and both searches; the machine
may be shared).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from search.io.argparser import AcesoParser  # noqa: E402  (no abbreviations, one-line errors)

from search.spec.cluster import parse_cluster  # noqa: E402
from search.costmodel.memory import DEFAULT_HEADROOM  # noqa: E402
from search.settings.plan_settings import target_settings  # noqa: E402
from search.pricing import cost_model  # noqa: E402
from search.cli.explain_search import search_lines  # noqa: E402
from search.megatron.importer import read_megatron  # noqa: E402
from search.spec.training import TrainingSpec  # noqa: E402

QUICK = ("sc21-a100-gpt-1.7b", "sc21-a100-gpt-39b", "korthikanti-a100-gpt-22b-selective-sp",
         "korthikanti-a100-gpt-175b-full-recompute")


def _published():
    spec = importlib.util.spec_from_file_location("published_runs", ROOT / "bench" / "data" / "published_runs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def command_line(row: dict) -> str:
    """The Megatron-LM (core_v0.16.1) flags of a published configuration."""
    m, p = row["model"], row["parallel"]
    args = ["--num-layers", m["num_layers"], "--hidden-size", m["hidden_size"], "--num-attention-heads",
            m["num_attention_heads"], "--ffn-hidden-size", m["ffn_hidden_size"] or 4 * m["hidden_size"],
            "--seq-length", m["seq_length"], "--max-position-embeddings", m["seq_length"],
            "--tokenizer-type", "NullTokenizer", "--vocab-size", m["vocab_size"] - 1,
            "--micro-batch-size", p["micro_batch_size"], "--global-batch-size", p["global_batch_size"],
            "--tensor-model-parallel-size", p["tp"], "--pipeline-model-parallel-size", p["pp"],
            "--bf16" if row["precision"] == "bf16" else "--fp16"]
    if p["vpp"]:
        args += ["--num-layers-per-virtual-pipeline-stage", m["num_layers"] // (p["pp"] * p["vpp"])]
    if p["sequence_parallel"]:
        args += ["--sequence-parallel"]
    if p["recompute"] == "selective":
        args += ["--recompute-activations"]
    elif p["recompute"] == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", p["recompute_method"] or "uniform",
                 "--recompute-num-layers", p["recompute_num_layers"] or 1]
    if p["distributed_optimizer"]:
        args += ["--use-distributed-optimizer"]
    return shlex.join(str(a) for a in args)


def usable(row: dict) -> bool:
    p = row["parallel"]
    return (row["model"]["family"] == "gpt" and row["precision"] != "fp8" and p["micro_batch_size"] is not None
            and p["recompute"] is not None and p["cp"] == 1 and row["stock_megatron"]
            and (p["vpp"] is None or "vpp" not in row["unknown"]))


def run_row(row: dict, pr, budget: int) -> dict:
    t0 = time.perf_counter()
    n = row["num_gpus"]
    cluster = parse_cluster(f"{max(1, n // 8)}x{min(n, 8)}-{row['gpu']}")
    line = command_line(row)
    imp = read_megatron(line, cluster=cluster, version="core_v0.16.1")      # command_line writes core_v0.16.1 flags
    plan = imp.plan
    training = TrainingSpec(global_batch_size=plan.global_batch_size, precision=plan.model.params_dtype)
    cost = cost_model(plan.model, cluster, training, target_settings("megatron-lm", precision=training.precision)) \
        .evaluate(plan)
    opts = argparse.Namespace(cluster=cluster.label, memory_limit_mb=None, memory_headroom=DEFAULT_HEADROOM,
                              calibration=None, attention="flash", cost_model="analytic", db=None, framework=None)
    g = search_lines(plan, cost.iteration_ms, opts, budget)
    measured = row["measured"].get("tflops_per_gpu")
    measured_ms = pr.flops_per_iteration(row) / (measured * 1e12 * n) * 1e3 if measured else None
    out = {"id": row["id"], "gpus": n, "command_line": line, "published_ms": measured_ms,
           "config_ms": cost.iteration_ms, "config_fits": cost.fits, "max_memory_mb": cost.max_memory_mb,
           "seconds": None}
    for key in ("megatron", "aceso"):
        line_ = g[key]
        out[key] = None if "plan" not in line_ else {"iteration_ms": line_["iteration_ms"],
                                                     "speedup": line_["speedup"], "plan": _describe(line_["plan"]),
                                                     "command": line_["command"]}
    out["seconds"] = time.perf_counter() - t0
    return out


def _describe(plan) -> str:
    st = plan.stages
    shapes = sorted({(s.tp, s.cp, s.dp, s.sequence_parallel) for s in st})
    shape = " ".join(f"tp{a}{f' cp{b}' if b > 1 else ''} dp{c}{' sp' if d else ''}" for a, b, c, d in shapes)
    rc = sorted({r for s in st for r in s.all_recompute} - {"none"})
    feats = [n for n, on in (("dist-opt", plan.distributed_optimizer), ("overlap-grad", plan.overlap_grad_reduce),
                             ("overlap-param", plan.overlap_param_gather)) if on]
    return f"pp {plan.num_stages}" + (f" vpp {plan.num_virtual_stages}" if plan.num_virtual_stages > 1 else "") + \
        f", {shape}, mbs {plan.micro_batch_size // st[0].dp}/rank, recompute {'+'.join(rc) or 'none'}" + \
        (f", {' '.join(feats)}" if feats else "")


def main() -> int:
    ap = AcesoParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    ap.add_argument("--budget-evals", type=int, default=600)
    args = ap.parse_args()
    pr = _published()
    rows = [r for r in pr.load_published_runs() if usable(r) and (not args.quick or r["id"] in QUICK)]
    results = []
    print(f"{'published run':42s} {'GPUs':>5s} {'measured':>9s} {'theirs':>9s} {'drop-in':>9s} {'x':>6s} "
          f"{'hetero':>9s} {'x':>6s} {'s':>5s}  best Megatron-LM plan")
    for row in rows:
        r = run_row(row, pr, args.budget_evals)
        results.append(r)
        mlm, het = r["megatron"] or {}, r["aceso"] or {}

        def ms(v):
            return f"{v:9.0f}" if v is not None else f"{'-':>9s}"
        print(f"{r['id']:42s} {r['gpus']:5d} {ms(r['published_ms'])} {ms(r['config_ms'])}"
              f"{'' if r['config_fits'] else '*'} {ms(mlm.get('iteration_ms'))} {mlm.get('speedup', 0):6.3f} "
              f"{ms(het.get('iteration_ms'))} {het.get('speedup', 0):6.3f} {r['seconds']:5.1f}  {mlm.get('plan', '')}")
    print("ms per iteration; measured: the source's TFLOP/s converted with its FLOP formula; theirs: our prediction "
          "of the published configuration (* = over memory in our model); x: speedup over theirs")
    out = ROOT / "bench" / "results" / "megatron_bench.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"budget_evals": args.budget_evals, "rows": results}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
