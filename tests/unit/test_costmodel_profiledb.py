"""Profile-database source: a synthetic DB written with the writer helper, read back and interpolated."""

from __future__ import annotations

import json

import numpy as np
import pytest

from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.costmodel.profiledb import ProfileDBWriter, fit_alpha_beta
from search.io.errors import AcesoError
from search.spec.model import ModelSpec
from search.spec.plan import ParallelPlan, StageSpec
from search.spec.training import TrainingSpec

MODEL = ModelSpec(name="tiny", family="gpt", num_layers=2, hidden_size=1024, num_attention_heads=16,
                  ffn_hidden_size=4096, seq_length=512, vocab_size=1024, params_dtype="fp16")
TRAIN = TrainingSpec(global_batch_size=16, precision="fp16")
CLUSTER = parse_cluster("1x4-v100")
MB = 2.0**20


def _variant(**changes) -> ModelSpec:
    return ModelSpec.model_validate({**MODEL.model_dump(), **changes})


def _unit_us(kind, batch, tp):
    """The synthetic 'measurement': affine in batch, so linear interpolation is exact."""
    base = 100.0 if kind == "attention" else 150.0
    return (20.0 + base * batch) / tp


def write_db(path, model=MODEL, gpu="v100", batches=(1, 4), tps=(1, 2)):
    w = ProfileDBWriter(model, gpu=gpu, dtype="fp16", hardware={"device_name": "Tesla V100-SXM2-32GB"})
    for tp in tps:
        for b in batches:
            for kind in ("attention", "mlp"):
                f = _unit_us(kind, b, tp)
                w.add_unit("decoder", kind, 512, b, tp, fwd_us=f, bwd_us=2 * f, recompute_us=(0, f / 4, f),
                           act_bytes=(1e6 * b / tp, 6e5 * b / tp, 2e5 * b), weight_bytes=4e6 / tp)
            w.add_part("embedding", 512, b, tp, fwd_us=10 * b, bwd_us=30 * b, act_bytes=1e5 * b, weight_bytes=2e6 / tp)
            w.add_part("head", 512, b, tp, fwd_us=50 * b, bwd_us=90 * b, act_bytes=5e6 * b / tp, weight_bytes=4e3)
    w.add_collective("all_reduce", 2, False, [(1e6, 30.0), (4e6, 90.0), (16e6, 330.0)])
    w.add_p2p(False, [(1e6, 100.0), (8e6, 800.0)])
    return w.save(path)


@pytest.fixture
def db(tmp_path):
    return write_db(tmp_path / "db.json")


def test_lookup_at_measured_and_interpolated_batches(db):
    cm = make_cost_model(MODEL, CLUSTER, TRAIN, kind="profile", db=str(db))
    t1 = cm.unit_table(1, 1)
    assert t1.fwd_ms[0] == pytest.approx(_unit_us("attention", 1, 1) / 1e3)
    assert t1.bwd_ms[1] == pytest.approx(2 * _unit_us("mlp", 1, 1) / 1e3)
    t2 = cm.unit_table(2, 1)                  # between the measured batches 1 and 4
    assert t2.fwd_ms[0] == pytest.approx(_unit_us("attention", 2, 1) / 1e3)
    assert t2.act_mb[0, 1] == pytest.approx(6e5 * 2 / MB)
    assert t2.recompute_ms[1, 2] == pytest.approx(_unit_us("mlp", 2, 1) / 1e3)
    assert t2.weight_params[0] == pytest.approx(4e6 / 2)       # fp16 bytes -> parameters
    assert cm.source.warnings == []


def test_extrapolation_warns_and_is_linear(db):
    cm = make_cost_model(MODEL, CLUSTER, TRAIN, kind="profile", db=str(db))
    t8 = cm.unit_table(8, 1)
    assert t8.fwd_ms[0] == pytest.approx(_unit_us("attention", 8, 1) / 1e3)
    assert any("outside the measured 1-4" in w for w in cm.source.warnings)
    t4 = cm.unit_table(4, 4)                  # tp 4 was not profiled: scaled from tp 2, with a warning
    assert t4.fwd_ms[0] == pytest.approx(_unit_us("attention", 4, 2) / 2 / 1e3)
    assert any("tp 4 was not profiled" in w for w in cm.source.warnings)


def test_collectives_interpolate_then_fit_alpha_beta(db):
    cm = make_cost_model(MODEL, CLUSTER, TRAIN, kind="profile", db=str(db))
    comm = cm.comm
    assert comm.all_reduce(2.5e6, 2) == pytest.approx(0.060)   # halfway between 30 and 90 us
    alpha, inv_beta = fit_alpha_beta(np.array([1e6, 4e6, 16e6]), np.array([0.030, 0.090, 0.330]))
    assert comm.all_reduce(64e6, 2) == pytest.approx(alpha + 64e6 * inv_beta)
    assert any("outside the measured" in w and "all_reduce" in w for w in cm.source.warnings)
    assert comm.all_reduce(4e6, 4) > 0                           # not profiled: analytic fallback, warned
    assert any("all_reduce on 4 GPUs intra-node was not profiled" in w for w in cm.source.warnings)
    assert comm.p2p(4e6) == pytest.approx(0.4)


def test_fit_alpha_beta_recovers_a_line():
    sizes = np.array([1e5, 1e6, 1e7])
    alpha, inv_beta = fit_alpha_beta(sizes, 0.02 + sizes / 10e6)
    assert alpha == pytest.approx(0.02) and inv_beta == pytest.approx(1 / 10e6)


def test_plan_times_are_the_sum_of_measured_units(db):
    cm = make_cost_model(MODEL, CLUSTER, TRAIN, kind="profile", db=str(db))
    plan = ParallelPlan(model=MODEL, cluster=CLUSTER, micro_batch_size=2, global_batch_size=16, stages=[
        StageSpec(num_gpus=4, tp=2, dp=2, start_unit=0, end_unit=4, recompute=["full"] * 4)])
    cost = cm.evaluate(plan)
    st = cost.stages[0]
    units = 2 * (_unit_us("attention", 1, 2) + _unit_us("mlp", 1, 2))
    assert st.fwd_ms == pytest.approx((units + 10 + 50) / 1e3)
    assert st.recompute_ms == pytest.approx(units / 1e3)
    assert cost.cost_model == "profile"


def test_wrong_model_or_gpu_is_refused(tmp_path):
    other = _variant(hidden_size=2048)
    p = write_db(tmp_path / "a.json", model=other)
    with pytest.raises(AcesoError, match="another model.*hidden_size 2048 vs 1024"):
        make_cost_model(MODEL, CLUSTER, TRAIN, kind="profile", db=str(p))
    p = write_db(tmp_path / "b.json", gpu="h100")
    with pytest.raises(AcesoError, match="profiled on gpu 'h100' but the cluster has 'v100'"):
        make_cost_model(MODEL, CLUSTER, TRAIN, kind="profile", db=str(p))
    deeper = _variant(num_layers=8)          # depth does not matter: units are per layer
    p = write_db(tmp_path / "c.json")
    assert make_cost_model(deeper, CLUSTER, TRAIN, kind="profile", db=str(p)).unit_table(1, 1).fwd_ms.shape == (16,)


def test_corrupt_or_missing_db_is_an_aceso_error(tmp_path, db):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(AcesoError, match="corrupt profile database"):
        make_cost_model(MODEL, CLUSTER, TRAIN, kind="profile", db=str(bad))
    raw = json.loads(db.read_text())
    del raw["units"][0]["fwd_us"]
    bad.write_text(json.dumps(raw))
    with pytest.raises(AcesoError, match=r"units\[0\] lacks fwd_us"):
        make_cost_model(MODEL, CLUSTER, TRAIN, kind="profile", db=str(bad))
    raw = json.loads(db.read_text())
    raw["version"] = 99
    bad.write_text(json.dumps(raw))
    with pytest.raises(AcesoError, match="version 99 is not supported"):
        make_cost_model(MODEL, CLUSTER, TRAIN, kind="profile", db=str(bad))
    with pytest.raises(AcesoError, match="no profile database"):
        make_cost_model(MODEL, CLUSTER, TRAIN, kind="profile", db=str(tmp_path / "nowhere"))
    with pytest.raises(AcesoError, match="needs --db"):
        make_cost_model(MODEL, CLUSTER, TRAIN, kind="profile")


def test_folder_holding_the_db_and_missing_sequence(tmp_path):
    write_db(tmp_path)                         # a folder: profile-db.json inside
    longer = _variant(seq_length=1024)
    cm = make_cost_model(longer, CLUSTER, TRAIN, kind="profile", db=str(tmp_path))
    with pytest.raises(AcesoError, match="no measurements for units decoder attention at seq 1024"):
        cm.unit_table(1, 1)


def test_measured_optimizer_step_replaces_the_analytic_one(tmp_path, db):
    plain = make_cost_model(MODEL, CLUSTER, TRAIN, kind="profile", db=str(db))
    raw = json.loads(db.read_text())
    raw["optimizer"] = {"us_per_param": 0.02, "clip_us_per_param": 0.005}   # what `aceso profile` writes
    measured_db = tmp_path / "with-opt.json"
    measured_db.write_text(json.dumps(raw))
    measured = make_cost_model(MODEL, CLUSTER, TRAIN, kind="profile", db=str(measured_db))
    rc = np.zeros(MODEL.num_units, dtype=np.int8)
    a = plain.stage_cost(0, 1, 0, 0, MODEL.num_units, 1, 1, rc, 1)
    b = measured.stage_cost(0, 1, 0, 0, MODEL.num_units, 1, 1, rc, 1)
    params = b.memory_breakdown["params"] * 2**20 / 2          # fp16 weights: 2 bytes per parameter
    assert b.optimizer_ms == pytest.approx(params * 0.025 / 1e3)
    assert a.optimizer_ms != pytest.approx(b.optimizer_ms)
