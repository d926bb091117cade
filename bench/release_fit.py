"""The per-release calibration (``search/costmodel/release_constants.py``): every published Megatron-Bridge row of
both shared tables priced as its own release, and the fit of each release's constants on its rows.

Rows: the MoE rows (``bench/moe_published.py``'s row path) and the dense low-precision rows
(``bench/lowprec_published.py``'s) of ``../shared/published/megatron-bridge-25.09-25.11.json`` and
``-26.02-26.04.json``; Nemotron-3 (hybrid Mamba) rows have no Megatron-LM GPT arguments: bench/hybrid_published.py's
reader prices them (kind ``hybrid``, never in a fit) where the presets hold the model (Nano; Super is listed). Each row is
imported from its own arguments with ``release`` = its container, so it is priced with its release's constants.
Rows kept out of a fit (``KEPT_OUT``) each carry their published evidence; every row is still priced and reported.

``fit(group)`` is a coordinate descent of least ``objective`` (the mean absolute error plus ``BEYOND_WEIGHT`` x the
mean excess of |error| over 15%: issue 34's two targets) over the group's rows that are not kept out: each constant in ``GRID`` order scanned on its grid with the others fixed, twice; a constant is fitted only where
the group has at least ``MIN_ROWS`` rows it prices (NVFP4 rows, attention sinks,
low-precision GEMMs of a GPU generation), else it keeps the nearest release's value (``release_constants``). ``python
bench/published_runs.py --fit-release GROUP`` runs it and prints the values with their row counts; the values are
then written into ``release_constants.FITS`` by hand (a fit never edits the source).
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from search.costmodel import release_constants as rc  # noqa: E402
from lowprec_published import KEPT_OUT as LOWPREC_KEPT_OUT  # noqa: E402  (the dense low-precision bench's list)

PUBLISHED = ROOT.parent / "shared" / "published"
FILES = ("megatron-bridge-25.09-25.11.json", "megatron-bridge-26.02-26.04.json")

# Rows kept out of the fits and the targets, each with its published evidence (every row is still priced and
# reported). The Bridge tables' own ``suspect`` notes (rows no Megatron-Bridge recipe of any release configures) are
# kept out with that note (``kept_out``); these are the others.
KEPT_OUT = {
    "25.11/pretrain/qwen3-30b-a3b/h100x16/fp8-cs/gbs512-mbs2-seq4096/tp1pp2cp1vp24ep8fsdp0": (
        "the dropless run is 1.99x slower than its drop-and-pad twin of the same command line (25.09), and no "
        "setting in the file tells them apart; the H100 FP8-CS recipes of both releases set vp 12 and the EP "
        "overlap, not the table's vp 24 (docs/costmodel.md, MoE calibration)"),
    "25.11/pretrain/gpt-oss-120b/b200x64/": (
        "Megatron-Bridge's GPT-OSS-120B performance config of the period (scripts/performance/configs/gpt_oss/"
        "workload_base_configs.py at cb62f8620, 2025-11-21; v0.2.0's workload_base_configs.py) runs B200 at ep 64, "
        "not the table's ep 8, with recompute of layernorm and moe_act, which the table's row has none of"),
    "25.11/pretrain/gpt-oss-120b/h100x64/": (
        "the table's own check fails (published GA 2 != GBS/(MBS x DP) = 8), and Megatron-Bridge's H100 recipe of the "
        "period runs mbs 1, not the table's 4 (cb62f8620 workload_base_configs.py); at mbs 4 no dp of the row fits"),
}


KEPT_OUT.update(LOWPREC_KEPT_OUT)
KEPT_OUT.update({
    "25.09/pretrain/qwen3-235b-a22b-token_drop1/h100x256/fp8-cs/": (
        "its EP-overlap flags come from a later release's recipe (Megatron-Bridge v0.5.1; 25.09 ships 0.1.0rc3), and "
        "the table's own twin says they did not run: the 25.11 run of the same model, cluster and shape with its own "
        "release's recipe (v0.2.0 QWEN3_235B_A22B_H100_FP8_CS_BASE_CONFIG: moe_a2a_overlap=True) measured 1575 "
        "tok/s/GPU against this row's 1204 (1.31x); priced with the overlap this row comes out where its twin is"),
    "26.02.01/pretrain/qwen3-235b-a22b/b300x256/": (
        "the same model on 256 B200 in the same release (the 26.04.01 B200 row, pp 8, ep 8, mbs 1, whose 26.02 "
        "measurement the table also publishes: 3805 tok/s/GPU, mb-performance-summary-archive.md:539) ran 1.44x "
        "this B300 row's 2644 (2691 in 26.02); B300 has B200's NVLink and tensor cores with more memory and "
        "twice the network, so no term of a cost model makes it 30% slower; its next recipe (26.04: pp 8 ep 8 mbs 2, "
        "no EP overlap, no virtual stages) measured 4865-5936"),
    "26.02/pretrain/gpt-oss-120b/b300x64/": (
        "its B200 twin in the same release (same recipe family, ep 64 over 8 nodes) measured 8047 tok/s/GPU against "
        "this row's 8359 (+3.9%), while the model, for which this run is all-to-all-bound over the network (ep 64 on "
        "8 nodes), prices B300's 800 Gb/s ConnectX-8 at twice B200's 400 Gb/s: the measurement shows the B300 "
        "system's network did not deliver that for this all-to-all, which is the network model's question "
        "(search/spec/cluster.py presets, the dp-scale work); the B200 twin is priced within 10%"),
    "26.02.01/pretrain/qwen3-30b-a3b/h100x16/fp8-cs/gbs1024-mbs1-seq4096/tp1pp2cp1vp12ep8fsdp0 as 26.02": (
        "the table publishes this configuration at 5112 tok/s/GPU in 26.02 and 9058 in 26.02.01 (1.77x), and the two "
        "containers ship the same megatron-core 0.16.0 and transformer-engine 2.12 (only Megatron-Bridge 0.3.0 -> "
        "0.3.1): the command line is 26.02.01's recipe (its EP overlap and delayed weight gradients), so the 26.02 "
        "run did not run what it says; the 26.02.01 row counts"),
})


def kept_out(row: dict) -> str | None:
    """Why a row is kept out of the fits and the targets (None: it counts)."""
    if row.get("suspect"):
        return f"the table's own note: {row['suspect']}"
    return next((why for prefix, why in KEPT_OUT.items() if row["id"].startswith(prefix)), None)


def load(files=FILES) -> list[dict]:
    """Every pretraining row of the shared tables."""
    out = []
    for name in files:
        path = PUBLISHED / name
        if path.exists():
            out += [r for r in json.loads(path.read_text())["rows"] if r["kind"] == "pretrain"]
    return out


def _benches():
    import importlib.util
    mods = []
    for name in ("moe_published", "lowprec_published"):
        spec = importlib.util.spec_from_file_location(f"{name}_release_fit", ROOT / "bench" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mods.append(mod)
    return mods


MP, LP = None, None


HP = None


def _hybrid(row: dict) -> dict | None:
    """A Nemotron (hybrid Mamba) row, which has no Megatron-LM GPT line, priced by bench/hybrid_published.py's row
    reader (its settings, each sourced, in bench/data/nemotron3_published.json), kind ``hybrid``; None: not one of
    its rows, or a model the presets cannot hold yet (Nemotron-3 Super: LatentMoE), listed as before."""
    global HP
    if HP is None:
        import importlib.util
        spec = importlib.util.spec_from_file_location("hybrid_published_release_fit",
                                                      ROOT / "bench" / "hybrid_published.py")
        HP = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(HP)
    r = next((r for r in HP.load() if r["id"] == row["id"]), None)      # as the release and measurement asked
    x = HP.price_row({**r, "version": row["version"], "measured": row["tokens_per_s_per_gpu"]}) if r else None
    if x is None or x["status"] != "priced":
        return None
    return {"kind": "hybrid", "status": "priced", "predicted": x["predicted"], "error": x["error"], "fits": x["fits"],
            "memory_gib": x["memory_gib"], "limit_gib": x["limit_gib"]}


def price(row: dict) -> dict:
    """The row priced as its own release: {id, version, model, cluster, precision, kind, measured, predicted,
    error, fits, memory_gib, limit_gib, status}."""
    global MP, LP
    if MP is None:
        MP, LP = _benches()
    base = {"id": row["id"], "version": row["version"], "model": row["model"], "cluster": row["cluster"],
            "precision": row["precision"], "kind": "moe" if row["moe"] else "dense",
            "measured": row["tokens_per_s_per_gpu"], "kept_out": kept_out(row)}
    if not row.get("args"):
        hybrid = _hybrid(row)
        if hybrid is not None:
            return {**base, **hybrid}
        return {**base, "status": "no arguments: " + (row.get("why_not") or "")}
    if row["moe"]:
        x = MP.price_row(row)
        if x["status"] != "priced":
            return {**base, "status": x["status"]}
        return {**base, "status": "priced", "predicted": x["tokens"], "error": x["error"], "fits": x["fits"],
                "memory_gib": x["max_memory_gib"], "limit_gib": x["limit_gib"]}
    x = LP.price_row(row)
    return {**base, "status": "priced", "predicted": x["predicted_tokens_per_gpu"], "error": x["error"],
            "fits": x["fits"], "memory_gib": x["memory_gib"], "limit_gib": x["memory_limit_gib"]}


def rows_of(group: str, rows: list[dict]) -> list[dict]:
    """The group's published rows: its own, and the measurements of the group's releases the tables publish for a
    later row's configuration (``also_published``: that row's arguments, the older release's tokens/s; id
    "<row> as <release>")."""
    own = [r for r in rows if rc.fit_of(r["version"]) == group and r.get("args")]
    return own + [as_release(r, old) for r in rows if r.get("args") for old in r.get("also_published") or []
                  if old.get("tokens_per_s_per_gpu") and old["version"] in rc.FITS[group][0]]


def as_release(row: dict, old: dict) -> dict:
    """``row``'s configuration as published by an older release (an ``also_published`` entry)."""
    return {**row, "id": f"{row['id']} as {old['version']}", "version": old["version"],
            "tokens_per_s_per_gpu": old["tokens_per_s_per_gpu"], "also_published": []}


BEYOND = 0.15         # issue 34's bound on every row's |error| (bench/bridge_published.TARGETS["max"])
BEYOND_WEIGHT = 3.0   # the fit's price of one point of |error| beyond BEYOND, in points of MAE (``objective``)


def objective(errors: list[float]) -> float:
    """What the fit minimizes over a constant's rows: the mean |error| plus ``BEYOND_WEIGHT`` x the mean excess of
    |error| over ``BEYOND`` (issue 34 asks both: the MAE and no row beyond 15%). Least MAE alone traded a few rows
    past 15% for a tenth of a point of MAE (26.04.01: MAE 6.7% with the Qwen3-30B micro-batch-8 rows at +20/+19%
    and DeepSeek-V3 pp 16 at -15%, against 6.9% with none beyond)."""
    errs = [abs(e) for e in errors]
    if not errs:
        return 0.0
    return statistics.fmean(errs) + BEYOND_WEIGHT * statistics.fmean(max(0.0, e - BEYOND) for e in errs)


def _mae(rows: list[dict]) -> float:
    """``objective`` of the rows' errors, each priced as its own release (the name is the fit's history)."""
    return objective([p["error"] for p in map(price, rows) if p["status"] == "priced" and p.get("error") is not None])


MIN_ROWS = 4      # a constant is fitted on at least this many of the group's rows, else taken from the nearest fit
# HybridEP's NVLink rate is not fitted: its own benchmark at the SM count of the release (16 SMs through megatron-core
# 0.16, HybridEP's default 32 from 0.17: ``release_constants.SOURCED``)

GRID = {
    "HOST_LAUNCH_MS": [0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.06, 0.08],
    "GROUPED_K0_LP": [0.0, 250.0, 500.0, 750.0, 1000.0, 1250.0, 1500.0, 2000.0, 3000.0, 4000.0, 6000.0, 8000.0],
    "LOWPREC_GEMM_SCALE.hopper": [round(0.6 + 0.04 * i, 2) for i in range(16)],
    "LOWPREC_GEMM_SCALE.blackwell": [round(0.6 + 0.04 * i, 2) for i in range(16)],
    "NVFP4_GEMM_SCALE": [round(0.4 + 0.05 * i, 2) for i in range(17)],
}
# The MoE constants that price the same rows and trade against each other (the host-bound wait, the quantized
# grouped GEMM's per-tile cost): scanned together on this grid, every MoE row of the group at once,
# before the coordinate descent of the others; one at a time, the descent stopped where one constant's rows alone
# asked (26.04.01: at four rows beyond 15%, where the joint scan finds none)
JOINT_GRID = {
    "HOST_LAUNCH_MS": [0.03, 0.035, 0.04, 0.045, 0.05],
    "GROUPED_K0_LP": [0.0, 500.0, 1000.0, 1250.0, 1500.0, 2000.0, 3000.0, 6000.0],
}
# Fitted on every release's rows together (``release_constants.POOLED``): too few rows in any one release
POOLED_GRID = {
    "SINK_ATTN_SCALE.hopper": [0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.85, 1.0],
    "SINK_ATTN_SCALE.blackwell": [0.1, 0.12, 0.14, 0.16, 0.18, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.7, 1.0],
}


def applies(name: str, rows: list[dict]) -> list[dict]:
    """The rows a constant prices (the fit scans it on these only: the others do not move)."""
    from search.spec.cluster import parse_cluster
    from search.costmodel.kernels import GENERATION

    def gen(r):
        return GENERATION.get(parse_cluster(r["cluster"]).gpu.name, "")
    if name == "HOST_LAUNCH_MS":
        return [r for r in rows if r["moe"]]
    if name == "GROUPED_K0_LP":
        return [r for r in rows if r["moe"] and r["precision"] != "bf16"]
    if name.startswith("LOWPREC_GEMM_SCALE."):     # the dense rows: their linears are what it prices
        return [r for r in rows if not r["moe"] and r["precision"] != "bf16" and gen(r) == name.split(".")[1]]
    if name == "NVFP4_GEMM_SCALE":
        return [r for r in rows if r["precision"] == "nvfp4"]
    if name.startswith("SINK_ATTN_SCALE."):
        return [r for r in rows if "--softmax-type learnable" in (r["args"] or "") and gen(r) == name.split(".")[1]]
    return rows


def _get(consts: dict, name: str):
    head, _, sub = name.partition(".")
    return consts[head][sub] if sub else consts[head]


def _set(consts: dict, name: str, v) -> None:
    head, _, sub = name.partition(".")
    if sub:
        consts[head] = {**consts[head], sub: v}
    else:
        consts[head] = v


def fit_pooled(verbose: bool = True) -> tuple[dict, dict]:
    """``POOLED_GRID``'s constants on every release's rows not kept out (least ``objective``, one pass each); restores
    ``release_constants.POOLED``."""
    rows = [r for g in rc.FITS for r in rows_of(g, load()) if not kept_out(r)]
    keep = json.loads(json.dumps(rc.POOLED))
    out, counts = {}, {}
    try:
        for name, grid in POOLED_GRID.items():
            head, _, sub = name.partition(".")
            mine = applies(name, rows)
            if len(mine) < MIN_ROWS:
                continue
            best = None
            for v in grid:
                vals = {**rc.POOLED.get(head, ({}, {}))[0], sub: v}
                rc.POOLED[head] = (vals, rc.POOLED.get(head, ({}, {}))[1])
                m = _mae(mine)
                if best is None or m < best[0] - 1e-9:
                    best = (m, v)
            rc.POOLED[head] = ({**rc.POOLED[head][0], sub: best[1]}, rc.POOLED[head][1])
            out.setdefault(head, {})[sub] = best[1]
            counts.setdefault(head, {})[sub] = len(mine)
            if verbose:
                print(f"  pooled {name} = {best[1]} (MAE {100 * best[0]:.1f}% on the {len(mine)} rows it prices)",
                      flush=True)
    finally:
        rc.POOLED.clear()
        rc.POOLED.update(keep)
    return out, counts


def fit(group: str, passes: int = 2, verbose: bool = True) -> tuple[dict, dict]:
    """(the fitted values, the rows each was fitted on) of ``group`` (module docstring); restores FITS."""
    all_rows = [r for r in rows_of(group, load()) if not kept_out(r)]
    consts = rc.FITS[group][1]
    keep = json.loads(json.dumps(consts))
    for name in GRID:             # start from the values in use (the nearest fit's, or the base)
        head = name.split(".")[0]
        if head not in consts:
            consts[head] = json.loads(json.dumps(rc.value(head, group)))
    counts = {}

    def fitted(name):
        return len(applies(name, all_rows)) >= MIN_ROWS
    try:
        joint = [n for n in JOINT_GRID if fitted(n)]
        if joint:                # the MoE constants together (``JOINT_GRID``), on every MoE row of the group
            mine = [r for r in all_rows if any(r in applies(n, all_rows) for n in joint)]
            best = None
            for vals in itertools.product(*(JOINT_GRID[n] for n in joint)):
                for n, v in zip(joint, vals):
                    _set(consts, n, v)
                m = _mae(mine)
                if best is None or m < best[0] - 1e-9:
                    best = (m, vals)
            for n, v in zip(joint, best[1]):
                _set(consts, n, v)
                counts[n] = len(applies(n, all_rows))
            if verbose:
                print(f"  {group} {', '.join(f'{n} = {v}' for n, v in zip(joint, best[1]))} (jointly; objective "
                      f"{100 * best[0]:.1f}% on the {len(mine)} MoE rows, of {len(all_rows)})", flush=True)
        for _ in range(passes):
            for name, grid in GRID.items():
                mine = applies(name, all_rows)
                if name in JOINT_GRID or not fitted(name):
                    continue
                counts[name] = len(mine)
                best = None
                for v in grid:
                    _set(consts, name, v)
                    m = _mae(mine)
                    if best is None or m < best[0] - 1e-9:
                        best = (m, v)
                _set(consts, name, best[1])
                if verbose:
                    print(f"  {group} {name} = {best[1]} (objective {100 * best[0]:.1f}% on the "
                          f"{len(mine)} rows it prices, of {len(all_rows)})", flush=True)
        out = {}
        for c in counts:                         # only what was fitted (a per-generation one: its fitted keys)
            head, _, sub = c.partition(".")
            if sub:
                out.setdefault(head, {})[sub] = consts[head][sub]
            else:
                out[head] = consts[head]
    finally:
        rc.FITS[group][1].clear()
        rc.FITS[group][1].update(keep)
    return out, counts
