"""`aceso export` / `aceso import` and the database reader's errors: exit 2 with one line, nothing written."""

from __future__ import annotations

import json
import shutil

import pytest

from search.cli import main
from search.compat import AcesoDB
from search.io.errors import AcesoError
from search.spec.plan import ParallelPlan, StageSpec
from search.spec.presets import load_model


def _run(capsys, *argv):
    rc = main(list(map(str, argv)))
    out, err = capsys.readouterr()
    return rc, out, err


def _one_error_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err, err
    return lines[0]


def test_import_mid_unit_without_snap_is_exit_2_one_line(reference_db, tmp_path, capsys):
    cfg = reference_db / "configs" / "gpt_1_3B_4gpus_reference_search.json"
    out = tmp_path / "plan.json"
    rc, _, err = _run(capsys, "import", cfg, "-o", out)
    assert rc == 2 and "stage 0 ends inside unit 11" in _one_error_line(err)
    assert not out.exists()
    rc, _, err = _run(capsys, "import", cfg, "-o", out, "--snap")
    assert rc == 0 and "moved from op 78 to op 79" in err
    plan = ParallelPlan.model_validate_json(out.read_text())
    assert [s.start_unit for s in plan.stages] == [0, 12, 24, 37]


def test_export_then_import_round_trip_through_the_cli(tmp_path, capsys):
    model = load_model("t5-770m", num_layers=2)
    plan = ParallelPlan(model=model, micro_batch_size=2, global_batch_size=32, stages=[
        StageSpec(num_gpus=2, tp=2, dp=1, start_unit=0, end_unit=4, recompute=["full", "selective", "none", "full"]),
        StageSpec(num_gpus=2, tp=1, dp=2, start_unit=4, end_unit=10, recompute=["selective"] * 6)])
    src, ref, back = tmp_path / "plan.json", tmp_path / "ref.json", tmp_path / "back.json"
    src.write_text(plan.to_json())
    assert _run(capsys, "export", src, "--to", "aceso-legacy", "-o", ref)[0] == 0
    raw = json.loads(ref.read_text())
    assert raw["num_ops_in_each_stage"] == [1 + 2 * 13 + 1, 1 + 2 * 21 + 2] and raw["model_size"] == "770M"
    assert _run(capsys, "import", ref, "-o", back)[0] == 0
    assert ParallelPlan.model_validate_json(back.read_text()) == plan


def test_import_with_db_adds_the_compat_prediction(reference_db, tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc, _, err = _run(capsys, "import", reference_db / "configs" / "uniform_tp2_2stages.json", "-o", out,
                      "--db", reference_db / "miniset")
    assert rc == 0
    pred = json.loads(out.read_text())["predicted"]
    assert pred["cost_model"] == "aceso-compat"
    assert pred["iteration_time_ms"] == pytest.approx(120022.69, rel=1e-3)   # the golden value: nothing changed


def _copy_db(reference_db, tmp_path, key="gpt_1_3B"):
    db = tmp_path / "db"
    db.mkdir()
    for f in (reference_db / "miniset").iterdir():
        if f.name.startswith(key) or f.name.startswith(f"prim_{key}") or f.name.startswith("p2p"):
            shutil.copy(f, db / f.name)
    return db


@pytest.mark.parametrize("damage", ["corrupt_value", "bad_header", "missing_p2p", "other_model"])
def test_bad_database_is_exit_2_one_line(damage, reference_db, tmp_path, capsys):
    db = _copy_db(reference_db, tmp_path, key="t5_770M" if damage == "other_model" else "gpt_1_3B")
    target = db / "gpt_1_3B_mbs2_tp2_algo0.csv"
    if damage == "corrupt_value":
        target.write_text(target.read_text().replace("enc-MLP-gelu,", "enc-MLP-gelu,abc", 1))
    elif damage == "bad_header":
        lines = target.read_text().splitlines()
        target.write_text("\n".join(["name,fwd"] + lines[1:]) + "\n")
    elif damage == "missing_p2p":
        (db / "p2p_intra_node.csv").unlink()
    out = tmp_path / "plan.json"
    rc, _, err = _run(capsys, "import", reference_db / "configs" / "uniform_tp2_2stages.json", "-o", out,
                      "--db", db)
    line = _one_error_line(err)
    assert rc == 2 and not out.exists()
    want = {"corrupt_value": "line", "bad_header": "header", "missing_p2p": "p2p_intra_node.csv",
            "other_model": "no op profiles for model gpt_1_3B (the database holds: t5_770M)"}[damage]
    assert want in line


def test_database_reader_errors(reference_db, tmp_path):
    with pytest.raises(AcesoError, match="no such folder"):
        AcesoDB(tmp_path / "nope", "gpt_1_3B")
    db = AcesoDB(reference_db / "miniset", "gpt_1_3B")
    assert db.mbs_list == [1, 2, 4, 8] and db.tp_list == [1, 2, 4]
    assert db.op("enc-attention-qkv", 1, 1)[0] == pytest.approx(659.752)   # the CSV's forward-compute
    assert db.collective_ms("all_gather", 2, 8.0) == pytest.approx(1.412)
    assert db.collective_ms("all_gather", 2, 9.0) == pytest.approx(1.412)   # size-1 fallback
    assert db.collective_ms("all_gather", 2, 5000.0) == 100000.0           # the reference's veto
