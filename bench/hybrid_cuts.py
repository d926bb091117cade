"""What Megatron-LM's hybrid-pattern cuts buy a GPT / MoE model: the ``|``-pattern line vs the even split and the
layer-count uneven split (predicted, analytic cost model; issue 36).

Megatron-LM 0.17 on runs a GPT model as ``pretrain_hybrid.py --hybrid-layer-pattern "*-*-|*-..."`` whose ``|``
cuts stages at any unit, inside a layer too (search/megatron/hybrid_pattern.py). Two sections:

1. config: a fixed configuration (its tp, pp, cp, vpp, micro-batch, switches; the recompute setting at its best
   for the even split) and three splits of its layers: even (``--num-layers`` over pp x vpp, what the
   configuration runs as published), the layer-count uneven split (whole layers moved off the slowest stage while
   the iteration gets faster: ``--decoder-first/last-pipeline-num-layers`` / ``--pipeline-model-parallel-layout``)
   and the ``|`` pattern (units moved, from both), each re-priced at every recompute setting the hybrid form has.
   Llama 3 70B at Megatron-Bridge's TP4 PP8 VP5 on 64 H100s (bench/search_bench.py's published plan) and the
   best uniform configuration of each searched case.
2. search: ``aceso search``'s lines (planner/api.plan_all): uniform Megatron-LM (the even split), Megatron-LM plan
   (layer cuts, any split) and Megatron-LM |-pattern; first on NVIDIA's published multi-stage Nemotron-3
   configuration (``RECIPES``: Megatron-Bridge's 64-H100 Super recipe, the search held to its shape by its
   ``aceso search`` arguments, so its uniform line is that configuration on the even split), then on Llama 3 70B, GPT-3 175B, Mixtral 8x22B and Qwen2 57B-A14B
   on two clusters each, and the hybrid presets (Nemotron-3 Nano, Nemotron-H 8B / 56B), or any preset and cluster
   given with ``--case PRESET:CLUSTER:GBS``. A hybrid model's layers are its units, so its Megatron-LM line cuts at
   any unit already (as a ``|`` pattern: megatron-core splits a pattern without ``|`` evenly) and its |-pattern line
   can only equal it; section 2b (the uniform configuration's even split vs its ``|`` cuts) is what cuts buy it. A
   plan on one pipeline stage has nothing to cut: its |-pattern line is the Megatron-LM line and is left out (one
   note).

Run: ``python bench/hybrid_cuts.py [--quick] [--case PRESET:CLUSTER:GBS ...]``; prints the tables and writes
bench/results/hybrid_cuts.json. Gains are predicted by the analytic cost model (no GPU measurement here).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from search.io.argparser import AcesoParser  # noqa: E402  (no abbreviations, one-line errors)
from search.spec.cluster import parse_cluster  # noqa: E402
from search.costmodel.types import Features, Shape  # noqa: E402
from search.megatron.versions import release  # noqa: E402
from search.planner.aceso import SearchOptions  # noqa: E402
from search.planner.api import plan_all  # noqa: E402
from search.pricing import cost_model  # noqa: E402
from search.planner.hybrid_cuts import descend, hybrid_setting, price, refine, settings_for  # noqa: E402
from search.planner.megatron_lm import best_setting  # noqa: E402
from search.planner.report import describe  # noqa: E402
from search.planner.state import Evaluator, State  # noqa: E402
from search.spec.plan import even_split  # noqa: E402
from search.spec.presets import load_model  # noqa: E402
from search.spec.training import TrainingSpec  # noqa: E402
from search.settings.plan_settings import target_settings  # noqa: E402

REL = release()          # the newest Megatron-LM (core_v0.19.0): every recompute setting over hybrid layers
BUDGET = 1500
# id, preset, cluster, global batch, (tp, pp, cp, vpp, per-rank micro-batch) or None (the search's uniform one)
CONFIGS = [("llama3-70b bridge tp4 pp8 vp5", "llama3-70b", "8x8-h100", 128, (4, 8, 1, 5, 1))]
SEARCHES = [("llama3-70b", "8x8-h100", 128), ("llama3-70b", "16x8-h100", 512),
            ("gpt-175b", "16x8-h100", 1536), ("gpt-175b", "8x8-a100", 256),
            ("mixtral-8x22b", "8x8-h100", 256), ("mixtral-8x22b", "16x8-h100", 512),
            ("qwen2-57b-a14b", "4x8-h100", 256), ("qwen2-57b-a14b", "8x8-h100", 512),
            ("nemotron-3-nano", "4x8-h100", 512), ("nemotron-h-8b", "2x8-h100", 256),
            ("nemotron-h-56b", "8x8-h100", 192)]
QUICK = {("llama3-70b", "8x8-h100", 128), ("qwen2-57b-a14b", "4x8-h100", 256), ("nemotron-3-nano", "4x8-h100", 512)}
# NVIDIA's published configurations on more than one pipeline stage, as `aceso search` arguments that hold the search
# to the configuration's shape (its uniform line is then the configuration on the even split at its best recompute
# setting). Every published Nemotron-3 performance run is on one stage (bench/hybrid_published.py); Megatron-Bridge's
# 64-H100 Super recipe is the one on two: NVIDIA-NeMo/Megatron-Bridge 69c2088,
# src/megatron/bridge/recipes/nemotronh/h100/nemotron_3_super.py `_nemotron_3_super_pretrain_64gpu_h100_bf16_config`
# (the library's `nemotron_3_super_pretrain_config`): TP1 PP2 EP32 ETP1, no VPP, seq 4096, GBS 1280, MBS 1, BF16, the
# flex dispatcher (HybridEP), the precision-aware optimizer (fp16 main params, bf16 moments), bf16 gradients, DDP
# overlaps off. Not carried: its fixed expert capacity 1.10 with padding (priced dropless, as routed evenly) and its
# selective recompute of layernorm / moe_act / moe / core_attn (each split is priced at its best setting).
RECIPES = [("nemotron-3-super bridge h100 tp1 pp2 ep32", 1280,
            ["--model", "nemotron-3-super", "--cluster", "8x8-h100", "--global-batch-size", "1280",
             "--seq-length", "4096", "--tp", "1", "--pp", "2", "--ep", "32", "--etp", "1", "--vpp", "1",
             "--micro-batch-sizes", "1", "--sequence-parallel", "off", "--dispatcher", "flex",
             "--precision", "bf16", "--use-precision-aware-optimizer", "--main-params-dtype", "fp16",
             "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16", "--grad-reduce-in-bf16",
             "--overlap", "off", "--target", "megatron-lm", "--workers", "1"])]
ONE_STAGE = "pp 1: nothing to cut (the |-pattern line is the Megatron-LM line)"


# the lines are Megatron-LM runs: priced as Megatron-LM runs them (its interleaved p2p overlapped, its gradient
# reduction), not as the aceso runtime would (the RECIPES rows: their arguments' --target megatron-lm)
MEGATRON_LM = target_settings("megatron-lm", precision="bf16")


def _training(gbs: int) -> TrainingSpec:
    return TrainingSpec(global_batch_size=gbs, precision="bf16", micro_batch_sizes=[1, 2, 4], virtual_stages=None)


def _ms(e) -> float | None:
    return round(e.iteration_ms, 2) if e is not None and e.fits else None


def _gain(a, b) -> float | None:
    return round(a / b, 4) if a and b else None


def three_splits(ev: Evaluator, state: State) -> dict:
    """Even, layer-count uneven and |-pattern splits of one configuration (``state``: its even layer split)."""
    even = best_setting(ev, state, exact=True)
    if not even.fits:
        return {"even_ms": None}
    if state.num_stages == 1:
        return {"even_ms": _ms(even), "even_plan": describe(even), "pattern_note": ONE_STAGE}
    settings = settings_for(ev.cm.model, hybrid_setting(even.setting, ev.cm.model), REL)
    t0 = time.process_time()
    unit = 1 if ev.cm.model.hybrid_layer_pattern else 2      # units per layer: a hybrid model's layer is one
    layers = min((descend(ev, state, s, unit=unit) for s in settings), key=lambda e: (not e.fits, e.iteration_ms))
    pattern, _ = refine(ev, [even, layers], REL)
    return {"even_ms": _ms(even), "layers_ms": _ms(layers), "pattern_ms": _ms(pattern),
            "pattern_vs_even": _gain(_ms(even), _ms(pattern)), "pattern_vs_layers": _gain(_ms(layers), _ms(pattern)),
            "layers_vs_even": _gain(_ms(even), _ms(layers)), "even_plan": describe(even),
            "hybrid_layers_per_chunk": [b - a for a, b in zip(pattern.state.bounds, pattern.state.bounds[1:])]
            if pattern is not None else None, "refine_cpu_s": round(time.process_time() - t0, 2)}


def even_state(model, tp, pp, cp, vpp, mbs_rank, gpus, feats: Features) -> State:
    dp = gpus // (tp * pp * cp)
    layers = even_split(len(model.layer_starts) - 1, pp * vpp)
    starts, bounds, i = model.layer_starts, [0], 0
    for n in layers:
        i += n
        bounds.append(starts[i])
    bounds[-1] = model.num_units
    shape = Shape(tp=tp, dp=dp, cp=cp, sp=tp > 1)
    return State(mbs_rank * dp, (shape,) * pp, tuple(bounds), feats)


def section_config(quick: bool) -> list[dict]:
    rows = []
    for cid, preset, cluster, gbs, (tp, pp, cp, vpp, mbs) in CONFIGS:
        model, cl = load_model(preset), parse_cluster(cluster)
        cm = cost_model(model, cl, _training(gbs), MEGATRON_LM)
        ev = Evaluator(cm, gbs, None, "megatron-lm")
        feats = Features(distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)
        rows.append({"case": cid, "cluster": cluster, "gbs": gbs,
                     **three_splits(ev, even_state(model, tp, pp, cp, vpp, mbs, cl.num_gpus, feats))})
    return rows


def search_row(case: str, plans, cm, gbs: int, cpu: float) -> dict:
    """One search's lines (``plan_all``'s uniform, Megatron-LM and |-pattern plans) and, under ``config``, its uniform
    configuration's cuts only (``three_splits``)."""
    uni = plans.uniform.evaluation if plans.uniform is not None else None
    mlm = plans.megatron.plans[0] if plans.megatron.plans else None
    row = {"case": case, "even_ms": _ms(uni), "layers_ms": _ms(mlm),
           "pattern_ms": _ms(plans.pattern), "pattern_vs_even": _gain(_ms(uni), _ms(plans.pattern)),
           "pattern_vs_layers": _gain(_ms(mlm), _ms(plans.pattern)), "layers_vs_even": _gain(_ms(uni), _ms(mlm)),
           "even_plan": describe(uni) if uni is not None and uni.fits else None,
           "pattern_plan": describe(plans.pattern) if plans.pattern is not None else None,
           "not_offered": plans.not_offered.get("megatron_lm_pattern"), "search_cpu_s": round(cpu, 1)}
    if plans.pattern is not None and plans.pattern.state.num_stages == 1:
        row.update(pattern_ms=None, pattern_vs_even=None, pattern_vs_layers=None, pattern_note=ONE_STAGE)
    if uni is not None and uni.fits:      # the uniform configuration alone, its cuts only
        row["config"] = three_splits(Evaluator(cm, gbs, None, "megatron-lm", uni.moe), uni.state)
    print(json.dumps(row), flush=True)
    return row


def section_recipes() -> list[dict]:
    """``RECIPES``: the search held to each configuration's shape by its arguments (``aceso search`` itself): its
    uniform line is the configuration on the even split, its |-pattern line the same shape cut anywhere."""
    from search.cli.search_cmd import find, parse_args
    rows = []
    for cid, gbs, argv in RECIPES:
        t0 = time.process_time()
        found = find(parse_args([*argv, "--budget-evals", str(BUDGET)]), quiet=True)
        rows.append(search_row(cid, found.plans, found.cm, gbs, time.process_time() - t0))
    return rows


def section_search(quick: bool, cases=()) -> list[dict]:
    rows = []
    for preset, cluster, gbs in [c for c in SEARCHES if not quick or c in QUICK] + list(cases):
        model, tr = load_model(preset), _training(gbs)
        cm = cost_model(model, parse_cluster(cluster), tr, MEGATRON_LM)
        t0 = time.process_time()
        plans = plan_all(cm, tr, SearchOptions(budget_evals=BUDGET, workers=1))
        rows.append(search_row(f"{preset} {cluster} gbs {gbs}", plans, cm, gbs, time.process_time() - t0))
    return rows


def _table(title: str, rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=title)
    for col in ("case", "even ms", "layer cuts ms", "|-pattern ms", "|-pattern / even", "|-pattern / layer cuts",
                "layer cuts / even", "plan (even)"):
        t.add_column(col, justify="left" if col.startswith(("case", "plan")) else "right")
    fmt = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"      # noqa: E731
    for r in rows:
        t.add_row(r["case"], fmt(r.get("even_ms")), fmt(r.get("layers_ms")), fmt(r.get("pattern_ms")),
                  fmt(r.get("pattern_vs_even"), 4), fmt(r.get("pattern_vs_layers"), 4), fmt(r.get("layers_vs_even"), 4),
                  "; ".join(x for x in (r.get("even_plan"), r.get("not_offered"), r.get("pattern_note")) if x))
    Console(width=200).print(t)


def _case(text: str) -> tuple[str, str, int]:
    """``--case PRESET:CLUSTER:GBS``, each part checked (the preset, the cluster string, a positive batch)."""
    import argparse
    from search.io.errors import AcesoError
    parts = text.split(":")
    if len(parts) != 3 or not parts[2].isdigit() or int(parts[2]) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give PRESET:CLUSTER:GBS, e.g. nemotron-h-8b:2x8-h100:256")
    try:
        load_model(parts[0])
        parse_cluster(parts[1])
    except (AcesoError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {str(e).splitlines()[0]}") from None
    return parts[0], parts[1], int(parts[2])


def main(argv=None) -> int:
    p = AcesoParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one config and three searches")
    p.add_argument("--case", action="append", default=[], type=_case, metavar="PRESET:CLUSTER:GBS",
                   help="also search this preset on this cluster at this global batch (repeatable; e.g. "
                        "nemotron-3-super:8x8-gb200:512)")
    args = p.parse_args(argv)
    t0 = time.time()
    config = section_config(args.quick)
    search = section_recipes() + section_search(args.quick, args.case)
    _table("1. fixed configuration: even / layer-count / |-pattern splits (predicted, analytic)", config)
    _table("2. aceso search lines: uniform (even) / Megatron-LM plan (layer cuts) / Megatron-LM |-pattern",
           search)
    _table("2b. each search's uniform configuration, its cuts only", [{"case": r["case"], **r["config"]}
                                                                        for r in search if "config" in r])
    out = {"release": REL.tag, "budget_evals": BUDGET, "config": config, "search": search,
           "wall_s": round(time.time() - t0, 1)}
    res = ROOT / "bench" / "results"
    res.mkdir(parents=True, exist_ok=True)
    (res / "hybrid_cuts.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {res / 'hybrid_cuts.json'} ({out['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
