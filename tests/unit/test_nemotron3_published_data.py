"""``bench/data/nemotron3_published.json``: the 13 Nemotron-3 rows of the shared Megatron-Bridge file made explicit, and
the Nemotron-H rows of dgxc-benchmarking. Checked against the shared file (every row, its columns unchanged), against
themselves (the resolved settings agree with the table: degrees, batch, data-parallel size, accumulation) and, for
the dgxc rows, against the README's own arithmetic (tokens/s and MFU from the step time)."""

import json

import pytest

from tests.conftest import ROOT

DATA = ROOT / "bench" / "data" / "nemotron3_published.json"
SHARED = ROOT.parent / "shared" / "published" / "megatron-bridge-26.02-26.04.json"


@pytest.fixture(scope="module")
def data():
    return json.loads(DATA.read_text())


@pytest.fixture(scope="module")
def shared():
    if not SHARED.exists():
        pytest.skip(f"shared published rows not found at {SHARED} (they live in ../shared beside the repo)")
    return [r for r in json.loads(SHARED.read_text())["rows"] if r["model"].startswith("nemotron-3")]


def test_every_shared_nemotron3_row_once_with_its_columns(data, shared):
    ours = {r["id"]: r for r in data["rows"]}
    assert sorted(ours) == sorted(r["id"] for r in shared) and len(shared) == 13
    for row in shared:
        table = ours[row["id"]]["table"]
        assert {k: row[k] for k in table} == table, row["id"]


def test_settings_agree_with_the_table(data):
    for row in data["rows"]:
        s, t = row["settings"], row["table"]
        for key in ("tp", "pp", "cp", "ep", "mbs", "gbs"):
            assert s[key] == t[key], (row["id"], key)
        assert s["seq_length"] == t["seq"] and s["num_gpus"] == t["gpus"] and s["vp"] == t["vp"]
        assert s["dp"] * s["tp"] * s["pp"] * s["cp"] == t["gpus"]
        assert s["ga"] * s["mbs"] * s["dp"] == s["gbs"]
        assert s["sequence_parallel"] == (s["tp"] > 1)
        assert t["gpus"] % (s["ep"] * s["etp"] * s["pp"]) == 0     # megatron-core's expert grid fills the world
        assert (s["mtp"] is not None) == (row["model"] == "nemotron-3-super")
        assert (s["recompute"]["granularity"] == "selective") == bool(s["recompute"]["modules"])


def test_every_source_is_a_reference(data):
    refs = set(data["references"])
    for row in data["rows"] + data["nemotron_h_rows"]:
        for key, where in row["sources"].items():
            assert {w.strip() for w in where.split(",")} <= refs, (row["id"], key, where)
        assert (ROOT / row["arch"]).exists()


def test_dgxc_nemotron_h_rows_are_consistent(data):
    """tokens/s = seq x GBS / step time; MFU = GBS x 2.816e15 / step / GPUs / 1979 TFLOP/s (the README's formula)."""
    rows = data["nemotron_h_rows"]
    assert [r["gpus"] for r in rows] == [32, 64, 128, 256, 512, 1024, 2048]
    for row in rows:
        s, m = row["settings"], row["measured"]
        assert s["tp"] * s["dp"] == row["gpus"] and s["gbs"] == 3 * row["gpus"]
        assert abs(8192 * s["gbs"] / m["step_time_s"] / m["tokens_per_s"] - 1) < 1e-5
        mfu = s["gbs"] * m["mfu_flops_per_sample"] / m["step_time_s"] / row["gpus"] / (m["mfu_peak_tflops"] * 1e12)
        assert abs(mfu / m["mfu"] - 1) < 1e-3
