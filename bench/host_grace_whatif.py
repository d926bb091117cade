"""What-if (not kept in the pricing): more host time per launch on Grace-hosted clusters, and TE's own per-expert
launch count, on every MoE row of both shared tables and every Nemotron-3 row (docs/costmodel.md, "Host time on
Grace: tried, not kept").

Each configuration is (``EXPERT_LAUNCHES`` E, a factor G on ``HOST_LAUNCH_MS`` for the rows on a Grace host, each
release group's ``HOST_LAUNCH_MS`` H). A row on a Grace host (GB200 / GB300 NVL72: ``GRACE``) is priced with its
group's H x G, any other with H; nothing else changes (the other per-release constants stay as fitted; dense rows
have no host term). ``CONFIGS`` holds the H that least ``release_fit.objective`` gives on each group's MoE fit rows
at that E and G (``--fit E,G`` scans it: a few minutes; ``--fit 6,1.25`` gives G 1.25's row of ``CONFIGS``).

Run: ``python bench/host_grace_whatif.py`` prints the gates and the per-row table (markdown) and writes
bench/results/host_grace_whatif.json.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import release_fit as rf  # noqa: E402
from search.costmodel import release_constants as rc  # noqa: E402
from search.io.argparser import AcesoParser  # noqa: E402
from search.layers import moe as moe_layer  # noqa: E402
from search.spec.cluster import parse_cluster  # noqa: E402

OUT = ROOT / "bench" / "results" / "host_grace_whatif.json"
# GB200 / GB300 NVL72: each compute tray is two Grace-Blackwell superchips, the GPUs' host a 72-core Grace (Arm
# Neoverse V2) over NVLink-C2C (the records' sources, search/data/gpus.json); DGX / HGX B200, B300, H100: x86 Xeon
GRACE = {"gb200", "gb300"}
NOW = {g: rc.FITS[g][1]["HOST_LAUNCH_MS"] for g in rc.FITS}
CONFIGS = {   # name: (E, G, H per group)
    "before": (6, 1.0, NOW),
    "G 2, H kept": (6, 2.0, NOW),
    "G 1.25": (6, 1.25, {"25.09": 0.03, "25.11": 0.05, "26.02.01": 0.05, "26.04.01": 0.04}),
    "G 2": (6, 2.0, {"25.09": 0.03, "25.11": 0.04, "26.02.01": 0.045, "26.04.01": 0.04}),
    "E 2": (2, 1.0, {"25.09": 0.06, "25.11": 0.1, "26.02.01": 0.09, "26.04.01": 0.08}),
    "E 2, G 1.5": (2, 1.5, {"25.09": 0.06, "25.11": 0.1, "26.02.01": 0.09, "26.04.01": 0.07}),
}
H_GRID = [0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.045, 0.05, 0.06, 0.07, 0.08, 0.09, 0.1, 0.12]
_HP = None


def _hybrid():
    global _HP
    if _HP is None:
        spec = importlib.util.spec_from_file_location("hybrid_published_whatif", ROOT / "bench" / "hybrid_published.py")
        _HP = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_HP)
    return _HP


def grace(cluster: str) -> bool:
    return parse_cluster(cluster).gpu.name in GRACE


def price(row: dict, e: int, g: float, h: dict, hybrid: bool = False) -> dict:
    """``row`` (a table row, or with ``hybrid`` a bench/hybrid_published.py row) priced under (E, G, H)."""
    group = rc.fit_of(row["version"])
    keep, keep_e = rc.FITS[group][1]["HOST_LAUNCH_MS"], moe_layer.EXPERT_LAUNCHES
    rc.FITS[group][1]["HOST_LAUNCH_MS"] = h[group] * (g if grace(row["cluster"]) else 1.0)
    moe_layer.EXPERT_LAUNCHES = e
    try:
        if hybrid:
            x = _hybrid().price_row(row)
            return {"status": x["status"], "error": x.get("error"), "fits": x.get("fits"), "kept_out": None}
        return rf.price(row)
    finally:
        rc.FITS[group][1]["HOST_LAUNCH_MS"] = keep
        moe_layer.EXPERT_LAUNCHES = keep_e


def fit(e: int, g: float) -> dict:
    """Each group's H of least ``release_fit.objective`` on its MoE fit rows at (E, G)."""
    out = {}
    for group in rc.FITS:
        rows = [r for r in rf.rows_of(group, rf.load()) if r["moe"] and not rf.kept_out(r)]
        best = None
        for v in H_GRID:
            errs = [p["error"] for p in (price(r, e, g, {group: v}) for r in rows) if p["status"] == "priced"]
            o = rf.objective(errs)
            if best is None or o < best[0] - 1e-9:
                best = (o, v)
        out[group] = best[1]
    return out


def run() -> dict:
    table = [r for r in rf.load() if r["moe"] and r.get("args")]
    hybrid = [r for r in _hybrid().load() if r["model"].startswith("nemotron-3")]
    rows = {}
    for name, (e, g, h) in CONFIGS.items():
        for r in table:
            p = price(r, e, g, h)
            if p["status"] == "priced":
                rows.setdefault(r["id"], {"kind": "moe", "kept_out": bool(p["kept_out"]), "grace": grace(r["cluster"]),
                                          "fits": True, "error": {}})
                rows[r["id"]]["error"][name] = p["error"]
                rows[r["id"]]["fits"] &= bool(p["fits"])
        for r in hybrid:
            p = price(r, e, g, h, hybrid=True)
            if p["status"] == "priced":
                rows.setdefault(r["id"], {"kind": "hybrid", "kept_out": False, "grace": grace(r["cluster"]),
                                          "fits": True, "error": {}})
                rows[r["id"]]["error"][name] = p["error"]
                rows[r["id"]]["fits"] &= bool(p["fits"])
    return rows


def gates(rows: dict, name: str) -> dict:
    def mae(sel):
        errs = [abs(r["error"][name]) for r in sel]
        return statistics.fmean(errs) if errs else None
    scored = [(k, r) for k, r in rows.items() if r["kind"] == "moe" and not r["kept_out"]]
    return {"moe_26": mae([r for k, r in scored if k.startswith("26")]),
            "moe_25": mae([r for k, r in scored if k.startswith("25")]),
            "nemotron3": mae([r for r in rows.values() if r["kind"] == "hybrid"]),
            "grace": rf.objective([r["error"][name] for r in rows.values() if r["grace"] and not r["kept_out"]]),
            "beyond_15": sorted(k for k, r in scored if k.startswith("26") and abs(r["error"][name]) > 0.15),
            "beyond_20": sorted(k for k, r in rows.items() if r["kind"] == "hybrid" and abs(r["error"][name]) > 0.2)}


def short(row_id: str) -> str:
    """``26.04.01/pretrain/qwen3-30b-a3b/b200x8/mxfp8/gbs512-mbs4-seq4096/tp1pp1cp1vp1ep8fsdp0`` as
    ``26.04.01 qwen3-30b-a3b b200x8 mxfp8 mbs4 tp1pp1vp1ep8``."""
    v, _, model, cluster, prec, batch, shape = row_id.split(" as ")[0].split("/")[:7]
    mbs = next(x for x in batch.split("-") if x.startswith("mbs"))
    return f"{v} {model} {cluster} {prec} {mbs} {shape.replace('cp1', '').replace('fsdp0', '')}"


def main(argv: list[str] | None = None) -> int:
    ap = AcesoParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", help="E,G: scan each group's HOST_LAUNCH_MS at these and print them")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    if args.fit:
        e, g = args.fit.split(",")
        print(fit(int(e), float(g)))
        return 0
    rows = run()
    names = list(CONFIGS)
    print("| config | E | G | H (25.09 / 25.11 / 26.02.01 / 26.04.01) | 26.x MoE MAE | 25.x MoE MAE | Nemotron-3 MAE | "
          "Grace rows' objective | 26.x beyond 15% | Nemotron-3 beyond 20% |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in names:
        e, g, h = CONFIGS[n]
        s = gates(rows, n)
        print(f"| {n} | {e} | {g} | {' / '.join(str(h[k]) for k in rc.FITS)} | {s['moe_26']:.1%} | {s['moe_25']:.1%} | "
              f"{s['nemotron3']:.1%} | {s['grace']:.1%} | {len(s['beyond_15'])} | {len(s['beyond_20'])} |")
    print("\n| row | host | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for k, r in rows.items():
        mark = " (kept out)" if r["kept_out"] else ""
        print(f"| {short(k)}{mark} | {'Grace' if r['grace'] else 'x86'} | " +
              " | ".join(f"{100 * r['error'][n]:+.1f}" for n in names) + " |")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"configs": {n: CONFIGS[n] for n in names}, "rows": rows,
                               "gates": {n: gates(rows, n) for n in names}}, indent=2) + "\n")
    print(f"\nwrote {OUT} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
