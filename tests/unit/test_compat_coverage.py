"""Aceso-compat on databases that do not hold every file: models that read another model's rows (T5-22B reads
T5-11B's, as the reference does) and partial (per-GPU batch, tp) coverage (the artifact's T5-11B has no
micro-batch 8). Each test works on a temporary copy of the shared miniset, with files renamed or deleted."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from search.cli import main
from search.spec.cluster import parse_cluster
from search.compat import AcesoDB
from search.compat import db as compat_db
from search.compat.costmodel import make_compat_cost_model
from search.io.errors import AcesoError
from search.planner.api import dropped_shapes, plan_baseline, search_space
from search.planner.baseline import best_uniform
from search.costmodel.types import Shape
from search.planner.space import Space
from search.planner.state import State
from search.spec.presets import load_model
from search.spec.training import TrainingSpec

SEARCH = ("--cluster", "1x4-v100", "--memory-limit-mb", "12000", "--global-batch-size", "64",
          "--cost-model", "aceso-compat", "--budget-evals", "150", "--workers", "1")


def _run(capsys, *argv):
    rc = main(list(map(str, argv)))
    out, err = capsys.readouterr()
    return rc, out, err


def _copy(reference_db, tmp_path, key: str, as_key: str | None = None, drop=(), name: str = "db") -> object:
    """The miniset's files of ``key`` (renamed to ``as_key``) and the p2p table, without the ``drop`` ones, in a
    new folder (a new path: the cost model caches a database by its folder)."""
    db = tmp_path / name
    db.mkdir()
    for f in (reference_db / "miniset").iterdir():
        if f.name.startswith("p2p") or f.name.startswith(key) or f.name.startswith(f"prim_{key}"):
            name = f.name.replace(key, as_key or key, 1)
            if not any(name.startswith(d) for d in drop):
                shutil.copy(f, db / name)
    return db


# ----- T5-22B reads T5-11B's rows ---------------------------------------------------------------------------------
def test_the_shared_profile_mapping_is_the_reference_one():
    assert compat_db.SHARED_PROFILES == {"t5_22B": "t5_11B"}


def test_t5_22b_searches_and_explains_with_only_t5_11b_files(reference_db, tmp_path, capsys):
    db = _copy(reference_db, tmp_path, "t5_770M", as_key="t5_11B")   # a database with only t5_11B files
    plan = tmp_path / "plan.json"
    rc, _, err = _run(capsys, "search", "--model", "t5-22b", "--num-layers", "4", *SEARCH, "--db", db, "-o", plan)
    assert rc == 0, err
    saved = json.loads(plan.read_text())
    assert saved["model"]["name"] == "t5-22b" and saved["predicted"]["cost_model"] == "aceso-compat"
    rc, out, err = _run(capsys, "explain", plan, "--cost-model", "aceso-compat", "--db", db, "--json")
    assert rc == 0, err
    assert json.loads(out)["iteration_time_ms"] == pytest.approx(saved["predicted"]["iteration_time_ms"], rel=1e-9)
    ref = tmp_path / "ref.json"
    assert _run(capsys, "export", plan, "--to", "aceso-legacy", "-o", ref)[0] == 0
    raw = json.loads(ref.read_text())    # the reference's own T5-22B dims (aceso_utils.t5_configs["22B"])
    assert (raw["model_name"], raw["model_size"]) == ("t5", "22B")
    assert [raw[k] for k in ("encoder_seq_length", "decoder_seq_length", "hidden_size", "ffn_hidden_size",
                             "num_attention_heads", "kv_channels")] == [2048, 512, 1024, 65536, 128, 128]
    rc, out, err = _run(capsys, "explain", ref, "--cost-model", "aceso-compat", "--db", db, "--cluster",
                        "1x4-v100", "--memory-limit-mb", "12000", "--json")
    assert rc == 0, err
    assert json.loads(out)["iteration_time_ms"] == pytest.approx(saved["predicted"]["iteration_time_ms"], rel=1e-6)


def test_t5_22b_rows_are_t5_11b_rows_and_the_full_depth_is_48_layers(reference_db, tmp_path):
    db = _copy(reference_db, tmp_path, "t5_770M", as_key="t5_11B")
    d22, d11 = AcesoDB(db, "t5_22B"), AcesoDB(db, "t5_11B")
    assert (d22.key, d22.profile_key) == ("t5_22B", "t5_11B")
    assert np.array_equal(d22.op("dec-MLP-GEMM-1", 2, 2), d11.op("dec-MLP-GEMM-1", 2, 2))
    model = load_model("t5-22b")
    assert (model.num_layers, model.num_decoder_layers) == (48, 48)
    cm = make_compat_cost_model(model, parse_cluster("1x4-v100"), TrainingSpec(global_batch_size=64), db)
    assert cm.layout.num_ops == 34 * 48 + 5


def test_a_missing_shared_profile_names_both_keys(reference_db, tmp_path):
    db = _copy(reference_db, tmp_path, "t5_770M")                       # no t5_11B files
    with pytest.raises(AcesoError, match=r"no op profiles for model t5_22B \(read as t5_11B"):
        AcesoDB(db, "t5_22B")


def test_the_mapping_is_data(reference_db, tmp_path, monkeypatch):
    db = _copy(reference_db, tmp_path, "gpt_1_3B", as_key="gpt_other")
    want = AcesoDB(reference_db / "miniset", "gpt_1_3B").op("enc-attention-qkv", 1, 1)
    monkeypatch.setitem(compat_db.SHARED_PROFILES, "gpt_1_3B", "gpt_other")   # a new entry reads renamed files
    assert np.array_equal(AcesoDB(db, "gpt_1_3B").op("enc-attention-qkv", 1, 1), want)


# ----- partial coverage -------------------------------------------------------------------------------------------
def test_search_uses_what_is_profiled_and_says_once_what_it_dropped(reference_db, tmp_path, capsys):
    db = _copy(reference_db, tmp_path, "t5_770M", drop=("t5_770M_mbs8_",))
    plan = tmp_path / "plan.json"
    rc, _, err = _run(capsys, "search", "--model", "t5-770m", "--num-layers", "4", *SEARCH, "--db", db, "-o", plan,
                      "--micro-batch-sizes", "1", "2", "4", "8")
    assert rc == 0, err
    notes = [line for line in err.splitlines() if "not profiled" in line]
    assert notes == ["aceso search: (per-GPU batch, tp) (8, 1), (8, 2), (8, 4) not profiled in the cost model's "
                     "database: plans use only the other 9 candidate shapes"]
    saved = json.loads(plan.read_text())
    assert all(saved["micro_batch_size"] // s["dp"] != 8 for s in saved["stages"])
    rc, out, err = _run(capsys, "baseline", "--model", "t5-770m", "--num-layers", "4", *SEARCH[:-4], "--db", db,
                        "--micro-batch-sizes", "4", "8", "--json")
    assert rc == 0, err   # per-rank (per-GPU) batch 8 is not profiled: the baseline keeps to 4
    assert json.loads(out)["micro_batch_per_rank"] == 4
    assert sum("not profiled" in line for line in err.splitlines()) == 1


def test_nothing_profiled_for_the_candidates_is_exit_2_one_line(reference_db, tmp_path, capsys):
    db = _copy(reference_db, tmp_path, "t5_770M", drop=tuple(f"t5_770M_mbs{m}_" for m in (1, 2, 4)))
    rc, out, err = _run(capsys, "search", "--model", "t5-770m", "--num-layers", "4", *SEARCH, "--db", db,
                        "--micro-batch-sizes", "1", "2", "4")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "none of the stage shapes they allow is covered" in lines[0]
    assert "covered: (8, 1), (8, 2), (8, 4)" in lines[0]


def test_explain_names_the_missing_row(reference_db, tmp_path, capsys):
    full = _copy(reference_db, tmp_path, "t5_770M")
    plan = tmp_path / "plan.json"
    rc, _, err = _run(capsys, "baseline", "--model", "t5-770m", "--num-layers", "4", *SEARCH[:-4], "--db", full,
                      "--micro-batch-sizes", "8", "-o", plan)
    assert rc == 0, err
    saved = json.loads(plan.read_text())
    batch, tp = saved["micro_batch_size"] // saved["stages"][0]["dp"], saved["stages"][0]["tp"]
    part = _copy(reference_db, tmp_path, "t5_770M", drop=(f"t5_770M_mbs{batch}_tp{tp}_",), name="part")
    rc, _, err = _run(capsys, "explain", plan, "--cost-model", "aceso-compat", "--db", part)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert f"no profile t5_770M_mbs{batch}_tp{tp}_algo0.csv" in lines[0]


def test_space_keeps_to_the_allowed_shapes():
    # per-rank (per-GPU) batch candidates 1 2 4; the pipeline micro-batch m runs m / dp per rank
    allowed = frozenset({(1, 1), (2, 1), (1, 2), (2, 2)})
    space = Space(num_gpus=4, gpus_per_node=4, tps=(1, 2, 4), batches=(1, 2, 4), num_units=4, allowed=allowed)
    assert space.allows(1, 2, 4) and not space.allows(1, 1, 4) and not space.allows(4, 1, 2)
    assert [(s.tp, s.dp) for s in space.shapes(2, 4)] == [(1, 2)]    # (2, 1) at 4: per-GPU batch 4, dropped
    assert [(s.tp, s.dp) for s in space.shapes(2, 2)] == [(1, 2), (2, 1)]
    assert space.legal(State(4, (Shape(2, 2),), (0, 4)))
    assert not space.legal(State(4, (Shape(1, 1), Shape(1, 1), Shape(2, 1)), (0, 1, 2, 4)))
    assert (4, 1) in space.candidate_shapes() and (4, 1) not in allowed
    free = Space(num_gpus=4, gpus_per_node=4, tps=(1, 2, 4), batches=(1, 2, 4), num_units=4)
    assert free.allows(4, 1, 4) and free.legal(State(4, (Shape(1, 1), Shape(1, 1), Shape(2, 1)), (0, 1, 2, 4)))


def test_baseline_and_search_space_never_price_an_unprofiled_shape(reference_db, tmp_path):
    db = _copy(reference_db, tmp_path, "t5_770M", drop=("t5_770M_mbs8_", "t5_770M_mbs4_tp1"))
    model = load_model("t5-770m", num_layers=4)
    training = TrainingSpec(global_batch_size=64)
    cm = make_compat_cost_model(model, parse_cluster("1x4-v100", memory_limit_mb=12000), training, db)
    space = search_space(cm, training)
    assert space.allowed == cm.available_shapes() and (4, 1) not in space.allowed
    assert dropped_shapes(space) == [(4, 1), (8, 1), (8, 2), (8, 4)]
    priced = []
    real = cm.stage_cost

    def spy(i, S, r, a, b, tp, dp, rc, mbs, **kw):
        priced.append((mbs // dp, tp))
        return real(i, S, r, a, b, tp, dp, rc, mbs, **kw)
    cm.stage_cost = spy
    res = best_uniform(cm, 64, space, model)
    assert res is not None and res.fits and priced and set(priced) <= space.allowed
    assert plan_baseline(cm, training).iteration_ms == res.iteration_ms
