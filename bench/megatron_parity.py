"""One pricing everywhere: 25 searched Megatron-LM / Megatron-Bridge plans, search result vs export -> import ->
explain of the exported script, time and memory.

Each row runs the ``aceso`` command as a user would: ``search --target megatron-lm|megatron-bridge`` (with or
without ``--grad-reduce-in-bf16``) -> ``export --to megatron-lm`` (the launch script) -> ``explain
--megatron-args-file run.sh`` and ``import --from megatron-lm --cluster`` of that script. The search's prediction
(``predicted``: iteration ms, the largest stage's memory) must equal both within 0.1% (``TOLERANCE``), and the
imported plan must carry the settings the search priced (framework aside: the script is Megatron-LM's). Bridge rows
also export the recipe overrides and read back the gradient dtype Bridge would run: ``mixed_precision`` (which
Bridge's ``mixed_precision.setup`` copies over ``ddp.grad_reduce_in_fp32``; a recipe name: its default) or else
``ddp.grad_reduce_in_fp32`` (``bridge_grad_fp32``). The problems are small (few layers, small budgets) and cover
dense GPT / Llama / T5, SP, CP, VPP, uneven layer splits, bf16 and fp16, and both gradient-reduction dtypes.

Run: ``python bench/megatron_parity.py [--quick]``; prints the table and writes bench/results/megatron_parity.json.
The per-rank memory table (``bench/megatron_memory.py``) follows the 25-plan table (``--no-memory`` skips it).
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from search.io.argparser import AcesoParser  # noqa: E402  (no abbreviations, one-line errors)
from search.cli import main as aceso  # noqa: E402
from search.spec.plan import load_plan  # noqa: E402

TOLERANCE = 1e-3
BUDGET = 200
# (name, search arguments): bf16 problems run under all four targets, fp16 ones under fewer (T5: no Bridge recipe)
PROBLEMS = {
    "llama8b-10L-vpp2": "--model llama3-8b --num-layers 10 --cluster 2x8-h100 --global-batch-size 64 "
                        "--memory-limit-mb 10000 --virtual-stages 2 --context-parallel-sizes 1",
    "llama8b-6L-sp-cp2": "--model llama3-8b --num-layers 6 --cluster 1x8-h100 --global-batch-size 32 "
                         "--sequence-parallel on --context-parallel-sizes 2 --memory-limit-mb 20000",
    "llama70b-8L": "--model llama3-70b --num-layers 8 --cluster 1x8-h100 --global-batch-size 32 "
                   "--memory-limit-mb 30000",
    "gpt1.3b-9L-bf16-vpp3": "--model gpt-1.3b --num-layers 9 --cluster 2x8-h100 --global-batch-size 128 "
                            "--precision bf16 --virtual-stages 3 --memory-limit-mb 2500 --micro-batch-sizes 1",
    "t5-770m-4L-bf16": "--model t5-770m --num-layers 4 --cluster 1x8-h100 --global-batch-size 64 --precision bf16 "
                       "--memory-limit-mb 6000",
    "gpt1.3b-12L": "--model gpt-1.3b --num-layers 12 --cluster 1x8-h100 --global-batch-size 64 "
                   "--memory-limit-mb 6000",
    "gpt2.6b-8L-unfused": "--model gpt-2.6b --num-layers 8 --cluster 1x8-a100 --global-batch-size 64 "
                          "--memory-limit-mb 4000 --attention unfused",
    "t5-770m-8L": "--model t5-770m --num-layers 8 --cluster 1x4-v100 --global-batch-size 64 --memory-limit-mb 5000",
    "llama8b-16L-v100": "--model llama3-8b --num-layers 16 --cluster 4x8-v100 --global-batch-size 64 --precision fp16 "
                        "--memory-limit-mb 12000 --micro-batch-sizes 1",
}
TARGETS = {"mlm": ["--target", "megatron-lm"], "mlm-bf16grad": ["--target", "megatron-lm", "--grad-reduce-in-bf16"],
           "bridge": ["--target", "megatron-bridge"],
           "bridge-bf16grad": ["--target", "megatron-bridge", "--grad-reduce-in-bf16"]}
BF16 = ("llama8b-10L-vpp2", "llama8b-6L-sp-cp2", "llama70b-8L", "gpt1.3b-9L-bf16-vpp3", "t5-770m-4L-bf16")
CASES = [(p, t) for p in BF16 for t in TARGETS if not (p.startswith("t5") and t.startswith("bridge"))] + \
    [(p, t) for p in ("gpt1.3b-12L", "gpt2.6b-8L-unfused") for t in ("mlm", "bridge")] + \
    [("t5-770m-8L", "mlm"), ("llama8b-16L-v100", "mlm"), ("llama8b-16L-v100", "bridge")]
QUICK = [("llama8b-6L-sp-cp2", "mlm"), ("gpt1.3b-9L-bf16-vpp3", "bridge-bf16grad"), ("t5-770m-4L-bf16", "mlm")]


def _run(argv: list[str]) -> str:
    """``aceso ARGV`` in this process; its stdout (stderr swallowed); exit status other than 0 raises."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = aceso(argv)
    if rc != 0:
        raise RuntimeError(f"aceso {shlex.join(argv)}: exit {rc}: {err.getvalue().strip()[-300:]}")
    return out.getvalue()


def bridge_grad_fp32(y: dict, recipe_default: bool | None) -> bool:
    """The gradient dtype Bridge v0.3.1 runs for these overrides: ``mixed_precision.setup`` copies
    ``mixed_precision.grad_reduce_in_fp32`` over ``ddp.grad_reduce_in_fp32``; a recipe name means its registered
    config (``bf16_mixed``: True, ``fp16_mixed``: False); no override: the recipe's own (``recipe_default``; None =
    the recipe holds a name and the YAML does not touch it: ``bf16_mixed``)."""
    mp = y.get("mixed_precision", "keep")
    if mp == "keep":
        return True if recipe_default is None else recipe_default
    if mp is None:
        return y["ddp"]["grad_reduce_in_fp32"]
    if isinstance(mp, str):
        return {"bf16_mixed": True, "fp16_mixed": False}[mp]
    if "grad_reduce_in_fp32" in mp:
        return mp["grad_reduce_in_fp32"]
    return True if recipe_default is None else recipe_default


def features(plan) -> str:
    from search.megatron import megatron_config
    from search.megatron.layout import split_for
    c = megatron_config(plan)
    split = split_for(c.chunk_layers, c.pp, c.vpp)
    out = [f"pp{c.pp}", f"tp{c.tp}"] + ([f"cp{c.cp}"] if c.cp > 1 else []) + (["sp"] if c.sequence_parallel else [])
    out += [f"vpp{c.vpp}"] if c.vpp > 1 else []
    out += ["layout"] if split.layout else ["first/last"] if split.first or split.last else []
    out += [c.recompute.granularity] if c.recompute.granularity else []
    return " ".join(out)


def run_case(problem: str, target: str, work: Path, budget: int = BUDGET) -> dict:
    """One row: search, export, explain and import of the script; the numbers and the relative differences."""
    t0 = time.perf_counter()
    d = work / f"{problem}-{target}"
    d.mkdir(parents=True, exist_ok=True)
    args = PROBLEMS[problem].split()
    plan_json, script, back = d / "p.json", d / "run.sh", d / "back.json"
    _run(["search", *args, *TARGETS[target], "--budget-evals", str(budget), "--workers", "1", "--json",
          "-o", str(plan_json)])
    plan = load_plan(plan_json)
    # the Megatron-LM of the release the plan was priced at (a Bridge plan: v0.3.1's megatron-core 0.16)
    ver = ["--megatron-version", plan.settings.release] if plan.settings.release else []
    _run(["export", str(plan_json), "--to", "megatron-lm", *ver, "-o", str(script)])
    cl = plan.cluster
    where = ["--cluster", cl.label, "--memory-limit-mib", repr(cl.memory_limit_mb), *ver]
    ex = json.loads(_run(["explain", "--megatron-args-file", str(script), *where, "--search-budget-evals", "0",
                          "--json"]))
    _run(["import", str(script), "--from", "megatron-lm", *where, "-o", str(back)])
    imp = load_plan(back)
    p = plan.predicted
    row = {"plan": f"{problem} {target}", "features": features(plan), "settings": plan.settings.model_dump(),
           "search_ms": p.iteration_time_ms, "search_mb": max(p.stage_memory_mb),
           "explain_ms": ex["iteration_time_ms"], "explain_mb": ex["max_memory_mib"],
           "import_ms": imp.predicted.iteration_time_ms, "import_mb": max(imp.predicted.stage_memory_mb),
           "import_grad_fp32": imp.settings.grad_reduce_in_fp32}
    if target.startswith("bridge"):
        import yaml
        from search.megatron import megatron_config
        from search.megatron.bridge import RECIPES, recipe_for
        text = _run(["export", str(plan_json), "--to", "megatron-bridge"])
        y = yaml.safe_load(text)
        recipe = recipe_for(megatron_config(plan))
        row["bridge_grad_fp32"] = bridge_grad_fp32(y, None if RECIPES[recipe] == "name" else False)
    row["rel_diff"] = max(abs(row[f"{k}_{u}"] / row[f"search_{u}"] - 1) for k in ("explain", "import")
                          for u in ("ms", "mb"))
    want = plan.settings.grad_reduce_in_fp32 or plan.model.params_dtype == "fp32"
    row["settings_agree"] = imp.settings.grad_reduce_in_fp32 == plan.settings.grad_reduce_in_fp32 and \
        row.get("bridge_grad_fp32", want) == want
    row["seconds"] = time.perf_counter() - t0
    return row


def main() -> int:
    ap = AcesoParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="three rows only")
    ap.add_argument("--budget-evals", type=int, default=BUDGET)
    ap.add_argument("--no-memory", action="store_true", help="skip the per-rank memory table (megatron_memory.py)")
    args = ap.parse_args()
    cases = QUICK if args.quick else CASES
    rows = []
    print(f"{'plan':36s} {'grads':5s} {'search ms':>10s} {'trip ms':>10s} {'search GiB':>10s} {'trip GiB':>8s} "
          f"{'rel diff':>9s} {'ok':3s} {'s':>5s}  features")
    with tempfile.TemporaryDirectory() as tmp:
        for problem, target in cases:
            r = run_case(problem, target, Path(tmp), args.budget_evals)
            rows.append(r)
            ok = r["rel_diff"] <= TOLERANCE and r["settings_agree"]
            grads = "fp32" if r["settings"]["grad_reduce_in_fp32"] else "dtype"
            print(f"{r['plan']:36s} {grads:5s} {r['search_ms']:10.2f} {r['explain_ms']:10.2f} "
                  f"{r['search_mb'] / 1024:10.3f} {r['explain_mb'] / 1024:8.3f} {r['rel_diff']:9.2e} "
                  f"{'yes' if ok else 'NO':3s} {r['seconds']:5.1f}  {r['features']}")
    bad = [r["plan"] for r in rows if r["rel_diff"] > TOLERANCE or not r["settings_agree"]]
    print(f"{len(rows)} plans; trip = export -> explain --megatron-args-file of the script (import --from "
          f"megatron-lm agrees too: rel diff covers both); grads: fp32 or the parameter dtype; tolerance "
          f"{TOLERANCE:.0e}; {'all agree' if not bad else 'DISAGREE: ' + ', '.join(bad)}")
    out = ROOT / "bench" / "results" / "megatron_parity.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"budget_evals": args.budget_evals, "tolerance": TOLERANCE, "rows": rows}, indent=2)
                   + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    if not args.no_memory:      # the other half: memory per rank against megatron-core's allocation
        import megatron_memory
        print()
        megatron_memory.main([])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
