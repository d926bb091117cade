"""Published Megatron-Bridge MoE runs under our cost model, and the search against each published configuration.

Every MoE row of ../shared/published/megatron-bridge-25.09-25.11.json (Megatron-Bridge's performance tables of the
25.09 and 25.11 containers, measured tokens/s/GPU and TFLOP/s/GPU) is written as a plan and priced:

- model: the preset named by the row (``deepseek-v3`` / ``deepseek-v3-no-mtp`` by its MTP layers,
  ``qwen3-30b-a3b``, ``qwen3-235b-a22b``, ``gpt-oss-120b`` where that preset exists; none: "no preset") at the row's
  sequence length, with its token-drop capacity (``--moe-expert-capacity-factor``; the presets are dropless);
- cluster: the row's ``cluster`` string (GB200/GB300: NVL72 racks of 64 used GPUs); a GPU we have no preset for is
  "waits for issue 24" with the parser's reason;
- precision: the row's label mapped to our recipe name (``search.precision.LABELS`` where the low-precision branch
  has it) and looked up by ``TrainingSpec`` itself (``precision_support``): a precision it refuses is "waits for
  issue 24", so the rows price once the recipes exist, with no list here to update;
- plan (``row_plan``): every stage ``tp x cp x dp`` with the row's ``ep`` and ``--expert-tensor-parallel-size``
  (megatron-core's default: tp), SP at tp > 1, the pipeline micro-batch ``mbs x dp``, the row's ``gbs``, layers per
  model chunk from its arguments (``--pipeline-model-parallel-layout``, else ``--decoder-first/last-pipeline-num-
  layers``, else even over ``pp x vp``: ``search.megatron.layout``), an MTP layer (``m``) in the last chunk,
  recompute from its ``--recompute-*`` flags (the modules onto units as ``search.megatron.recompute.unit_choices``
  maps a selective setting: ``mla_up_proj`` / ``mlp`` are priced as the attention units' selective recompute,
  the table says which), the distributed optimizer
  and overlaps from its flags, the MoE settings (dispatcher, grouped GEMM, permute fusion, overlaps) from its flags;
  gradients reduced in bf16 where it says ``--grad-reduce-in-bf16`` (``RunSettings``), else Megatron-LM's fp32;
  the parameters stored quantized (no bf16 copy) where it says ``--fp8-param-gather``;
- predicted tokens/s/GPU = ``gbs x seq / iteration / GPUs``; TFLOP/s/GPU by the row's own FLOP count (the
  published TFLOP/s scaled by predicted / measured tokens, so both columns share one error); error = predicted /
  measured - 1; memory: whether every stage fits the GPU.

Then, on every priced row, the search (``planner.aceso.search`` seeded with the published plan, so it is never
slower under our own model) and the speedup over the published configuration; the median over the rows. The
target is ``aceso`` (per-stage shapes) for bf16 rows and ``megatron-lm`` for low-precision ones (the aceso runtime
runs no FP8/FP4 recipe yet: ``search.preflight.RUNTIME_LOW_PRECISION``).

Until the MoE cost model lands, ``make_cost_model`` refuses MoE models (``search.moe.refuse_unpriced``): those
rows say so in the table. The search-time line: DeepSeek-V3 on 256 H100s (32x8-h100, global batch 4096, one worker,
the default budget), target 60 s on one core. Run: ``python bench/moe_published.py`` (table and the time line;
bench/results/moe_published.json); ``--no-search`` prices only; ``--budget-s`` caps each row's search;
``--breakdown`` adds each priced row's iteration by stage; ``--fit`` refits the MoE time constants on the rows not kept
out of the fit (``OUT_OF_FIT``: listed under the table with their errors and reasons).
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

from search.argparser import AcesoParser  # noqa: E402  (no abbreviations, one-line errors)
from search.cluster import parse_cluster  # noqa: E402
from search.costmodel import RunSettings, make_cost_model  # noqa: E402
from search.errors import AcesoError  # noqa: E402
from search.megatron.config import NO_RECOMPUTE, Recompute  # noqa: E402
from search.megatron.layout import distribution, parse_layout  # noqa: E402
from search.megatron.recompute import unit_choices  # noqa: E402
from search.moe_plan import MoEPlanSettings  # noqa: E402
from search.plan import ChunkSpec, ParallelPlan, StageSpec, recompute_allowed  # noqa: E402
from search.presets import load_model  # noqa: E402
from search.training import TrainingSpec  # noqa: E402

BRIDGE = ROOT.parent / "shared" / "published" / "megatron-bridge-25.09-25.11.json"
WAITS = "waits for issue 24"


# ----- what a row needs ---------------------------------------------------------------------------------------------
def load_rows(path: Path = BRIDGE) -> list[dict]:
    """The MoE rows of the Megatron-Bridge file."""
    return [r for r in json.loads(Path(path).read_text())["rows"] if r.get("moe")]


def mtp_layers(row: dict) -> int:
    if row.get("mtp_layers") is not None:
        return int(row["mtp_layers"])
    return int(bool((row.get("model_tags") or {}).get("mtp")))


def preset_name(row: dict) -> str:
    if row["model"] == "deepseek-v3":
        return "deepseek-v3" if mtp_layers(row) else "deepseek-v3-no-mtp"
    return row["model"]


def precision_name(label: str) -> str:
    """Our recipe name of a Bridge precision label (the low-precision branch's ``LABELS`` where it exists)."""
    try:
        from search.precision import LABELS
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
        from search.precision import is_low
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


def chunk_layers(f: dict, num_layers: int, pp: int, vp: int) -> tuple[tuple[int, ...], bool]:
    """(layers per model chunk in model order, whether the last chunk holds an MTP layer ``m``)."""
    if f.get("--pipeline-model-parallel-layout"):
        chunks = parse_layout(f["--pipeline-model-parallel-layout"][0])
        if len(chunks) != pp * vp:
            raise AcesoError(f"layout of {len(chunks)} chunks for pp {pp} x vp {vp}")
        return tuple(c.count("t") for c in chunks), "m" in chunks[-1]
    return distribution(num_layers, pp, vp, _int(f, "--decoder-first-pipeline-num-layers"),
                        _int(f, "--decoder-last-pipeline-num-layers"),
                        "--account-for-embedding-in-pipeline-split" in f,
                        "--account-for-loss-in-pipeline-split" in f), False


def recompute_of(f: dict) -> Recompute:
    gran = (f.get("--recompute-granularity") or [None])[0]
    if gran == "selective":
        return Recompute("selective", modules=tuple(f.get("--recompute-modules") or ["core_attn"]))
    if gran == "full":
        return Recompute("full", (f.get("--recompute-method") or ["uniform"])[0], _int(f, "--recompute-num-layers", 1))
    return NO_RECOMPUTE


def unit_recompute(rc: Recompute, model, a: int, b: int) -> list[str]:
    """Per-unit choices of ``rc`` on units ``[a, b)``: ``unit_choices``, with MoE units selective only where the
    modules name ``moe_act``, and a choice a unit's kind cannot take (an MTP unit: none or full) none."""
    out = []
    for c, u in zip(unit_choices(rc, model, a, b), model.units[a:b]):
        if c == "selective" and u.kind == "moe" and "moe_act" not in rc.modules:
            c = "none"
        out.append(c if c in recompute_allowed(u.kind) else "none")
    return out


def moe_settings_of(f: dict) -> MoEPlanSettings:
    return MoEPlanSettings(
        token_dispatcher=(f.get("--moe-token-dispatcher-type") or ["allgather"])[0],
        grouped_gemm="--moe-grouped-gemm" in f, permute_fusion="--moe-permute-fusion" in f,
        shared_expert_overlap="--moe-shared-expert-overlap" in f,
        overlap_ep_comm="--overlap-moe-expert-parallel-comm" in f)


def row_plan(row: dict, model, cluster=None) -> ParallelPlan:
    """The row's published configuration as a plan on ``model`` (see the module docstring)."""
    f = flags(row["args"])
    tp, pp, cp, dp, ep, vp = row["tp"], row["pp"], row["cp"], row["dp"], row["ep"], row["vp"] or 1
    if tp * cp * dp * pp != row["gpus"]:
        raise AcesoError(f"tp {tp} x cp {cp} x dp {dp} x pp {pp} is not the row's {row['gpus']} GPUs")
    layers, mtp_last = chunk_layers(f, model.num_layers, pp, vp)
    if 0 in layers:
        raise AcesoError(f"model chunk {layers.index(0)} of the layout holds no transformer layer (megatron-core "
                         "allows a loss- or embedding-only chunk; aceso plans give every chunk a layer)")
    if sum(layers) != model.num_layers:
        raise AcesoError(f"the layout holds {sum(layers)} layers, the model {model.num_layers}")
    if mtp_last != bool(model.mtp_num_layers):
        raise AcesoError(f"the layout {'has' if mtp_last else 'lacks'} the MTP layer; the preset has "
                         f"{model.mtp_num_layers or 0}")
    starts, rc = model.layer_starts, recompute_of(f)
    spans, li = [], 0
    for n in layers:
        spans.append((starts[li], starts[li + n]))
        li += n
    spans[-1] = (spans[-1][0], model.num_units)      # the MTP block (if any) belongs to the last chunk
    etp = _int(f, "--expert-tensor-parallel-size")
    stages = [StageSpec(num_gpus=tp * cp * dp, tp=tp, cp=cp, dp=dp, sequence_parallel=tp > 1, ep=ep,
                        etp=None if etp is None or etp == tp else etp,
                        chunks=[ChunkSpec(start_unit=a, end_unit=b, recompute=unit_recompute(rc, model, a, b))
                                for a, b in spans[s::pp]])
              for s in range(pp)]
    dist = "--use-distributed-optimizer" in f
    return ParallelPlan(model=model, cluster=cluster, micro_batch_size=row["mbs"] * dp, global_batch_size=row["gbs"],
                        distributed_optimizer=dist, overlap_grad_reduce="--overlap-grad-reduce" in f,
                        overlap_param_gather=dist and "--overlap-param-gather" in f, stages=stages,
                        moe=moe_settings_of(f))


def row_model(row: dict):
    """The row's preset at its sequence length and token-drop capacity (``AcesoError``: no preset)."""
    base = load_model(preset_name(row))
    f = flags(row["args"] or "")
    dump = base.model_dump()
    dump["seq_length"] = row["seq"]
    if f.get("--moe-expert-capacity-factor"):
        dump["moe"]["moe_expert_capacity_factor"] = float(f["--moe-expert-capacity-factor"][0])
    return type(base).model_validate(dump)


def _reason(e: Exception) -> str:
    """One line of an error (a pydantic validation error: its first message)."""
    errs = getattr(e, "errors", None)
    if callable(errs):
        try:
            return str(errs()[0]["msg"]).removeprefix("Value error, ")
        except Exception:  # noqa: BLE001 - not a pydantic error after all
            pass
    return str(e).splitlines()[0]


def row_settings(row: dict) -> RunSettings:
    return RunSettings(grad_reduce_in_fp32="--grad-reduce-in-bf16" not in (row["args"] or ""))


def prepare(row: dict) -> dict:
    """The row's plan, cluster and training spec, or ``{"status": why not}``."""
    try:
        model = row_model(row)
    except AcesoError:
        return {"status": f"no preset {preset_name(row)}"}
    whys = [precision_support(row["precision"])]
    try:
        cluster = parse_cluster(row["cluster"])
    except AcesoError as e:
        whys.append(str(e).split(";")[0].split(": ", 1)[-1])
        cluster = None
    plan, built = None, "no arguments: " + (row.get("why_not") or "the row has no command line")
    if row["args"]:
        try:
            plan, built = row_plan(row, model, cluster), "plan builds"
        except (AcesoError, ValueError) as e:
            built = f"not buildable: {_reason(e)}"
    if any(whys):
        return {"status": f"{WAITS}: " + "; ".join(w for w in whys if w) + f" ({built.split(':')[0]})"}
    if plan is None:
        return {"status": built}
    training = TrainingSpec(global_batch_size=row["gbs"], micro_batch_sizes=sorted({1, 2, 4, 8, row["mbs"]}),
                            precision=precision_name(row["precision"]), attention="flash",
                            fp8_param_gather="--fp8-param-gather" in row["args"],
                            virtual_stages=None)      # every degree Megatron-LM accepts (the rows use up to 24)
    return {"status": "ok", "plan": plan, "cluster": cluster, "training": training}


# ----- pricing and searching ----------------------------------------------------------------------------------------
def price_row(row: dict, search_budget_s: float | None = None) -> dict:
    out = {"id": row["id"], "model": row["model"], "cluster": row["cluster"], "precision": row["precision"],
           "config": f"tp{row['tp']} pp{row['pp']} cp{row['cp']} ep{row['ep']} vp{row['vp']} mbs{row['mbs']} "
                     f"gbs{row['gbs']}", "measured_tokens": row["tokens_per_s_per_gpu"],
           "measured_tflops": row["tflops_per_gpu"],
           "recompute": recompute_of(flags(row["args"])).label if row["args"] else None}
    prep = prepare(row)
    if prep["status"] != "ok":
        return {**out, "status": prep["status"]}
    plan, training = prep["plan"], prep["training"]
    try:
        cm = make_cost_model(plan.model, prep["cluster"], training, settings=row_settings(row))
        cost = cm.evaluate(plan)
    except AcesoError as e:
        return {**out, "status": f"not priced: {_reason(e).split(';')[0]}"}
    it = cost.iteration_ms
    tokens = row["gbs"] * plan.model.seq_length / (it / 1000) / row["gpus"]
    meas = row["tokens_per_s_per_gpu"]
    out.update(status="priced", iteration_ms=it, tokens=tokens, fits=cost.fits,
               max_memory_gib=cost.max_memory_mb / 1024, limit_gib=cost.memory_limit_mb / 1024,
               error=(tokens / meas - 1) if meas else None,
               tflops=row["tflops_per_gpu"] * tokens / meas if meas and row["tflops_per_gpu"] else None)
    if search_budget_s is not None:
        out.update(search_row(cm, training, plan, it, search_budget_s, search_target(row["precision"])))
    return out


def search_row(cm, training, plan, published_ms: float, budget_s: float, target: str = "aceso") -> dict:
    """The search seeded with the published plan: its time, the speedup, the plan's shape and seconds taken."""
    from search.planner.aceso import SearchOptions, search
    from search.planner.api import make_space
    from search.planner.state import from_plan
    t0 = time.monotonic()
    space = make_space(cm, training, target, moe=plan.moe)      # the published MoE settings on every state
    seed = from_plan(plan)[0]
    if not space.legal(space.normalize(seed)):
        return {"search_ms": None, "speedup": None, "search_s": 0.0,
                "search_note": "the published plan is outside the search space"}
    opts = SearchOptions(budget_evals=3000, budget_s=budget_s, seeds=[seed])
    res = search(cm, training.global_batch_size, space, opts)
    best = res.plans[0] if res.plans else None
    if best is None or not best.fits:
        return {"search_ms": None, "speedup": None, "search_s": time.monotonic() - t0}
    shapes = " | ".join(sorted({f"tp{s.tp} dp{s.dp} ep{s.ep} etp{s.expert_tp}" for s in best.state.shapes}))
    return {"search_ms": best.iteration_ms, "speedup": published_ms / best.iteration_ms, "search_target": target,
            "search_shape": f"pp{best.state.num_stages} v{best.state.num_chunks} {shapes}",
            "search_s": time.monotonic() - t0}


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
    return {"rows": len(rows), "priced": len(priced),
            "mae": statistics.fmean(abs(r["error"]) for r in priced) if priced else None,
            "all_fit": all(r["fits"] for r in priced) if priced else None,
            "median_speedup": statistics.median(speed) if speed else None,
            "min_speedup": min(speed) if speed else None,
            "waiting": sum(r["status"].startswith(WAITS) for r in rows)}


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def print_table(rows: list[dict], summary: dict) -> None:
    print(f"{'model':16}{'cluster':11}{'prec':14}{'config':36}{'meas tok':>9}{'pred tok':>9}{'err':>7}"
          f"{'TFLOP/s':>8}{'fits':>5}{'speedup':>8}  status")
    for r in rows:
        print(f"{r['model']:16}{r['cluster']:11}{r['precision']:14}{r['config']:36}"
              f"{_fmt(r['measured_tokens'], '9.0f', '        -')}{_fmt(r.get('tokens'), '9.0f', '        -')}"
              f"{_fmt(r.get('error'), '+7.1%', '      -')}{_fmt(r.get('tflops'), '8.0f', '       -')}"
              f"{('yes' if r.get('fits') else 'no') if 'fits' in r else '-':>5}"
              f"{_fmt(r.get('speedup'), '7.2f', '      -') + ('x' if r.get('speedup') else ' ')}  {r['status']}")
    s = summary
    print(f"\n{s['priced']} of {s['rows']} MoE rows priced; MAE {_fmt(s['mae'], '.1%')}; every priced run fits: "
          f"{s['all_fit']}; search vs published: median {_fmt(s['median_speedup'], '.3f')}x, lowest "
          f"{_fmt(s['min_speedup'], '.3f')}x; {s['waiting']} rows {WAITS}")


def main(argv: list[str] | None = None) -> int:
    ap = AcesoParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bridge", default=str(BRIDGE), help="the Megatron-Bridge published-runs file")
    ap.add_argument("--no-search", action="store_true", help="price the published configurations only")
    ap.add_argument("--budget-s", type=float, default=60.0, help="wall-clock cap of each row's search (s)")
    ap.add_argument("--only", default=None, help="only rows whose id contains this")
    ap.add_argument("--breakdown", action="store_true", help="also print each priced row's stage breakdown")
    ap.add_argument("--fit", action="store_true", help="fit the MoE time constants (moe_cost.py) and stop")
    args = ap.parse_args(argv)
    path = Path(args.bridge)
    if not path.is_file():
        print(f"--bridge {path}: no such file (../shared/published/ beside the worktree); give the file")
        return 2
    raw = [r for r in load_rows(path) if args.only is None or args.only in r["id"]]
    if args.fit:
        fit(raw)
        return 0
    rows = [price_row(r, None if args.no_search else args.budget_s) for r in raw]
    summary = summarize(rows)
    print_table(rows, summary)
    summary["fit"] = fit_summary(rows)
    print_fit_summary(summary["fit"])
    if args.breakdown:
        print_breakdown(rows, raw)
    timing = search_time() if not args.no_search else {"status": "skipped (--no-search)"}
    summary["search_time"] = timing
    print(f"search time, {timing.get('model', 'deepseek-v3')} on {timing.get('cluster', '32x8-h100')} (target 60 s): "
          + (f"{timing['seconds']:.1f} s wall, {timing['cpu_s']:.1f} s CPU, {timing['evaluations']} evaluations"
             if "seconds" in timing else timing["status"]))
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_published.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=2) + "\n")
    print(f"\nwrote {out / 'moe_published.json'}")
    return 0


# ----- --breakdown: where each priced row's iteration goes (issue 22, moetime) --------------------------------------
BREAKDOWN = ("attention", "experts", "a2a", "router", "shared", "host", "other", "p2p", "sync", "bubble")


def breakdown(row: dict) -> dict | None:
    """ms of one iteration on the pipeline's busiest stage by stage of the layer: the MoE unit's parts
    (``moe_cost.moe_parts``: expert GEMMs, exposed all-to-all, router / permute, shared expert and its TP
    collectives), the host-bound wait (``moe_cost.host_bound``), the attention units, the rest of the stage's compute (embedding, head, dense
    layers, MTP, recompute), exposed p2p, the per-iteration sync (DP / EDP gradients, step, parameter gather) and
    the bubble (iteration - the stage's busy time). None: the row is not priced."""
    from search.costmodel.analytic import _lp_unit
    from search.costmodel.moe_cost import moe_parts
    from search.costmodel.types import Features
    from search.moe_plan import moe_settings
    prep = prepare(row)
    if prep["status"] != "ok":
        return None
    plan = prep["plan"]
    try:
        cm = make_cost_model(plan.model, prep["cluster"], prep["training"], settings=row_settings(row))
        cost = cm.evaluate(plan)
    except AcesoError:
        return None
    i = cost.pipeline.bottleneck
    st, sc, m, M = plan.stages[i], cost.stages[i], plan.model, plan.num_micro_batches
    b, cfg = plan.micro_batch_size / st.dp, moe_settings(plan)
    ov = Features.of_plan(plan).tp_comm_overlap and st.sequence_parallel and st.tp > 1
    table = cm._prepared(b, st.tp, st.cp, st.sequence_parallel, ov, st.ep, st.etp or 0, cfg).table
    units = [u for a, e in st.spans for u in range(a, e)]
    moe_units = [u for u in units if m.units[u].kind == "moe"]
    att = sum(table.fwd_ms[u] + table.bwd_ms[u] for u in units if m.units[u].kind == "attention") * M
    out = dict.fromkeys(BREAKDOWN, 0.0)
    if moe_units:
        parts = moe_parts(cm.source, b, m.seq_length // st.cp, st.tp, st.sequence_parallel, st.ep, st.etp or 0,
                          cfg, ov, _lp_unit(cm.source, m.units[moe_units[0]]))
        for name in ("experts", "a2a", "router"):
            out[name] = sum(parts[name]) * len(moe_units) * M
        out["shared"] = (sum(parts["shared"]) + sum(parts["tp"])) * len(moe_units) * M
        priced = sum(sum(parts[n]) for n in ("router", "experts", "a2a", "shared", "tp"))
        out["host"] = sum(table.fwd_ms[u] + table.bwd_ms[u] - priced for u in moe_units) * M
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


# ----- rows kept out of the MoE fit, and the fit (issue 22, moetime; docs/costmodel.md "MoE calibration") ---------
_H100_235B = "the 25.11 dropless run is 1.31x faster than the 25.09 drop-and-pad run of the same shape, though " \
             "dropless only adds the dispatcher's host sync; no setting in the file tells them apart (containers " \
             "25.09 vs 25.11, recipes v0.5.1 vs v0.2.0): inconsistent pair"
OUT_OF_FIT = {
    "25.11/pretrain/qwen3-235b-a22b/h100x256/fp8-cs/gbs2048-mbs1-seq4096/tp2pp8cp1vp4ep32fsdp0": _H100_235B,
    "25.09/pretrain/qwen3-235b-a22b-token_drop1/h100x256/fp8-cs/gbs2048-mbs1-seq4096/tp2pp8cp1vp4ep32fsdp0":
        _H100_235B,
}
OUT_OF_FIT_MODELS = {"gpt-oss-120b": "kernels not priced: attention sinks (--softmax-type learnable), the clamped "
                                     "quick-GEGLU with linear biases in the experts (all four rows 1.4-2x slower "
                                     "than priced, at every mbs)"}


def fit_note(row: dict) -> str | None:
    """Why a priced row is kept out of the MoE fit (None: it is fitted)."""
    return OUT_OF_FIT.get(row["id"]) or OUT_OF_FIT_MODELS.get(row["model"])


def fit_summary(rows: list[dict]) -> dict:
    """MAE over the fitted rows, and the rows kept out with their errors and reasons."""
    priced = [r for r in rows if r["status"] == "priced" and r.get("error") is not None]
    fitted = [r for r in priced if fit_note(r) is None]
    return {"fit_rows": len(fitted), "fit_mae": statistics.fmean(abs(r["error"]) for r in fitted) if fitted else None,
            "out_of_fit": [{"id": r["id"], "error": r["error"], "why": fit_note(r)} for r in priced if fit_note(r)]}


def print_fit_summary(fs: dict) -> None:
    print(f"fitted rows: {fs['fit_rows']}, MAE {_fmt(fs['fit_mae'], '.1%')}; kept out of the fit:")
    for r in fs["out_of_fit"]:
        print(f"  {r['error']:+7.1%}  {r['id']}: {r['why']}")


def fit(raw: list[dict], hosts=(3.5, 4.0, 4.5, 4.75, 5.0, 5.5, 6.0), k0s=(4000, 5000, 6000, 6500, 7000, 8000)):
    """Grid least-MAE fit of ``moe_cost.HOST_FWD_MS`` and ``GROUPED_K0_LP`` on the fitted rows; prints the grid's
    best and restores the constants."""
    from search.costmodel import moe_cost as mc
    keep = (mc.HOST_FWD_MS, mc.GROUPED_K0_LP)
    rows = [r for r in raw if fit_note({"id": r["id"], "model": r["model"]}) is None]
    grid = []
    try:
        for h in hosts:
            for k0 in k0s:
                mc.HOST_FWD_MS, mc.GROUPED_K0_LP = h, k0
                grid.append((fit_summary([price_row(r) for r in rows])["fit_mae"], h, k0))
    finally:
        mc.HOST_FWD_MS, mc.GROUPED_K0_LP = keep
    grid.sort()
    for mae, h, k0 in grid[:5]:
        print(f"HOST_FWD_MS {h:5.2f}  GROUPED_K0_LP {k0:6.0f}: MAE {mae:.1%}")


if __name__ == "__main__":
    sys.exit(main())
