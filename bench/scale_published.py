"""Published MLPerf Training runs at scale against the analytic cost model: step time, row by row, before and after.

Rows: ``bench/data/mlperf_training.json`` (NVIDIA's MLPerf Training v4.0-v5.1 LLM pre-training submissions, 8 to
11,616 GPUs: GPT-3 175B, Llama 3.1 405B, Llama 3.1 8B; written by ``bench/data/mlperf_extract.py`` from the
submissions' own config scripts, system files and logs, each row with its source paths; bench/data/README.md).
Measured: the median logged step time (``measured.step_s``; how, per round: the extractor's docstring).

Each row is written as the Megatron-LM command line its NeMo configuration runs (``args_of``: the benchmark's
architecture from ``ARCHITECTURES``, the row's TP / PP / VP / CP / MBS / GBS, precision recipe, FP8 parameter
gather, distributed optimizer, gradient-reduce and parameter-gather overlaps, DDP bucket size, parameter-gather
alignment, the tp-pp-dp rank order, TP overlap, CUDA graphs; gradients reduced in bf16 as NeMo's MLPerf code does)
and priced through the one row path of the Megatron-Bridge rows (``lowprec_published.row_setup``: ``read_megatron``
-> ``make_cost_model`` -> ``evaluate``, as ``aceso explain --megatron-args`` prices it), on two clusters:
``cluster_of`` (DGX H100 / B200 nodes of 8; GB200 / GB300 NVL72 racks of ``SEGMENT`` trays of 4, the Slurm segment
the config places in one NVLink domain, written as racks ``8x64-gb200``) and ``written_cluster`` (the system file's
nodes x GPUs, ``128x4-gb200``, no domain given: how a user copies it). Error = predicted / measured - 1 of the step
time (positive: the model is too slow). "before": the same rows priced by aceso at 9ebe16b
(``bench/data/scale_published_before.json``, written by this bench's ``--predictions`` there; it refused
``--use-tp-pp-dp-mapping``, so those rows were priced without it and are listed). The summary is over the runs of
512 GPUs and more and over all; every run must fit in memory.

Run: ``python bench/scale_published.py`` (table, bench/results/scale_published.json; about 10 s);
bench/published_runs.py prints it too. ``--predictions FILE`` writes the code at hand's predictions and stops.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from search.io.argparser import AcesoParser  # noqa: E402
from search.pricing import make_cost_model  # noqa: E402

import lowprec_published as lp  # noqa: E402

DATA = ROOT / "bench" / "data" / "mlperf_training.json"
BEFORE = ROOT / "bench" / "data" / "scale_published_before.json"
SCALE_GPUS = 512
# The benchmarks' models, each with its source (the submission's NeMo config and the MLPerf reference).
ARCHITECTURES = {
    "llama31_405b": {
        "flags": "--num-layers 126 --hidden-size 16384 --ffn-hidden-size 53248 --num-attention-heads 128 "
                 "--group-query-attention --num-query-groups 8 --position-embedding-type rope --rotary-base 500000 "
                 "--normalization RMSNorm --swiglu --untie-embeddings-and-output-weights --disable-bias-linear "
                 "--attention-dropout 0.0 --hidden-dropout 0.0",
        "vocab": 32768,
        "source": "NeMo Llama31Config405B (pretrain.py: OVERWRITTEN_NUM_LAYERS default 126); tokenizer: the "
                  "implementation README, 'we replace the paper's TikTokenizer with the Mixtral 8x22b tokenizer' "
                  "(32,768 tokens)"},
    "llama31_8b": {
        "flags": "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
                 "--group-query-attention --num-query-groups 8 --position-embedding-type rope --rotary-base 500000 "
                 "--normalization RMSNorm --swiglu --untie-embeddings-and-output-weights --disable-bias-linear "
                 "--attention-dropout 0.0 --hidden-dropout 0.0",
        "vocab": 128256,
        "source": "NeMo Llama31Config8B (config_common_8b.sh: OVERWRITTEN_NUM_LAYERS=32); tokenizer: the "
                  "llama-3-1-8b tokenizer (README, data_scripts/download_8b.sh); MODEL_TFLOP_PER_SAMPLE=421.59 "
                  "is 6 N s + causal attention + the 128,256-token output layer"},
    "gpt3": {
        "flags": "--num-layers 96 --hidden-size 12288 --ffn-hidden-size 49152 --num-attention-heads 96 "
                 "--position-embedding-type learned_absolute --normalization LayerNorm "
                 "--attention-dropout 0.0 --hidden-dropout 0.0",
        "vocab": 50257,
        "source": "NeMo megatron_gpt_config with conf/custom.yaml (96 layers, 12288 hidden, 96 heads, ffn 4h, "
                  "layernorm1p priced as LayerNorm, dropout 0, tied embeddings, biases); vocabulary: the MLPerf "
                  "C4 SentencePiece model's 50,257 ids (the reference's PassThroughVocabulary(size=50257))"},
}


def load_rows(path: Path = DATA) -> list[dict]:
    return json.loads(path.read_text())["rows"] if path.exists() else []


def _on(env: dict, key: str, default: bool = False) -> bool:
    v = env.get(key)
    return default if v is None else v.strip().lower() in ("1", "true")


def cluster_of(row: dict) -> str:
    """DGX H100 / B200: nodes of 8 on InfiniBand. GB200 / GB300: NVL72 racks, each one NVLink domain of ``SEGMENT``
    trays of 4 (Slurm's ``--segment``: the trays a job gets inside one rack; a run without it fits one rack)."""
    env, sysd = row["env"], row["system"]
    nodes, gpn = int(sysd["number_of_nodes"]), int(sysd["accelerators_per_node"])
    name = sysd["accelerator_model_name"]
    gpu = next(g for key, g in (("GB300", "gb300"), ("GB200", "gb200"), ("B200", "b200"), ("H100", "h100"))
               if key in name)
    if gpn == 4:      # a Grace-Blackwell tray of an NVL72 rack
        racks = re.search(r"\((\d+)x NVIDIA GB\d00 NVL72\)", sysd["system_name"])
        trays = int(env["SEGMENT"]) if "SEGMENT" in env else nodes // int(racks.group(1)) if racks else nodes
        domain = gpn * min(trays, nodes)
        return f"{nodes * gpn // domain}x{domain}-{gpu}"
    return f"{nodes}x{gpn}-{gpu}"


def args_of(row: dict) -> str:
    """The Megatron-LM command line the row's NeMo configuration runs."""
    env, log = row["env"], row["log"]
    arch = ARCHITECTURES[row["benchmark"]]
    tp, pp = int(env["TENSOR_MODEL_PARALLEL"]), int(env["PIPELINE_MODEL_PARALLEL"])
    cp = int(env.get("CONTEXT_PARALLEL", 1))
    vp = env.get("INTERLEAVED_PIPELINE")
    seq = log["max_sequence_length"]
    a = [arch["flags"], f"--seq-length {seq} --max-position-embeddings {seq}",
         f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp} --context-parallel-size {cp}"]
    if tp > 1 and _on(env, "SEQ_PARALLEL", True):
        a.append("--sequence-parallel")
    if pp > 1 and vp not in (None, "null", "1"):
        a.append(f"--num-virtual-stages-per-pipeline-rank {vp}")
    if pp > 1 and _on(env, "ASYM_PP_EMBED"):
        a.append("--account-for-embedding-in-pipeline-split")
    if pp > 1 and _on(env, "ASYM_PP_LOSS"):
        a.append("--account-for-loss-in-pipeline-split")
    a.append(f"--micro-batch-size {env['MICRO_BATCH_SIZE']} --global-batch-size {log['global_batch_size']}")
    a.append("--bf16 --grad-reduce-in-bf16")     # NeMo: grad_reduce_in_fp32=False / grad_sync_dtype bf16
    if _on(env, "FP4"):
        a.append(f"--fp4-format e2m1 --fp4-recipe {env.get('FP4_RECIPE', 'nvfp4')}")
    elif _on(env, "FP8"):
        recipe = env.get("FP8_RECIPE", "delayed")
        a.append(f"--fp8-format {'hybrid' if _on(env, 'FP8_HYBRID') else 'e4m3'} --fp8-recipe {recipe}")
        if _on(env, "FP8_PARAM_GATHER") or _on(env, "FP8_PARAMS"):
            a.append("--fp8-param-gather")
    if _on(env, "USE_DIST_OPTIMIZER", True):
        a.append("--use-distributed-optimizer")
    if _on(env, "OVERLAP_GRAD_REDUCE", True):
        a.append("--overlap-grad-reduce")
    if _on(env, "OVERLAP_PARAM_GATHER", True):
        a.append("--overlap-param-gather")
    if env.get("BUCKET_SIZE"):          # megatron-core DDP bucket_size, parameters (v4.x GPT-3's BUCKET_CAP_MB is
        a.append(f"--ddp-bucket-size {int(env['BUCKET_SIZE'])}")   # Apex DistributedFusedAdam's: not written)
    if pp > 1 and vp not in (None, "null", "1") and not _on(env, "ALIGN_PARAM_GATHER", True):
        a.append("--no-align-param-gather")
    if _on(env, "TP_PP_DP_MAPPING"):
        a.append("--use-tp-pp-dp-mapping")
    if tp > 1 and _on(env, "TP_COMM_OVERLAP"):
        a.append("--tp-comm-overlap")
    if _on(env, "FULL_CUDA_GRAPH"):
        a.append("--cuda-graph-impl local --cuda-graph-scope full_iteration")
    elif _on(env, "LAYER_CUDA_GRAPH"):
        a.append("--cuda-graph-impl transformer_engine")
    a.append(f"--transformer-impl transformer_engine --tokenizer-type NullTokenizer --vocab-size {arch['vocab'] - 1} "
             "--mock-data")
    return " ".join(a)


def written_cluster(row: dict) -> str:
    """The cluster as the system file counts it (nodes x GPUs per node, no NVLink domain given)."""
    sysd = row["system"]
    gpu = cluster_of(row).split("-", 1)[1]
    return f"{sysd['number_of_nodes']}x{sysd['accelerators_per_node']}-{gpu}"


def shape_of(row: dict) -> tuple[int, int, int, int, int]:
    env = row["env"]
    tp, pp, cp = (int(env[k]) if k in env else 1 for k in ("TENSOR_MODEL_PARALLEL", "PIPELINE_MODEL_PARALLEL",
                                                          "CONTEXT_PARALLEL"))
    n = int(row["system"]["number_of_nodes"]) * int(row["system"]["accelerators_per_node"])
    return n, tp, pp, cp, n // (tp * pp * cp)


def release_of(row: dict) -> str | None:
    """The NeMo container the submission ran (its system file's framework, "NVIDIA NeMo Framework Release 25.09"),
    the release its kernels are priced as (``search/settings/releases.py``: an unlisted one the nearest, said in its note)."""
    m = re.search(r"(\d\d\.\d\d(?:\.\d\d)?)", row["system"].get("framework", ""))
    return m.group(1) if m else None


def price(row: dict, cluster: str, drop: tuple[str, ...] = ()) -> dict:
    """The row on ``cluster`` (``lowprec_published.row_setup``, as ``aceso explain --megatron-args`` prices it),
    without the flags in ``drop``: step time, the exposed DP sync of the stage that exposes most, memory."""
    args = " --".join(x for x in args_of(row).split(" --") if x.split()[0].lstrip("-") not in drop)
    su = lp.row_setup({"cluster": cluster, "args": args, "ga": None, "dp": shape_of(row)[4],
                       "gbs": row["log"]["global_batch_size"], "version": release_of(row)})
    cm = make_cost_model(su["plan"].model, su["cluster"], su["training"], settings=su["settings"])
    cost = cm.evaluate(su["plan"])
    dp_exp = max(sum(s.comm.get(k, (0.0, 0.0))[0] for k in ("dp", "param_gather", "edp", "edp_param_gather"))
                 for s in cost.stages)
    return {"cluster": su["cluster"].label, "predicted_s": cost.iteration_ms / 1e3, "dp_exposed_s": dp_exp / 1e3,
            "memory_gib": cost.max_memory_mb / 1024, "memory_limit_gib": cost.memory_limit_mb / 1024,
            "fits": cost.fits, "precision": su["training"].precision,
            "fwd_ms": cost.stages[0].fwd_ms if len(cost.stages) == 1 else None}


def predictions(rows: list[dict]) -> dict:
    """Every row priced by the code at hand on both clusters (``cluster_of``, ``written_cluster``), dropping a flag
    the code refuses (the flags named in its one-line error): {id: {"nvl": ..., "written": ..., "dropped": [...]}}."""
    out = {}
    for r in rows:
        drop: tuple[str, ...] = ()
        for _ in range(3):
            try:
                out[r["id"]] = {"nvl": price(r, cluster_of(r), drop), "written": price(r, written_cluster(r), drop),
                                "dropped": list(drop)}
                break
            except Exception as e:  # noqa: BLE001 - an older aceso refuses a flag: price the row without it
                flag = re.search(r"(--[a-z0-9-]+)", str(e))
                if flag is None:
                    raise
                drop += (flag.group(1).lstrip("-"),)
    return out


def price_row(row: dict, before: dict | None = None) -> dict:
    """The row priced now, beside ``before`` (this bench's ``predictions`` at the commit before the change)."""
    n, tp, pp, cp, dp = shape_of(row)
    now = price(row, cluster_of(row))
    written = price(row, written_cluster(row))
    meas = row["measured"]["step_s"]
    b = (before or {}).get(row["id"])
    return {"id": row["id"], "gpus": n, "cluster": now["cluster"], "written_cluster": written["cluster"],
            "benchmark": row["benchmark"],
            "config": f"tp{tp} pp{pp} cp{cp} dp{dp} vp{row['env'].get('INTERLEAVED_PIPELINE', 'null').replace('null', '1')} "
                      f"mbs{row['env']['MICRO_BATCH_SIZE']} gbs{row['log']['global_batch_size']}",
            "precision": now["precision"], "measured_s": meas, "predicted_s": now["predicted_s"],
            "error": now["predicted_s"] / meas - 1, "dp_exposed_s": now["dp_exposed_s"],
            "written_error": written["predicted_s"] / meas - 1,
            "before_error": b["nvl"]["predicted_s"] / meas - 1 if b else None,
            "before_written_error": b["written"]["predicted_s"] / meas - 1 if b else None,
            "before_dp_exposed_s": b["nvl"]["dp_exposed_s"] if b else None,
            "before_dropped": b["dropped"] if b else None,
            "memory_gib": now["memory_gib"], "memory_limit_gib": now["memory_limit_gib"], "fits": now["fits"]}


def forward_row(row: dict) -> dict | None:
    """A one-stage row's forward-only step (``measured.validation_step_s``: the submission's validation steps, the same
    full-iteration graph without the backward, the optimizer step, the DP collectives or TP overlap) beside the
    priced forward of its micro-batches as it runs there (without ``--tp-comm-overlap``), and what each step has
    beyond three forwards: measured ``step - 3 x forward-only``, priced ``step - 3 x forward`` (the backward beyond
    twice the forward, exposed DP sync, the optimizer step, per-step host time)."""
    n, tp, pp, cp, dp = shape_of(row)
    fwd_meas = row["measured"].get("validation_step_s")
    if pp != 1 or not fwd_meas:
        return None
    micro = row["log"]["global_batch_size"] // (dp * int(row["env"]["MICRO_BATCH_SIZE"]))
    fwd = price(row, cluster_of(row), drop=("tp-comm-overlap",))["fwd_ms"] * micro / 1e3
    step, meas = price(row, cluster_of(row))["predicted_s"], row["measured"]["step_s"]
    return {"id": row["id"], "measured_step_s": meas, "measured_forward_s": fwd_meas, "predicted_forward_s": fwd,
            "forward_error": fwd / fwd_meas - 1, "measured_beyond_3f_s": meas - 3 * fwd_meas,
            "predicted_beyond_3f_s": step - 3 * fwd}


def summarize(results: list[dict], key: str = "error") -> dict:
    rows = [x for x in results if x.get(key) is not None]
    errs = np.array([abs(x[key]) for x in rows])
    if not len(errs):
        return {"rows": 0}
    return {"rows": len(rows), "mae": float(errs.mean()), "median_abs": float(np.median(errs)),
            "max_abs": float(errs.max()), "worst": rows[int(errs.argmax())]["id"],
            "all_fit": all(x["fits"] for x in rows)}


def report() -> dict | None:
    rows = load_rows()
    if not rows:
        return None
    before = json.loads(BEFORE.read_text())["predictions"] if BEFORE.exists() else None
    results = sorted((price_row(r, before) for r in rows), key=lambda x: (x["gpus"], x["id"]))
    scale = [x for x in results if x["gpus"] >= SCALE_GPUS]
    fwd = [f for f in (forward_row(r) for r in sorted(rows, key=lambda r: (shape_of(r)[0], r["id"]))) if f]
    return {"rows": results, "forward_only": fwd,
            "summary": {name: {k: summarize(sel, k) for k in ("before_error", "error", "before_written_error",
                                                              "written_error")}
                        for name, sel in (("scale", scale), ("all", results))}}


def print_table(rep: dict) -> None:
    print("published MLPerf Training runs (NVIDIA, v4.0-v5.1) vs the analytic cost model: step time, error = "
          "predicted / measured - 1; before = aceso at 9ebe16b (bench/data/scale_published_before.json); cluster: "
          "the racks' NVLink domains as the configs place the trays (Slurm --segment); 'as written': the system "
          "file's nodes x GPUs with no domain given")
    print(f"  {'run':47}{'cluster':>19}{'config':>36}{'prec':>15}{'meas s':>9}{'pred s':>9}{'before':>8}"
          f"{'now':>8}{'DP exposed s':>16}{'as written':>17}{'mem GiB':>9}{'fits':>5}")
    for x in rep["rows"]:
        pct = lambda v: "" if v is None else f"{100 * v:+.1f}%"   # noqa: E731
        dpx = f"{x['before_dp_exposed_s']:.3f}>{x['dp_exposed_s']:.3f}" if x["before_dp_exposed_s"] is not None \
            else f"{x['dp_exposed_s']:.3f}"
        wr = f"{pct(x['before_written_error'])}>{pct(x['written_error'])}"
        print(f"  {x['id'][:47]:47}{x['cluster']:>19}{x['config']:>36}{x['precision']:>15}{x['measured_s']:>9.4g}"
              f"{x['predicted_s']:>9.4g}{pct(x['before_error']):>8}{pct(x['error']):>8}{dpx:>16}{wr:>17}"
              f"{x['memory_gib']:>9.1f}{'yes' if x['fits'] else 'NO':>5}")
    for x in rep["rows"]:
        if x["before_dropped"]:
            print(f"  before: {x['id']} priced without {', '.join('--' + d for d in x['before_dropped'])} "
                  "(9ebe16b refuses it)")
    if rep.get("forward_only"):
        print("  forward only (one-stage runs): the validation step (same graph: no backward, optimizer step, DP "
              "collectives or TP overlap) vs the priced forward without TP overlap; beyond 3 forwards = step - 3 x "
              "forward, measured vs priced (bench/data/mlperf_extract.py: measured.validation_step_s)")
        print(f"    {'run':47}{'step meas s':>12}{'fwd meas s':>12}{'fwd pred s':>12}{'fwd err':>9}"
              f"{'beyond 3F meas s':>18}{'pred s':>9}")
        for f in rep["forward_only"]:
            print(f"    {f['id'][:47]:47}{f['measured_step_s']:>12.4f}{f['measured_forward_s']:>12.4f}"
                  f"{f['predicted_forward_s']:>12.4f}{100 * f['forward_error']:>+8.1f}%"
                  f"{f['measured_beyond_3f_s']:>18.4f}{f['predicted_beyond_3f_s']:>9.4f}")
    for name, label in (("scale", "runs of 512 GPUs and more"), ("all", "all runs")):
        for key, what in (("before_error", "before"), ("error", "now"), ("before_written_error", "before, as written"),
                          ("written_error", "now, as written")):
            s = rep["summary"][name][key]
            if s["rows"]:
                print(f"  {label}, {what}: {s['rows']} rows, MAE {100 * s['mae']:.1f}%, median |error| "
                      f"{100 * s['median_abs']:.1f}%, max |error| {100 * s['max_abs']:.1f}% ({s['worst']})"
                      + (f"; every run fits: {'yes' if s['all_fit'] else 'NO'}" if key == "error" else ""))


def main(argv: list[str] | None = None) -> int:
    ap = AcesoParser(description=__doc__.splitlines()[0])
    ap.add_argument("--predictions", default=None, metavar="FILE",
                    help="write the code at hand's predictions (the 'before' file's format) to FILE and stop")
    args = ap.parse_args(argv)
    rows = load_rows()
    if not rows:
        print(f"no rows: {DATA} is absent")
        return 0
    if args.predictions:
        Path(args.predictions).write_text(json.dumps({"predictions": predictions(rows)}, indent=1) + "\n")
        print(f"wrote {args.predictions}")
        return 0
    rep = report()
    print_table(rep)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale_published.json").write_text(json.dumps(rep, indent=2) + "\n")
    print(f"\nwrote {out / 'scale_published.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
