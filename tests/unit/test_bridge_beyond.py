"""The Megatron-Bridge bench's rows beyond 15% (bench/bridge_published.py ``beyond``): each printed with the
published pairs it is in, read from the row's side, and the model's own micro-batch effect.

References: hand-made pairs for the orientation; the shared table's measured tokens/s (Qwen3-30B-A3B MXFP8 on 8
GB300: 28934 in 25.11 at micro-batch 4, 31744 in 26.04.01 at micro-batch 8, mb-performance-summary-archive.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.bench_modules import load

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT.parent / "shared" / "published" / "megatron-bridge-26.02-26.04.json"


def _bench():
    return load("bridge_published", "bridge_published_t")


def test_pairs_read_from_the_rows_side():
    bp = _bench()
    prs = [{"kind": "two runs", "a": "x", "b": "y", "diff": {"mbs": (8, 4)}, "measured": 1.25, "predicted": 1.5},
           {"kind": "two runs", "a": "z", "b": "x", "diff": {"pp": (16, 8)}, "measured": 0.8, "predicted": 0.8},
           {"kind": "two releases", "a": "x", "b": "x as 26.02", "diff": {"release": ("26.04", "26.02")},
            "measured": 1.1, "predicted": 1.0},
           {"kind": "two runs", "a": "y", "b": "z", "diff": {"tp": (1, 2)}, "measured": 1.0, "predicted": 1.0}]
    got = bp.pairs_of("x", prs)
    # x first in both two-run pairs, the release pair and the pair without x left out; worst ratio error first:
    # x / y 1.5 against 1.25 (+20%), x / z 1 / 0.8 = 1.25 against 1.25 (0%)
    assert [q["other"] for q in got] == ["y", "z"]
    assert got[0]["diff"] == {"mbs": (8, 4)} and got[0]["measured"] == 1.25 and got[0]["predicted"] == 1.5
    assert got[1]["diff"] == {"pp": (8, 16)}
    assert got[1]["measured"] == pytest.approx(1.25) and got[1]["predicted"] == pytest.approx(1.25)


@pytest.mark.skipif(not TABLE.exists(), reason="the shared Megatron-Bridge table is not at ../shared/published")
def test_qwen3_30b_gb300_is_listed_with_its_published_micro_batch_pair():
    bp = _bench()
    rf = bp.rf
    rows = [r for r in rf.load() if r["id"].startswith(("26.04.01/pretrain/qwen3-30b-a3b/gb300x8/",
                                                          "25.11/pretrain/qwen3-30b-a3b/gb300x8/"))]
    assert len(rows) == 2
    priced = [rf.price(r) for r in rows]
    for p in priced:          # the 26.04.01 row taken as beyond 15% (+20%, as before the joint fit of issue 34),
        if p["id"].startswith("26.04.01/"):     # whatever the constants give it now: what ``beyond`` prints is tested
            p["error"] = 0.20
    by_id = {r["id"]: r for r in rows}
    out = bp.beyond(priced, bp.pairs(rows, priced, by_id), by_id)
    (b,) = out
    assert b["id"].startswith("26.04.01/") and b["mbs"] == 8
    (q,) = b["pairs"]
    assert q["other"].startswith("25.11/") and q["diff"]["mbs"] == (8, 4)
    assert q["measured"] == pytest.approx(31744 / 28934)          # the table's own numbers
    assert 0.0 <= b["host_share"] < 1.0 and b["half_mbs_gain"] > 1.0


def _row(rid: str, kind: str, error: float) -> dict:
    return {"id": rid, "version": "26.04.01", "kind": kind, "status": "priced", "error": error, "kept_out": "",
            "fits": True}


def test_gpt_rows_answer_to_15_and_nemotron_rows_to_20():
    """Issue 34 bounds its GPT MoE and dense rows at 15% and hands the Nemotron-3 (hybrid) rows to issue 36, whose
    bound is 20% (bench/hybrid_published.TARGETS): a hybrid row at 18% passes, at 25% fails under issue 36; a MoE
    row at 16% fails under issue 34. Nothing beyond its bound is passed."""
    bp = _bench()
    priced = [_row("moe-16", "moe", -0.16), _row("dense-10", "dense", 0.10), _row("hyb-18", "hybrid", 0.18),
              _row("hyb-25", "hybrid", 0.25)]
    s = {"rows": 1, "mae": 0.05, "max_abs": 0.1, "worst": "x", "all_fit": True}
    g = {k: {"scored": s, "all": s} for k in ("26_moe", "26_dense", "25_moe", "25_dense")}
    lines = bp._targets(priced, g)
    (g34,) = [t for t in lines if "issue 34)" in t]
    (g36,) = [t for t in lines if "issue 36" in t]
    assert g34.startswith("FAIL") and "(1: moe-16)" in g34
    assert g36.startswith("FAIL") and "(1: hyb-25)" in g36 and "hyb-18" not in g36
    rows = {p["id"]: {**p, "mbs": 1} for p in priced}
    out = bp.beyond([p for p in priced if p["kind"] == "hybrid"], [], rows)
    assert [(b["id"], b["issue"], b["bound"]) for b in out] == [("hyb-25", 36, 0.20)]
    priced[3]["error"] = 0.19
    assert bp._targets(priced, g)[4].startswith("PASS") and "(0: )" in bp._targets(priced, g)[4]
