"""The published Nemotron-3 and Nemotron-H runs priced under our cost model, and the search against each
(issue 36: MAE <= 10%, no row beyond 20%, every run fits; the search vs each published configuration: median >=
1.15x, none below 1.0).

Rows: ``bench/data/nemotron3_published.json``: the 13 Nemotron-3 rows of ``../shared/published/
megatron-bridge-26.02-26.04.json`` (container 26.04.01, ``expressible: false`` there: they have no Megatron-LM GPT
command line) with every setting the run used and its source in Megatron-Bridge v0.4.1, and the Nemotron-H 56B rows
of NVIDIA's dgxc-benchmarking v25.05.05 (``nemotron_h_rows``).

The row reader (``row_plan``): the model is the preset (``model_specs/presets/nemotron-*.json``, made from the sourced
``model_specs/hybrid`` records); the run's settings are written as the Megatron-LM flags they are (``row_flags``) on
the model's GPT twin (its attention and MoE / MLP shapes, one attention + MLP layer per pattern layer) and read by
the one Megatron-LM importer (``search.megatron.read_megatron``, ``release`` = the row's container), which gives the
plan's parallel shape, precision recipe, distributed optimizer and overlaps, dispatcher, CUDA graphs and recompute;
the plan then holds the hybrid model, one chunk over its units, each unit's recompute its kind's in the twin (a
Mamba unit: none; no ``--recompute-modules`` entry covers a Mamba mixer); the CUDA-graph scope ``mamba`` is read and
priced as itself (``search/settings/stack.py``). What the reader drops, per row in ``notes``: the router's fp32
dtype (no cost term). TE's cross-entropy fusion is read (``--cross-entropy-loss-fusion
--cross-entropy-fusion-impl te``, priced by ``search.costmodel.stack_cost.cross_entropy``). Rows the presets cannot hold are listed
with why (Nemotron-3 Super: LatentMoE).

Run: ``python bench/hybrid_published.py [--search-evals N] [--rows TEXT...] [--breakdown]`` prints the table and
writes bench/results/hybrid_published.json (not with ``--rows``, which runs the rows whose id contains a TEXT);
``--breakdown`` prints where the published and the found plan's iteration goes; ``--exhaustive`` also prints, per
searched row, the fastest plan of the whole Megatron-LM space the search searches (``exhaustive_row``: minutes per
row; use it with ``--rows``). The search of each row is
``search.planner.settle``: cp 1 under the published MoE settings, again under the setting its final step chose,
then the CP degrees, each from the best plan so far.

Published runs that did not fit (``published_no_fit``): a row's footnote that the other precision's mapping "could not fit"
is priced and must be refused by the memory verdict search and validate share (``memory.headroom_verdict``).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from model_specs import preset_names  # noqa: E402
from search.io.argparser import AcesoParser  # noqa: E402  (no abbreviations, one-line errors)
from search.spec.cluster import parse_cluster  # noqa: E402
from search.spec.hybrid_arch import model_spec_data  # noqa: E402
from search.io.errors import AcesoError  # noqa: E402
from search.layers import hybrid  # noqa: E402
from search.megatron.importer import read_megatron  # noqa: E402
from search.spec.plan import ChunkSpec, ParallelPlan  # noqa: E402
from search.costmodel.plan_view import precision_of  # noqa: E402
from search.pricing import cost_model  # noqa: E402
from search.spec.training import TrainingSpec  # noqa: E402
from search.spec.presets import load_model  # noqa: E402

DATA = ROOT / "bench" / "data" / "nemotron3_published.json"
OUT = ROOT / "bench" / "results" / "hybrid_published.json"
TARGETS = {"mae": 0.10, "max": 0.20, "median_speedup": 1.15, "min_speedup": 1.0}

_FP = {  # the run's precision recipe as Megatron-LM flags (its settings.precision)
    "mxfp8": ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"],
    "fp8-cs": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "fp8-ds": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
    "nvfp4": ["--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"],
}


def load() -> list[dict]:
    """Every row: the Nemotron-3 Bridge rows and the Nemotron-H dgxc rows, as {id, model, cluster, gpus, version,
    settings, measured (tokens/s per GPU)}."""
    data = json.loads(DATA.read_text())
    out = []
    for r in data["rows"]:
        t = r["table"]
        out.append({"id": r["id"], "model": r["model"], "cluster": t["cluster"], "gpus": t["gpus"],
                    "version": t["version"], "settings": r["settings"], "measured": t["tokens_per_s_per_gpu"],
                    "source": "Megatron-Bridge " + t["source"], "footnotes": r.get("footnotes", {})})
    for r in data["nemotron_h_rows"]:
        out.append({"id": r["id"], "model": r["model"], "cluster": r["cluster"], "gpus": r["gpus"],
                    "version": "25.04", "settings": r["settings"], "measured": r["measured"]["tokens_per_s_per_gpu"],
                    "source": "dgxc-benchmarking v25.05.05"})
    return out


def _twin_flags(m) -> list[str]:
    """The model's GPT twin: its attention, MLP / MoE and embedding shapes as Megatron-LM flags."""
    f = ["--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden_size), "--ffn-hidden-size",
         str(m.ffn_hidden_size), "--num-attention-heads", str(m.num_attention_heads), "--group-query-attention",
         "--num-query-groups", str(m.groups), "--kv-channels", str(m.head_dim), "--position-embedding-type", "rope",
         "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--seq-length", str(m.seq_length),
         "--max-position-embeddings", str(m.seq_length), "--tokenizer-type", "NullTokenizer", "--vocab-size",
         str(m.vocab_size), "--make-vocab-size-divisible-by", str(m.make_vocab_size_divisible_by), "--mock-data"]
    e = m.moe
    if e is not None:
        f += ["--num-experts", str(e.num_experts), "--moe-router-topk", str(e.moe_router_topk),
              "--moe-ffn-hidden-size", str(e.moe_ffn_hidden_size), "--moe-router-score-function",
              e.moe_router_score_function, "--moe-aux-loss-coeff", str(e.moe_aux_loss_coeff)]
        f += ["--moe-router-enable-expert-bias"] if e.moe_router_enable_expert_bias else []
        if e.moe_shared_expert_intermediate_size:
            f += ["--moe-shared-expert-intermediate-size", str(e.moe_shared_expert_intermediate_size)]
    return f


def _te_config(per_module: dict) -> str:
    """A ``--te-precision-config-file`` of the row's ``per_module`` (recipe -> patterns; "every other linear" is the
    run's own recipe, no matcher), written to a temporary file (megatron-core's YAML,
    search/settings/precision_overrides.py)."""
    import tempfile
    from search.settings.precision_overrides import PrecisionOverride, write_yaml
    global _TMP
    ov = [PrecisionOverride(pattern=pat, recipe=r) for r, pats in per_module.items() if isinstance(pats, list)
          for pat in pats]
    if _TMP is None:               # one folder per process, removed with it
        _TMP = tempfile.TemporaryDirectory(prefix="aceso_te_quant_")
    path = Path(_TMP.name) / f"te_quant_{len(list(Path(_TMP.name).iterdir()))}.yaml"
    path.write_text(write_yaml(ov))
    return str(path)


_TMP = None


def row_flags(row: dict, m) -> tuple[list[str], list[str]]:
    """(the run's settings as Megatron-LM flags on ``m``'s GPT twin, what was left out and why)."""
    s, notes = row["settings"], []
    p = s["precision"]
    f = _twin_flags(m) + ["--tensor-model-parallel-size", str(s["tp"]), "--pipeline-model-parallel-size",
                          str(s["pp"]), "--context-parallel-size", str(s["cp"]), "--micro-batch-size", str(s["mbs"]),
                          "--global-batch-size", str(s["gbs"]), "--bf16", "--transformer-impl", "transformer_engine"]
    f += ["--sequence-parallel"] if s["sequence_parallel"] else []
    if m.moe is not None:
        f += ["--expert-model-parallel-size", str(s["ep"]), "--expert-tensor-parallel-size", str(s["etp"] or 1)]
        mo = s["moe"]
        f += ["--moe-grouped-gemm"] if mo["grouped_gemm"] else []
        f += ["--moe-permute-fusion"] if mo["permute_fusion"] else []
        f += ["--moe-token-dispatcher-type", mo["token_dispatcher_type"]]
        if mo["token_dispatcher_type"] == "flex":
            f += ["--moe-flex-dispatcher-backend", mo["flex_backend"]]
        f += ["--moe-router-force-load-balancing"] if mo["router_force_load_balancing"] else []
        f += ["--moe-shared-expert-overlap"] if mo["shared_expert_overlap"] else []
        if row["model"].startswith("nemotron-3"):   # recipe-nano / recipe-super (v0.4.1): fused weighted squared ReLU
            f += ["--use-fused-weighted-squared-relu"]
    f += [] if p.get("grad_reduce_in_fp32", True) else ["--grad-reduce-in-bf16"]
    f += _FP[p["recipe"]]
    f += ["--fp8-param-gather"] if p.get("fp8_param_gather") else []
    f += ["--reuse-grad-buf-for-mxfp8-param-ag"] if p.get("reuse_grad_buf_for_mxfp8_param_ag") else []
    if p.get("first_last_layers_bf16"):          # Super's NVFP4 recipe: its last 14 layers in bf16
        f += ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", str(p.get("num_layers_at_start_in_bf16", 0)),
              "--num-layers-at-end-in-bf16", str(p.get("num_layers_at_end_in_bf16", 0))]
    if p.get("per_module"):                      # Super's NVFP4 te_quant.cfg, through the import's own reader
        f += ["--te-precision-config-file", _te_config(p["per_module"])]
    f += ["--use-distributed-optimizer"] if s["distributed_optimizer"] else []
    f += ["--overlap-grad-reduce"] if s["overlap_grad_reduce"] else []
    f += ["--overlap-param-gather"] if s["overlap_param_gather"] else []
    f += ["--tp-comm-overlap"] if s["tp_comm_overlap"] and s["tp"] > 1 else []
    g = s.get("cuda_graphs") or {}
    if g.get("impl") not in (None, "none"):
        f += ["--cuda-graph-impl", g["impl"]] + (["--cuda-graph-scope", *g["scope"]] if g["scope"] else [])
    if s.get("cross_entropy_fusion_impl"):       # the loss's fusion (search.costmodel.stack_cost.cross_entropy)
        f += ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", s["cross_entropy_fusion_impl"]]
    rc = s["recompute"]
    if rc["granularity"]:
        f += ["--recompute-granularity", rc["granularity"]]
        mods = [x for x in rc["modules"] if x != "moe"]      # 'moe' (the whole MoE layer): no twin unit is that
        if "moe" in rc["modules"]:
            notes.append("recompute module 'moe' read as moe_act (the whole MoE layer is not a plan choice)")
        f += ["--recompute-modules", *mods] if mods else []
    return f, notes


def row_plan(row: dict) -> tuple[ParallelPlan, list[str]]:
    """The row's run as a plan of the hybrid preset (module docstring); AcesoError / ValueError: why not."""
    if row["model"] not in preset_names():      # the record's own refusal (Super, Ultra: LatentMoE)
        model_spec_data(hybrid.load(row["model"]))
    m = load_model(row["model"])
    cluster = parse_cluster(row["cluster"])
    flags, notes = row_flags(row, m)
    imp = read_megatron(" ".join(flags), world_size=row["gpus"], cluster=cluster, release=row["version"],
                        version="core_v0.16.1")
    twin = imp.plan
    st = twin.stages[0]
    if m.moe is not None:          # the run's routing (--moe-router-force-load-balancing), read on the twin
        m = m.model_copy(update={"moe": {**m.moe.model_dump(), "moe_router_force_load_balancing":
                                         twin.model.moe.moe_router_force_load_balancing}})
    by_kind = {}
    for u, rc in zip(twin.model.units[st.chunks[0].start_unit:], st.chunks[0].recompute):
        by_kind.setdefault(u.kind, rc)
    recompute = [by_kind.get(u.kind, "none") for u in m.units]
    stage = st.model_copy(update={"chunks": [ChunkSpec(start_unit=0, end_unit=m.num_units, recompute=recompute)]})
    data = {**twin.model_dump(exclude={"predicted"}), "model": m.model_dump(), "stages": [stage.model_dump()]}
    return ParallelPlan.model_validate(data), notes + imp.notes


def row_training(plan: ParallelPlan) -> TrainingSpec:
    """The training spec the row's plan runs under (as bench/moe_published.py's ``prepare``): its recipe and
    optimizer, batch sizes, distributed optimizer, TP overlap."""
    return TrainingSpec(global_batch_size=plan.global_batch_size,
                        micro_batch_sizes=sorted({1, 2, 4, 8, plan.micro_batch_size // plan.stages[0].dp}),
                        **precision_of(plan), distributed_optimizer=plan.distributed_optimizer, attention="flash",
                        tp_comm_overlap=plan.tp_comm_overlap, virtual_stages=None)


def price_row(row: dict) -> dict:
    out = {"id": row["id"], "model": row["model"], "cluster": row["cluster"], "version": row["version"],
           "precision": row["settings"]["precision"]["recipe"], "measured": row["measured"],
           "config": "tp{tp} pp{pp} cp{cp} ep{ep} mbs{mbs} gbs{gbs}".format(**row["settings"])}
    try:
        plan, notes = row_plan(row)
        cluster = parse_cluster(row["cluster"])
        training = row_training(plan)
        cm = cost_model(plan.model, cluster, training, plan.settings)
        cost = cm.evaluate(plan)
    except (AcesoError, ValueError) as e:
        return {**out, "status": "not priced: " + str(e).splitlines()[0]}
    tokens = plan.global_batch_size * plan.model.seq_length / (cost.iteration_ms / 1000) / row["gpus"]
    return {**out, "status": "priced", "predicted": tokens, "error": tokens / row["measured"] - 1,
            "iteration_ms": cost.iteration_ms, "fits": cost.fits, "memory_gib": cost.max_memory_mb / 1024,
            "limit_gib": cost.memory_limit_mb / 1024, "notes": notes, "_plan": plan, "_cm": cm,
            "_training": training}


def search_row(x: dict, evals: int) -> dict:
    """The search on the row's model, cluster, batch and software (its precision recipe, MoE settings), from the
    uniform baseline as ``aceso search`` starts and from the published plan itself (as the target runs it: the aceso
    runtime's form, ``runtime_state``), against the published plan under the same cost model: the search keeps the
    best plan it sees, so it is never slower than the published plan where that plan is in its space
    (``published``: in the space, or why not). Target: the aceso runtime, or Megatron-LM where the runtime cannot run
    the row (a low-precision recipe, a model it does not build: search.targets.capabilities). The reported plan is
    the best of the search's five that the one pre-flight (search.targets.preflight) says its target runs."""
    from search.planner.aceso import SearchOptions
    from search.planner.settle import settle
    from search.planner.api import make_space, runtime_state, runtime_training
    from search.planner.baseline import best_uniform
    from search.planner.state import from_plan
    from search.targets.capabilities import model_refusal

    from search.planner.state import to_plan
    from search.targets.preflight import preflight

    plan, cm, training = x["_plan"], x["_cm"], x["_training"]
    target = "megatron-lm" if training.precision != "bf16" or model_refusal("aceso", plan.model) else "aceso"
    if target == "aceso":
        training = runtime_training(training, strict=False)
    # cp 1 first, then ``aceso search``'s default CP degrees (1 2 4 8 from 8192 tokens on) from its best plan
    # (search.planner.settle): searched from scratch, the wider space spread the 1500 evaluations thinner and lost two
    # Nemotron-H 56B rows (h100x64 1.075x -> 1.056x)
    from search.cli.search_cmd import DEFAULT_CP
    wider = training.model_copy(update={"context_parallel_sizes": list(DEFAULT_CP)})
    c0 = time.process_time()
    try:
        space = make_space(cm, training, target, moe=plan.moe)
        base = best_uniform(cm, training.global_batch_size, space, cm.model)
        published = from_plan(plan)[0]
        published = runtime_state(published) if target == "aceso" else published
        why = space.refusal(space.start_of(published))
        seeds = ([base.state] if base is not None and base.fits else []) + ([published] if why is None else [])
        res, rounds = settle(cm, training, target, SearchOptions(budget_evals=evals, seeds=seeds), top_k=5,
                             moe=plan.moe, wider=wider, make_space=make_space)
    except AcesoError as e:
        return {"search_target": target, "search_status": "not searched: " + str(e).splitlines()[0]}
    inside = "in the space" if why is None else "not in the space: " + why

    def runs(e) -> bool:   # a plan counts only where the one pre-flight says its target runs it
        try:
            preflight(to_plan(e, cm.model, cm.cluster, training.global_batch_size, getattr(cm, "kind", "analytic"),
                              predicted=False, settings=plan.settings), target=target)
            return True
        except AcesoError:
            return False
    best = next((e for e in res.plans if e.fits and runs(e)), None)
    if best is None or not best.fits:
        return {"search_target": target, "search_status": "nothing fits", "search_s": time.process_time() - c0,
                "published": inside}
    found = to_plan(best, cm.model, cm.cluster, training.global_batch_size, getattr(cm, "kind", "analytic"),
                    predicted=False, settings=plan.settings)
    return {"search_target": target, "search_status": "searched", "search_ms": best.iteration_ms,
            "speedup": x["iteration_ms"] / best.iteration_ms, "search_s": time.process_time() - c0,
            "search_shape": plan_shape(found), "published": inside, "search_rounds": rounds, "_found": found}


def exhaustive_row(x: dict) -> dict:
    """The search's space enumerated (``search.planner.exhaustive.megatron_lm_bound``): every pp, stage shape (tp,
    cp, sp, ep, etp), micro-batch, VPP degree and plan-level switch combination, under every MoE setting the search's
    final step prices (``dispatchers.candidates``) and every CUDA-graph scope it tries (``graph_candidates`` and the
    published plan's), the cuts balanced by cost and refined as the search refines its final plans; the CP degrees
    of the search's wider space included. The row's target must be megatron-lm (the search's own for every row
    today)."""
    from search.cli.search_cmd import DEFAULT_CP
    from search.planner.api import make_space
    from search.planner.dispatchers import candidates, graph_candidates
    from search.planner.exhaustive import megatron_lm_bound
    from search.planner.state import from_plan, to_plan

    plan, cm, training = x["_plan"], x["_cm"], x["_training"]
    if x.get("search_target") != "megatron-lm":
        return {"exhaustive_status": "not enumerated: the row's target is not megatron-lm"}
    wider = training.model_copy(update={"context_parallel_sizes": list(DEFAULT_CP)})
    c0 = time.process_time()
    spaces = []
    for m in candidates(cm.model, cm.cluster, plan.moe, "megatron-lm") or [plan.moe]:
        try:
            spaces.append(make_space(cm, wider, "megatron-lm", moe=m))
        except AcesoError:
            continue
    own = from_plan(plan)[0].features.stack
    stacks = list(dict.fromkeys([None] + graph_candidates(cm.model, "megatron-lm") + ([own] if own else [])))
    best, n = megatron_lm_bound(cm, training.global_batch_size, spaces, stacks)
    if best is None:
        return {"exhaustive_status": "nothing fits", "exhaustive_states": n}
    found = to_plan(best, cm.model, cm.cluster, training.global_batch_size, getattr(cm, "kind", "analytic"),
                    predicted=False, settings=plan.settings)
    return {"exhaustive_status": "enumerated", "exhaustive_ms": best.iteration_ms,
            "exhaustive_speedup": x["iteration_ms"] / best.iteration_ms, "exhaustive_states": n,
            "exhaustive_s": time.process_time() - c0, "exhaustive_shape": plan_shape(found)}


def plan_shape(plan: ParallelPlan) -> str:
    """A plan's parallel shape as a Megatron-LM user reads it: ``--micro-batch-size`` is per data-parallel rank
    (the plan's ``micro_batch_size`` is the pipeline micro-batch, all dp ranks together: ``mbs 4 x 16
    micro-batches`` at gbs 512 and dp 8 is the plan's 32), then each stage's tp / cp / dp / ep, the recompute
    modules and the MoE / stack switches that differ from the defaults."""
    st, s = plan.stages, plan.settings
    per_rank = plan.micro_batch_size // st[0].dp
    shapes = " | ".join(dict.fromkeys(f"tp{x.tp} cp{x.cp} dp{x.dp}" + (f" ep{x.ep}" if plan.model.moe else "")
                                      for x in st))
    v = len(st[0].chunks)
    rc = sorted({r for x in st for r in x.all_recompute} - {"none"})
    extra = [f"recompute {'/'.join(rc)}"] if rc else []
    if s.moe is not None:
        extra.append(s.moe.token_dispatcher + (f"-{s.moe.flex_backend}" if s.moe.token_dispatcher == "flex" else "")
                     + (" +ep-overlap" if s.moe.overlap_ep_comm else ""))
    graphs = getattr(s.stack, "cuda_graphs", None) if s.stack is not None else None
    extra += [f"graphs {' '.join(sorted(graphs.scope)) or 'layers'}"] if graphs else []
    off = getattr(s.stack, "offload", None) if s.stack is not None else None
    extra += [f"offload {' '.join(off.modules)}" + (f" ({off.fraction:g})" if off.fraction < 1 else "")] if off else []
    return (f"pp{len(st)} v{v} mbs {per_rank} x {plan.global_batch_size // plan.micro_batch_size} micro-batches "
            f"{shapes}" + (f" ({', '.join(extra)})" if extra else ""))


IN_MICRO_BATCHES = ("tp", "cp", "ep", "fsdp_param_gather", "fsdp_grad_reduce")   # exposed inside fwd / bwd


def breakdown(cm, plan: ParallelPlan) -> dict:
    """Where a plan's iteration goes (ms per iteration, on its busiest stage): ``compute`` (the micro-batches'
    forward and backward less their exposed TP / CP / EP / FSDP time; the host-bound launch time the MoE units expose
    included), ``comm`` (exposed communication by kind: tp, cp, ep, p2p, dp, param_gather, ...), ``recompute``,
    ``optimizer`` (the rest of the stage's busy time: the step, without the exposed parameter gather it holds) and
    ``bubble`` (the iteration less the busy time), and the stage's memory (GiB) by term."""
    cost = cm.evaluate(plan)
    b = cost.pipeline.bottleneck
    s, m = cost.stages[b], plan.global_batch_size // plan.micro_batch_size
    busy = cost.pipeline.stage_busy_ms[b] if cost.pipeline.stage_busy_ms else cost.pipeline.stage_total_ms[b]
    comm = {k: v[0] for k, v in s.comm.items() if v[0] > 0.005}
    compute = m * (s.fwd_ms + s.bwd_ms) - sum(v for k, v in comm.items() if k in IN_MICRO_BATCHES)
    rec = s.recompute_ms * m
    return {"iteration": cost.iteration_ms, "compute": compute, "comm": comm, "recompute": rec,
            "optimizer": busy - compute - sum(comm.values()) - rec, "bubble": cost.iteration_ms - busy,
            "memory": {k: v / 1024 for k, v in s.memory_breakdown.items() if v > 1}, "memory_gib": s.memory_mb / 1024,
            "limit_gib": cost.memory_limit_mb / 1024}


def breakdown_lines(name: str, d: dict) -> list[str]:
    comm = ", ".join(f"{k} {v:.0f}" for k, v in sorted(d["comm"].items(), key=lambda kv: -kv[1])) or "none"
    mem = ", ".join(f"{k} {v:.1f}" for k, v in sorted(d["memory"].items(), key=lambda kv: -kv[1]))
    return [f"  {name:<9} {d['iteration']:9.0f} ms = compute {d['compute']:.0f} + exposed comm "
            f"{sum(d['comm'].values()):.0f} ({comm}) + recompute {d['recompute']:.0f} + optimizer "
            f"{d['optimizer']:.0f} + bubble {d['bubble']:.0f}",
            f"  {'':<9} memory {d['memory_gib']:.1f}/{d['limit_gib']:.0f} GiB: {mem}"]


_NO_FIT = re.compile(r"Mapping used for (\w+) precision could not fit for\s+(\w+) precision")
# the parallel mapping of a row: what "the mapping used for <precision>" carries over to the other precision's run
_MAPPING = ("tp", "pp", "cp", "vp", "ep", "etp", "dp", "sequence_parallel", "mbs", "ga", "fsdp")


def published_no_fit(rows: list[dict] | None = None) -> list[dict]:
    """The published runs NVIDIA says do not fit, against our memory verdict. A row's footnote "Mapping used for
    MXFP8 precision could not fit for NVFP4 precision for this model" (Megatron-Bridge performance summary,
    Nemotron-3 Super on B200) names a run that was tried and ran out of memory: the MXFP8 row's parallel mapping
    (``_MAPPING``) with this row's precision. It is priced two ways, since the footnote does not say which of the
    other settings went with it: the MXFP8 row's settings with this row's precision recipe, and this row's settings
    on the MXFP8 row's mapping. Each must be refused by the memory verdict the search and validate use
    (``memory.headroom_verdict`` at ``DEFAULT_HEADROOM``): over the GPU, or inside the headroom."""
    from search.costmodel.memory import DEFAULT_HEADROOM, headroom_verdict
    rows = rows if rows is not None else load()
    out = []
    for r in rows:
        for note in r.get("footnotes", {}).values():
            if not (m := _NO_FIT.search(note)):
                continue
            src, dst = m.group(1).lower(), m.group(2).lower()
            twin = next((x for x in rows if x["model"] == r["model"] and x["cluster"] == r["cluster"] and
                         x["version"] == r["version"] and x["settings"]["precision"]["recipe"] == src), None)
            if twin is None or r["settings"]["precision"]["recipe"] != dst:
                out.append({"id": r["id"], "status": f"no {src} twin of this row: not checked"})
                continue
            variants = {
                f"the {src} row's settings, {dst} recipe": {**twin["settings"],
                                                             "precision": r["settings"]["precision"]},
                f"this row's settings on the {src} mapping": {**r["settings"],
                                                              **{k: twin["settings"][k] for k in _MAPPING}},
            }
            for name, settings in variants.items():
                x = price_row({**r, "id": f"{r['id']} as {name}", "settings": settings})
                if x["status"] != "priced":
                    out.append({"id": x["id"], "status": x["status"]})
                    continue
                verdict = headroom_verdict(x["memory_gib"] * 1024, x["limit_gib"] * 1024, DEFAULT_HEADROOM)
                out.append({"id": x["id"], "status": "priced", "memory_gib": x["memory_gib"],
                            "limit_gib": x["limit_gib"], "verdict": verdict, "agrees": verdict is not None,
                            "evidence": note})
    return out


def summarize(rows: list[dict]) -> dict:
    errs = [abs(r["error"]) for r in rows if r["status"] == "priced"]
    sp = [r["speedup"] for r in rows if r.get("speedup")]
    return {"rows": len(rows), "priced": len(errs), "mae": statistics.fmean(errs) if errs else None,
            "max_abs": max(errs, default=None), "all_fit": all(r["fits"] for r in rows if r["status"] == "priced"),
            "searched": len(sp), "median_speedup": statistics.median(sp) if sp else None,
            "min_speedup": min(sp, default=None)}


def verdicts(rows: list[dict], s: dict) -> list[str]:
    """One PASS / FAIL line per target of the issue, naming the rows that miss it."""
    out = [f"{'PASS' if s['mae'] is not None and s['mae'] <= TARGETS['mae'] else 'FAIL'}  MAE <= {TARGETS['mae']:.0%}"]
    beyond = [f"{r['id']} {r['error']:+.1%}" for r in rows if r["status"] == "priced" and
              abs(r["error"]) > TARGETS["max"]]
    out.append(f"{'FAIL' if beyond else 'PASS'}  no row beyond {TARGETS['max']:.0%}" + (": " + "; ".join(beyond)
                                                                                      if beyond else ""))
    out.append(f"{'PASS' if s['all_fit'] else 'FAIL'}  every published run fits")
    if s["searched"]:
        out.append(f"{'PASS' if s['median_speedup'] >= TARGETS['median_speedup'] else 'FAIL'}  search median "
                   f"{s['median_speedup']:.3f}x >= {TARGETS['median_speedup']}x")
        low = [f"{r['id']} {r['speedup']:.3f}x" for r in rows if r.get("speedup") and
               r["speedup"] < TARGETS["min_speedup"]]
        out.append(f"{'FAIL' if low else 'PASS'}  no search below {TARGETS['min_speedup']}x" + (": " + "; ".join(low)
                                                                                             if low else ""))
    return out


def fit(grid=None) -> list[tuple[float, float, float]]:
    """``search.layers.mamba.SSD_KERNEL_TIME`` scanned over ``grid`` on every priced row: (value, MAE, max |error|)
    each. A fit never edits the source: the value is written into mamba.py by hand."""
    from search.layers import mamba
    rows, old, out = load(), mamba.SSD_KERNEL_TIME, []
    try:
        for v in grid or [1 + 0.25 * i for i in range(25)]:
            mamba.SSD_KERNEL_TIME = v
            errs = [abs(x["error"]) for x in map(price_row, rows) if x["status"] == "priced"]
            out.append((v, statistics.fmean(errs), max(errs)))
    finally:
        mamba.SSD_KERNEL_TIME = old
    return out


def main(argv: list[str] | None = None) -> int:
    ap = AcesoParser(description=__doc__.splitlines()[0])
    ap.add_argument("--search-evals", type=int, default=1500, help="search budget per row (0: no search)")
    ap.add_argument("--fit", action="store_true", help="scan mamba.SSD_KERNEL_TIME and print the MAE of each value")
    ap.add_argument("--rows", nargs="+", metavar="TEXT", help="only the rows whose id contains one of these "
                    "(e.g. nano/gb300 nemotron-h-56b/h100x32); the summary then covers those rows only")
    ap.add_argument("--breakdown", action="store_true", help="print where the published and the found plan's "
                    "iteration goes (compute, exposed communication, recompute, optimizer, bubble) and their memory")
    ap.add_argument("--exhaustive", action="store_true", help="also enumerate each searched row's whole "
                    "Megatron-LM space and print its fastest plan next to the search's (minutes per row: use --rows)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    if args.fit:
        for v, mae, worst in fit():
            print(f"SSD_KERNEL_TIME {v:5.2f}: MAE {mae:6.1%}, max |error| {worst:6.1%}")
        return 0
    rows = [price_row(r) for r in load() if not args.rows or any(t in r["id"] for t in args.rows)]
    if not rows:
        print(f"--rows {' '.join(args.rows)}: no row id contains any of these; see the ids in {DATA.name}",
              file=sys.stderr)
        return 2
    print(f"{'row':<78} {'measured':>9} {'predicted':>9} {'error':>7} {'mem GiB':>12}  status")
    for r in rows:
        if r["status"] != "priced":
            print(f"{r['id']:<78} {r['measured']:>9.0f} {'-':>9} {'-':>7} {'-':>12}  {r['status']}")
            continue
        mem = f"{r['memory_gib']:.1f}/{r['limit_gib']:.0f}"
        print(f"{r['id']:<78} {r['measured']:>9.0f} {r['predicted']:>9.0f} {r['error']:>+7.1%} {mem:>12}  "
              f"{'fits' if r['fits'] else 'OUT OF MEMORY'}")
    if args.search_evals:
        print(f"\nthe search ({args.search_evals} evaluations from the uniform baseline and the published plan) vs "
              "the published plan, both under this cost model:")
        for r in rows:
            if r["status"] != "priced":
                continue
            r.update(search_row(r, args.search_evals))
            if r["search_status"] != "searched":
                print(f"{r['id']:<78} {r['search_target']:>12}  {r['search_status']}")
                continue
            print(f"{r['id']:<78} {r['search_target']:>12}  {r['speedup']:.3f}x  {r['search_shape']}  "
                  f"({r['search_s']:.0f} CPU s)" + ("" if r["published"] == "in the space" else
                                                f"  published plan {r['published']}"))
            if args.exhaustive:
                r.update(exhaustive_row(r))
                if r["exhaustive_status"] != "enumerated":
                    print(f"  exhaustive: {r['exhaustive_status']}")
                else:
                    print(f"  exhaustive: {r['exhaustive_speedup']:.3f}x  {r['exhaustive_shape']}  "
                          f"({r['exhaustive_states']} states, {r['exhaustive_s']:.0f} CPU s; the search "
                          f"{r['search_ms'] / r['exhaustive_ms']:.4f}x its time)")
            if args.breakdown:
                print("  rounds: " + "; ".join(r["search_rounds"]))
                print(f"  published {plan_shape(r['_plan'])}")
                for line in (breakdown_lines("published", breakdown(r["_cm"], r["_plan"])) +
                             breakdown_lines("found", breakdown(r["_cm"], r["_found"]))):
                    print(line)
    s = summarize(rows)
    print(f"\npriced {s['priced']}/{s['rows']} rows: MAE {s['mae']:.1%}, max |error| {s['max_abs']:.1%}, "
          f"all fit: {s['all_fit']} (targets: MAE <= {TARGETS['mae']:.0%}, none beyond {TARGETS['max']:.0%})")
    for line in verdicts(rows, s):
        print(line)
    no_fit = published_no_fit() if not args.rows else []
    for x in no_fit:
        print(f"published as not fitting: {x['id']}: " + (x["status"] if x["status"] != "priced" else
              f"{x['memory_gib']:.1f}/{x['limit_gib']:.0f} GiB, " + (f"refused ({x['verdict']})" if x["agrees"]
                                                                    else "FITS (the published run did not)")))
    s["published_no_fit_agree"] = all(x.get("agrees") for x in no_fit) if no_fit else None
    if s["searched"]:
        print(f"searched {s['searched']} rows: median speedup {s['median_speedup']:.3f}x, lowest "
              f"{s['min_speedup']:.3f}x (targets: median >= {TARGETS['median_speedup']}x, none below "
              f"{TARGETS['min_speedup']}x)")
    for r in rows:
        for k in ("_plan", "_cm", "_training", "_found"):
            r.pop(k, None)
    if args.rows:     # a part of the table: the full run's file stays as it is
        print(f"--rows: {OUT} not written ({time.monotonic() - t0:.0f} s)")
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"rows": rows, "summary": s, "targets": TARGETS,
                               "seconds": time.monotonic() - t0}, indent=2, default=str) + "\n")
    print(f"wrote {OUT} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
