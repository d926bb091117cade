"""Memory per rank of published runs: our cost model beside megatron-core's allocation and Megatron-LM's formula.

For every fully specified published run we can price (every row of bench/data/published_runs.json whose micro-batch,
virtual stages and recompute are published, or ``--runs FILE`` for another copy of that file; and the dense rows of
../shared/published/megatron-bridge-25.09-25.11.json, imported from their own Megatron-LM arguments), under the
run's own settings:

- gradient reduction dtype: bf16 where the run says so (NeMo's ``grad_sync_dtype: bf16`` in the recipe quoted by
  the row; the Bridge rows' ``--grad-reduce-in-bf16``), else Megatron-LM's default (fp32 for bf16 training);
- everything else as bench/published_runs.py writes the row (``model_of`` / ``features_of``: its rules);
- FP8 / MXFP8 rows (the Bridge tables) are priced with their recipe (``precision.py``: the quantized weight
  lines, the activations linear layers keep quantized), as bench/lowprec_published.py prices them; the parameter
  count beside megatron-core's is the plan's, without the recipe's weight bytes.

Per pipeline rank it lists the parameters the planner counts and those megatron-core 0.16.1 allocates (the rank's
modules built on the meta device, ``aceso_megatron.testing.meta_params``; ``--no-build`` skips it), the DDP buffer
padding megatron-core adds (``memory.ddp_buffer_numel`` on the built parameters), the weight / gradient / optimizer /
activation GB of the cost model and its total against the GPU; beside rank 0 Megatron-LM's
``theoretical_memory_usage.py`` at core_v0.16.1 (transcribed below, ``theoretical_memory``), which assumes the
most loaded shard is the first stage and simplifies what docs/costmodel.md "Memory" lists.

``memory_rows()`` returns the rows (bench/megatron_parity.py calls it); ``python bench/megatron_memory.py`` prints
the table and writes bench/results/megatron_memory.json.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from search.io.argparser import AcesoParser  # noqa: E402  (no abbreviations, one-line errors)
from search.spec.cluster import parse_cluster  # noqa: E402
from search.pricing import make_cost_model  # noqa: E402
from search.costmodel.memory import MB, ddp_buffer_numel  # noqa: E402
from search.settings.fsdp import shards  # noqa: E402
from search.spec.plan import uniform_plan  # noqa: E402
from search.spec.training import TrainingSpec  # noqa: E402

RUNS = ROOT / "bench" / "data" / "published_runs.json"
BRIDGE = ROOT.parent / "shared" / "published" / "megatron-bridge-25.09-25.11.json"
DENSE_BRIDGE = ("llama3-8b", "llama3-70b", "llama3.1-405b")
GB = 2.0 ** 30


def _published_runs_module():
    spec = importlib.util.spec_from_file_location("published_runs_bench", ROOT / "bench" / "published_runs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ----- Megatron-LM's formula (megatron/training/theoretical_memory_usage.py, NVIDIA/Megatron-LM tag core_v0.16.1,
# commit 55ac7082517c3878ae653c07c09c534b8aed49f6), dense GPT without MoE / MTP / MLA, transcribed -----------------
def theoretical_memory(m, tp: int, pp: int, dp: int, vpp: int | None, mbs: int, num_microbatches: int,
                       dist_opt: bool, sp: bool, recompute: str) -> dict:
    """(weight + optimizer, activation, total) bytes of ``report_theoretical_memory`` for ModelSpec ``m``."""
    h, a, g = m.hidden_size, m.num_attention_heads, m.groups
    qproj_ratio = m.head_dim * a / h
    glu = 3 / 2 if m.activation == "swiglu" else 1
    norm = 1 if m.normalization == "rmsnorm" else 2
    attn = 2 * h * h * ((1 + g / a) * qproj_ratio)
    layer = 2 * h * (m.ffn_hidden_size * glu + norm) + attn
    emb = h * m.padded_vocab_size
    block = layer * m.num_layers + norm * h
    shard = (block / pp + emb) / tp                          # "most loaded shard": first stage + embedding
    if not m.tied_embeddings and pp == 1:
        shard += emb / tp
    per_param = 6 + 12 / dp if dist_opt else 18
    weight_opt = shard * per_param
    s, b = m.seq_length, mbs
    if sp and recompute == "selective":                      # compute_activation_memory
        act = s * b * h * (18 + 4 * m.ffn_hidden_size / h) * m.num_layers
        act += 8 * s * b * pp + s * b * h * pp
        act = _pp_factor(act, pp, vpp, num_microbatches)
        if pp == 1:
            act += s * b * h * 4 * (1 + m.padded_vocab_size / h)
        act /= tp
    else:                                                    # compute_activation_memory_without_sp
        act = s * b * h * (10 + 24 / tp) * m.num_layers
        act += 8 * s * b * pp + s * b * h * pp
        act = _pp_factor(act, pp, vpp, num_microbatches)
        if pp == 1:
            act += (s * b * m.padded_vocab_size / tp + s * b * h) * 2
        act *= 1.05
    return {"weight_optimizer_gb": weight_opt / GB, "activation_gb": act / GB, "total_gb": (weight_opt + act) / GB}


def _pp_factor(act: float, pp: int, vpp: int | None, m: int) -> float:
    if vpp is not None:
        return act * (1 + (pp - 1) / (pp * vpp))
    if pp > 1:
        return act * min(1, m / pp)
    return act


# ----- the runs -------------------------------------------------------------------------------------------------------
def published_cases(runs_path: Path = RUNS) -> list[dict]:
    """Fully specified non-fp8 rows of the published-runs file as (plan, training, settings) cases."""
    pb = _published_runs_module()
    rows = json.loads(Path(runs_path).read_text())["runs"]
    out = []
    for row in rows:
        p = row["parallel"]
        if row["fp8"] or row.get("stock_megatron") is False or not (p["micro_batch_size"] and p["recompute"]) \
                or (p["vpp"] is None and "vpp" in row.get("unknown", []) and p["pp"] > 1):
            continue
        if row["model"].get("normalization") == "layernorm1p":    # Nemotron-4: LayerNorm's shapes (weight, bias)
            row = {**row, "model": {**row["model"], "normalization": "layernorm"}}
        defaults: dict = {}
        precision = pb.precision_of(row, defaults)
        model, feats = pb.model_of(row, defaults), pb.features_of(row, defaults)
        n = row["num_gpus"]
        cluster = parse_cluster(f"{max(n // 8, 1)}x{min(n, 8)}-{row['gpu']}")
        sp = feats.pop("sequence_parallel")
        plan = uniform_plan(model, p["pp"], p["tp"], p["dp"], p["micro_batch_size"] * p["dp"], p["global_batch_size"],
                            recompute=p["recompute"], cluster=cluster, cp=p["cp"], sequence_parallel=sp,
                            num_virtual_stages=p["vpp"] or 1, **feats)
        settings = pb.settings_of(row, precision)      # NeMo rows: its bf16 grad_sync_dtype (published_runs.py)
        training = TrainingSpec(global_batch_size=p["global_batch_size"], micro_batch_sizes=[p["micro_batch_size"]],
                                precision=precision, attention=pb.attention_of(row))
        out.append({"id": row["id"], "plan": plan, "training": training, "settings": settings,
                    "grad": "fp32" if settings.grad_reduce_in_fp32 else "bf16", "note": ""})
    return out


def _lowprec_module():
    spec = importlib.util.spec_from_file_location("lowprec_published_bench", ROOT / "bench" / "lowprec_published.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bridge_cases(path: Path = BRIDGE) -> list[dict]:
    """The dense Llama rows of the Megatron-Bridge tables, imported from the Megatron-LM arguments they ran and
    priced with their recipe (bench/lowprec_published.py ``row_setup``: the one Bridge row path)."""
    if not path.exists():
        return []
    lp = _lowprec_module()
    out = []
    for r in json.loads(path.read_text())["rows"]:
        if r["model"] not in DENSE_BRIDGE or not r.get("expressible"):
            continue
        try:
            su = lp.row_setup(r)
        except Exception as e:  # noqa: BLE001 - a row our importer cannot read is reported, not priced
            out.append({"id": f"bridge-{r['version']}-{r['system']}-{r['model']}-{r['precision']}", "skipped": str(e)})
            continue
        out.append({"id": f"bridge-{r['version']}-{r['system'].lower()}-{r['model']}-{r['precision']}",
                    "plan": su["plan"], "training": su["training"], "settings": su["settings"],
                    "grad": "fp32" if su["settings"].grad_reduce_in_fp32 else "bf16",
                    "note": su["fixed"] or ""})
    return out


# ----- rows -----------------------------------------------------------------------------------------------------------
def _chunk_layers(plan) -> tuple[int, ...]:
    starts = plan.model.layer_starts
    return tuple(starts.index(ch.end_unit) - starts.index(ch.start_unit) for _, _, ch in plan.chunks_in_order())


def _built(plan, ranks) -> dict[int, tuple[int, int]]:
    """(parameters, buffer padding) megatron-core allocates on each pipeline rank in ``ranks``."""
    import torch

    from aceso_megatron.testing import meta_params as mp

    st = plan.stages[0]
    pp, chunks = plan.num_stages, _chunk_layers(plan)
    dpc = st.dp * st.cp
    out = {}
    with mp.world_of_one(), torch.device("meta"), mp._pipeline_rank(len(chunks) // pp) as set_rank:
        for r in ranks:
            set_rank(r)
            params = [p for j in range(len(chunks) // pp)
                      for p in mp.build_chunk(plan.model, st.tp, pp, chunks, r, j).parameters()]
            numels = [p.numel() for p in params]
            bucket = max(40_000_000, 1_000_000 * dpc) if plan.overlap_grad_reduce else None
            shared = frozenset(i for i, p in enumerate(params) if getattr(p, "shared_embedding", False))
            padded, _ = ddp_buffer_numel(numels, dpc, plan.distributed_optimizer, bucket, shared)
            out[r] = (sum(numels), padded - sum(numels))
    return out


def _ranks(pp: int) -> list[int]:
    return list(range(pp)) if pp <= 4 else [0, 1, pp - 1]


def case_rows(case: dict, build: bool = True) -> list[dict]:
    plan, training = case["plan"], case["training"]
    cm = make_cost_model(plan.model, plan.cluster, training, settings=case["settings"])
    cost = cm.evaluate(plan)
    st = plan.stages[0]
    ranks = _ranks(plan.num_stages)
    built = _built(plan, ranks) if build else {}
    bf16 = training.model_copy(update={"precision": "bf16", "fp8_param_gather": False, "bf16_layers_start": 0,
                                       "bf16_layers_end": 0})
    counted = make_cost_model(plan.model, plan.cluster, bf16, settings=case["settings"]).evaluate(plan) \
        if training.precision != bf16.precision else cost     # the parameters, without the recipe's weight bytes
    w = cm._w
    theory = theoretical_memory(plan.model, st.tp, plan.num_stages, st.dp * st.cp,
                                plan.num_virtual_stages if plan.num_virtual_stages > 1 else None,
                                plan.micro_batch_size // st.dp, plan.num_micro_batches,
                                plan.distributed_optimizer, st.sequence_parallel, st.all_recompute[0])
    rows = []
    for r in ranks:
        sc = cost.stages[r]
        b = sc.memory_breakdown
        planner = counted.stages[r].memory_breakdown["params"] * MB / w
        if plan.megatron_fsdp and shards(plan.megatron_fsdp.data_parallel_sharding_strategy)[0]:
            planner *= st.dp * st.cp    # Megatron FSDP shards the weights over DP x CP; megatron-core's count is whole
        mc, pad = built.get(r, (None, None))
        rows.append({
            "id": case["id"], "rank": r, "tp": st.tp, "pp": plan.num_stages, "dp": st.dp, "cp": st.cp,
            "vpp": plan.num_virtual_stages, "mbs": plan.micro_batch_size // st.dp, "recompute": st.all_recompute[0],
            "dist_opt": plan.distributed_optimizer, "grad": case["grad"], "note": case["note"],
            "precision": training.precision,
            "params_planner": planner, "params_megatron_core": mc,
            "params_diff": None if mc is None else planner - mc, "buffer_padding_params": pad,
            "weights_gb": b["params"] * MB / GB, "grads_gb": b["grads"] * MB / GB,
            "optimizer_gb": b["optimizer"] * MB / GB, "activations_gb": b["activations"] * MB / GB,
            "other_gb": (sc.memory_mb - b["params"] - b["grads"] - b["optimizer"] - b["activations"]) * MB / GB,
            "total_gb": sc.memory_mb * MB / GB, "limit_gb": cost.memory_limit_mb * MB / GB, "fits": sc.fits,
            "theory": theory if r == 0 else None})
    return rows


def memory_rows(runs_path: Path = RUNS, bridge_path: Path = BRIDGE, build: bool = True) -> list[dict]:
    """Every case's per-rank rows (the module docstring); skipped cases as ``{"id", "skipped"}``."""
    rows = []
    for case in published_cases(runs_path) + bridge_cases(bridge_path):
        if "skipped" in case:
            rows.append(case)
            continue
        rows.extend(case_rows(case, build))
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'run':44}{'rk':>3}{'tp,pp,dp,cp,v':>15}{'grad':>5}{'params (ours)':>15}{'mcore diff':>11}"
          f"{'pad':>6}{'w':>6}{'g':>6}{'opt':>6}{'act':>6}{'oth':>6}{'total':>7}{'/lim':>5}{'fits':>5}"
          f"{'MLM w+o':>8}{'MLM act':>8}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['id']:44} skipped: {r['skipped']}")
            continue
        t = r["theory"]
        diff = "-" if r["params_diff"] is None else f"{r['params_diff']:.0f}"
        pad = "-" if r["buffer_padding_params"] is None else f"{r['buffer_padding_params']}"
        print(f"{r['id'][:44]:44}{r['rank']:>3}{'%d,%d,%d,%d,%d' % (r['tp'], r['pp'], r['dp'], r['cp'], r['vpp']):>15}"
              f"{r['grad']:>5}{r['params_planner']:>15,.0f}{diff:>11}{pad:>6}{r['weights_gb']:>6.1f}"
              f"{r['grads_gb']:>6.1f}{r['optimizer_gb']:>6.1f}{r['activations_gb']:>6.1f}{r['other_gb']:>6.1f}"
              f"{r['total_gb']:>7.1f}{r['limit_gb']:>5.0f}{'yes' if r['fits'] else 'NO':>5}"
              + (f"{t['weight_optimizer_gb']:>8.1f}{t['activation_gb']:>8.1f}" if t else ""))
    priced = [r for r in rows if "skipped" not in r]
    over = sorted({r["id"] for r in priced if not r["fits"]})
    worst = max(priced, key=lambda r: r["total_gb"] / r["limit_gb"]) if priced else None
    diffs = [abs(r["params_diff"]) for r in priced if r["params_diff"] is not None]
    print(f"\n{len({r['id'] for r in priced})} runs, {len(priced)} rank rows; parameters vs megatron-core: "
          f"max |diff| {max(diffs) if diffs else float('nan'):.0f}; runs predicted over their GPU: "
          f"{', '.join(over) if over else 'none'}"
          + (f"; tightest run {worst['id']} rank {worst['rank']} at {worst['total_gb']:.1f} of "
             f"{worst['limit_gb']:.0f} GB" if worst else ""))


def main(argv: list[str] | None = None) -> int:
    ap = AcesoParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, default=RUNS, help="published-runs file (default bench/data/...)")
    ap.add_argument("--no-build", action="store_true", help="skip megatron-core's meta-device build")
    args = ap.parse_args(argv)
    rows = memory_rows(args.runs, BRIDGE, build=not args.no_build)
    print_table(rows)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "megatron_memory.json").write_text(json.dumps({"rows": rows}, indent=2, default=str) + "\n")
    print(f"wrote {out / 'megatron_memory.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
