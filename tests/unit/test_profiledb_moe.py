"""The profile cost model prices MoE plans from a database's moe rows (search/costmodel/profiledb_moe.py): a
hand-written database of a tiny MoE model, read back and checked against the numbers written into it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.costmodel.profiledb import ProfileDBWriter
from search.io.errors import AcesoError
from search.spec.model import ModelSpec
from search.layers.moe_spec import MLASpec, MoESpec
from search.settings.moe_plan import MoEPlanSettings
from search.spec.training import TrainingSpec

MODEL = ModelSpec(name="tiny-moe", family="llama", num_layers=2, hidden_size=32, num_attention_heads=4,
                  num_query_groups=2, ffn_hidden_size=48, seq_length=16, vocab_size=128, activation="swiglu",
                  normalization="rmsnorm", position_embedding="rope", tied_embeddings=False, add_bias_linear=False,
                  params_dtype="fp32", moe=MoESpec(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32))
TRAIN = TrainingSpec(global_batch_size=8, micro_batch_sizes=[1, 2], precision="fp32")
CLUSTER = parse_cluster("1x4-cpu")
MB = 2.0**20
PARTS = {"router": 5.0, "dispatch": 30.0, "experts": 200.0, "combine": 20.0, "norm_residual": 4.0}


def moe_us(b, ep):
    """The synthetic moe unit: affine in batch, cheaper experts and dearer all-to-all at ep 2."""
    return 50.0 + 300.0 * b / ep + 40.0 * (ep - 1) * b


def write_db(path, eps=(1, 2), batches=(1, 2)):
    w = ProfileDBWriter(MODEL, gpu="cpu", dtype="fp32", hardware={"device_name": "cpu"})
    for b in batches:
        w.add_unit("decoder", "attention", 16, b, 1, fwd_us=100.0 * b, bwd_us=200.0 * b,
                   recompute_us=(0, 10.0 * b, 100.0 * b), act_bytes=(9e4 * b, 5e4 * b, 2048.0 * b),
                   weight_bytes=2e4)
        for ep in eps:
            f = moe_us(b, ep)
            w.add_unit("decoder", "moe", 16, b, 1, fwd_us=f, bwd_us=2 * f, recompute_us=(0, f / 5, f),
                       act_bytes=(8e4 * b, 7e4 * b, 2048.0 * b), weight_bytes=4e3 + 49152.0 / ep)
            w.data["units"][-1].update({"ep": ep, "etp": 1, "dispatcher": "alltoall", "grouped_gemm": False,
                                        "permute_fusion": False, "expert_weight_bytes": 49152.0 / ep,
                                        "parts_fwd_us": {k: v * b for k, v in PARTS.items()}})
        w.add_part("embedding", 16, b, 1, fwd_us=10.0 * b, bwd_us=20.0 * b, act_bytes=0.0, weight_bytes=16384.0)
        w.add_part("head", 16, b, 1, fwd_us=60.0 * b, bwd_us=90.0 * b, act_bytes=1e4 * b, weight_bytes=16512.0)
    w.add_collective("all_reduce", 2, False, [(1024, 30.0), (65536, 90.0)])
    w.add_p2p(False, [(1024, 20.0), (65536, 80.0)])
    w.data["all_to_all"] = [{"group": 2, "inter": False, "points": [[1024, 25.0], [65536, 70.0]]}]
    return w.save(path)


@pytest.fixture
def db(tmp_path):
    return write_db(tmp_path / "db.json")


def cost_model(db, model=MODEL):
    return make_cost_model(model, CLUSTER, TRAIN, kind="profile", db=str(db))


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_rows_priced_at_the_stage_expert_shape(db, ep):
    cm = cost_model(db)
    t = cm.source.unit_table(1.5, 1, ep=ep, etp=0)        # between the measured batches 1 and 2
    moe = [i for i, u in enumerate(MODEL.units) if u.kind == "moe"]
    assert moe == [1, 3]
    for i in moe:
        assert t.fwd_ms[i] == pytest.approx(moe_us(1.5, ep) / 1e3)
        assert t.bwd_ms[i] == pytest.approx(2 * moe_us(1.5, ep) / 1e3)
        assert t.recompute_ms[i, :3] == pytest.approx([0, moe_us(1.5, ep) / 5e3, moe_us(1.5, ep) / 1e3])
        assert t.act_mb[i, 1] == pytest.approx(7e4 * 1.5 / MB)
        assert t.weight_params[i] == pytest.approx((4e3 + 49152.0 / ep) / 4)       # fp32 bytes -> parameters
        assert t.expert_params[i] == pytest.approx(49152.0 / ep / 4)
        assert t.ep_comm_ms[i] == pytest.approx(2 * (30.0 + 20.0) * 1.5 / 1e3)    # fwd parts, twice
    assert t.fwd_ms[0] == pytest.approx(150.0 / 1e3) and t.expert_params[0] == 0.0
    assert cm.source.warnings == []


def test_a_one_stage_plan_sums_the_measured_rows(db):
    """tp 1 x dp 2, ep 2 (edp 1), micro-batch 2 (1 per rank): the stage's forward is the measured rows' sum, the
    expert parameters sync over expert-DP 1 (nothing) and the rest over dp 2 (the measured all-reduce curve)."""
    cm = cost_model(db)
    rc = np.zeros(MODEL.num_units, np.int8)
    st = cm.stage_cost(0, 1, 0, 0, MODEL.num_units, 1, 2, rc, 2, ep=2, etp=0)
    assert st.fwd_ms == pytest.approx((2 * 100.0 + 2 * moe_us(1, 2) + 10.0 + 60.0) / 1e3)
    assert st.bwd_ms == pytest.approx((2 * 200.0 + 4 * moe_us(1, 2) + 20.0 + 90.0) / 1e3)
    assert st.comm.get("edp", (0.0, 0.0))[0] == 0.0 and st.comm["dp"][0] > 0
    st1 = cm.stage_cost(0, 1, 0, 0, MODEL.num_units, 1, 2, rc, 2, ep=1, etp=0)
    assert st1.fwd_ms - st.fwd_ms == pytest.approx(2 * (moe_us(1, 1) - moe_us(1, 2)) / 1e3)
    assert st1.comm["edp"][0] > 0                          # ep 1: experts reduce over expert-DP 2


def test_evaluate_prices_an_moe_plan(db):
    from search.spec.plan import parse_plan

    raw = {"model": MODEL.model_dump(), "micro_batch_size": 2, "global_batch_size": 8,
           "stages": [{"num_gpus": 2, "tp": 1, "dp": 2, "ep": 2, "start_unit": 0, "end_unit": 4,
                       "recompute": ["none"] * 4}]}
    cost = cost_model(db).evaluate(parse_plan(raw, world_size=2))
    assert cost.iteration_ms > 4 * (2 * 300.0 + 6 * moe_us(1, 2)) / 1e3    # four micro-batches of the units


@pytest.mark.parametrize("shape, said", [
    ({"ep": 4}, "tp1 ep4 etp1 alltoall (measured: tp1 ep1 etp1 alltoall, tp1 ep2 etp1 alltoall); profile it "
                "(aceso profile --tp 1 --ep 4)"),
    ({"ep": 2, "etp": 2}, "tp1 ep2 etp2 alltoall"),
    ({"ep": 2, "moe": MoEPlanSettings(token_dispatcher="allgather")}, "tp1 ep2 etp1 allgather"),
])
def test_an_unmeasured_expert_shape_is_refused_naming_it(db, shape, said):
    with pytest.raises(AcesoError, match="no measurements for the moe unit at seq 16") as e:
        cost_model(db).source.unit_table(1, 1, **shape)
    assert said in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("settings, said", [
    ({"overlap_ep_comm": True}, "moe.overlap_ep_comm"),
    ({"grouped_gemm": False}, None),                      # the rows ran without grouped GEMM: what runs
])
def test_unmeasured_settings(db, settings, said):
    src = cost_model(db).source
    moe = MoEPlanSettings(**settings)
    if said is None:
        assert src.unit_table(1, 1, ep=2, moe=moe).fwd_ms[1] == pytest.approx(moe_us(1, 2) / 1e3)
        return
    with pytest.raises(AcesoError, match=said):
        src.unit_table(1, 1, ep=2, moe=moe)


def test_rows_measured_with_a_fast_path_refuse_a_plan_without_it(tmp_path):
    p = write_db(tmp_path / "db.json")
    d = json.loads(p.read_text())
    for u in d["units"]:
        if u["kind"] == "moe":
            u["grouped_gemm"] = True
    p.write_text(json.dumps(d))
    src = cost_model(p).source
    assert src.unit_table(1, 1, ep=2).fwd_ms[1] > 0              # the default plan settings: grouped on
    with pytest.raises(AcesoError, match="moe.grouped_gemm false: the moe rows .* were measured with grouped_gemm"):
        src.unit_table(1, 1, ep=2, moe=MoEPlanSettings(grouped_gemm=False))


def test_a_database_without_moe_rows_names_the_missing_unit(tmp_path):
    p = write_db(tmp_path / "db.json")
    d = json.loads(p.read_text())
    d["units"] = [u for u in d["units"] if u["kind"] != "moe"]
    p.write_text(json.dumps(d))
    with pytest.raises(AcesoError, match=r"no measurements for the moe unit .*\(measured: none\)"):
        cost_model(p).source.unit_table(1, 1)


def test_bad_moe_row_is_refused_naming_the_field(tmp_path):
    p = write_db(tmp_path / "db.json")
    d = json.loads(p.read_text())
    d["units"][1]["ep"] = 0
    p.write_text(json.dumps(d))
    with pytest.raises(AcesoError, match=r"corrupt profile database, units\[1\]\.ep"):
        cost_model(p)


def test_mla_and_mtp_stay_refused(db):
    mla = MODEL.model_copy(update={"num_query_groups": None,     # MLA has no query groups (search.spec.model_rules)
                                   "mla": MLASpec(kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
                                                  v_head_dim=8)})
    with pytest.raises(AcesoError, match="multi-latent attention: the profile cost model does not price them"):
        cost_model(db, mla)


def test_profiler_tasks_and_assembly_of_moe_rows(tmp_path):
    """The profiler's task list (pure: aceso_megatron.profiler.tasks, no torch) measures the moe unit at every ep and
    the other units once; its assembly writes the moe columns, which the cost model reads back."""
    from aceso_megatron.profiler.tasks import assemble, unit_tasks

    model = MODEL.model_copy(update={"moe": MODEL.moe.model_copy(update={"first_k_dense_layers": 1})})
    keys = [t.key for t in unit_tasks(model, [1], [1], eps=[1, 2])]
    assert keys == ["unit/decoder/attention/tp1/b1", "unit/decoder/mlp/tp1/b1", "unit/decoder/moe/tp1/ep1/b1",
                    "embedding/tp1/b1", "head/tp1/b1", "unit/decoder/moe/tp1/ep2/b1", "optimizer"]
    assert [t.key for t in unit_tasks(MODEL.model_copy(update={"moe": None}), [1], [1], eps=[1, 2])][:2] == [
        "unit/decoder/attention/tp1/b1", "unit/decoder/mlp/tp1/b1"]
    base = {"fwd_us": 10.0, "bwd_us": 20.0, "recompute_us": [0, 1, 10], "act_bytes": [3e4, 2e4, 2048.0],
            "weight_bytes": 1e4}
    done = {"unit/decoder/attention/tp1/b1": {**base, "recompute_us": [0, 1, 10, 2], "act_bytes": [3e4, 2e4, 2048.0,
                                                                                                   2.5e4]},
            "unit/decoder/mlp/tp1/b1": base, "embedding/tp1/b1": {**base, "act_bytes": 0.0},
            "head/tp1/b1": {**base, "act_bytes": 1e3}}
    for ep in (1, 2):
        done[f"unit/decoder/moe/tp1/ep{ep}/b1"] = {**base, "fwd_us": 100.0 * ep, "ep": ep, "etp": 1,
                                                   "dispatcher": "alltoall", "expert_weight_bytes": 8e3 / ep,
                                                   "parts_fwd_us": {"dispatch": 5.0 * ep, "combine": 1.0}}
    w = ProfileDBWriter(model, gpu="cpu", dtype="fp32")
    assemble(w, model, unit_tasks(model, [1], [1], eps=[1, 2]), done)
    moe = [u for u in w.data["units"] if u["kind"] == "moe"]
    assert [(u["ep"], u["expert_weight_bytes"], u["parts_fwd_us"]["dispatch"]) for u in moe] == [(1, 8e3, 5.0),
                                                                                                   (2, 4e3, 10.0)]
    src = make_cost_model(model, CLUSTER, TRAIN, kind="profile", db=str(w.save(tmp_path / "db.json"))).source
    t = src.unit_table(1, 1, ep=2)
    assert [u.kind for u in model.units] == ["attention", "mlp", "attention", "moe"]
    assert t.fwd_ms[3] == pytest.approx(0.2) and t.expert_params[3] == 1e3 and t.ep_comm_ms[3] == pytest.approx(0.022)
