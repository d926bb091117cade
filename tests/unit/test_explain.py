"""``aceso explain``: the JSON report, the table, reference configs, and bad input (exit 2)."""

from __future__ import annotations

import json

import pytest

from search.cli import main
from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.spec.plan import ParallelPlan, StageSpec
from search.spec.presets import load_model
from search.spec.training import TrainingSpec


@pytest.fixture
def plan_file(tmp_path):
    m = load_model("gpt-1.3b")
    c = parse_cluster("1x8-a100")
    plan = ParallelPlan(model=m, cluster=c, micro_batch_size=4, global_batch_size=64, stages=[
        StageSpec(num_gpus=4, tp=2, dp=2, start_unit=0, end_unit=20, recompute=["selective"] * 20),
        StageSpec(num_gpus=4, tp=4, dp=1, start_unit=20, end_unit=48, recompute=["none"] * 14 + ["full"] * 14)])
    p = tmp_path / "plan.json"
    p.write_text(plan.to_json())
    return p, plan


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_json_report_fields(plan_file, capsys):
    path, plan = plan_file
    out = _json(capsys, ["explain", str(path), "--json"])
    cost = make_cost_model(plan.model, plan.cluster, TrainingSpec(global_batch_size=64, precision="fp16")
                           ).evaluate(plan)
    assert out["iteration_time_ms"] == pytest.approx(cost.iteration_ms)
    assert [s["memory_mib"] for s in out["stages"]] == pytest.approx([s.memory_mb for s in cost.stages])
    assert out["max_memory_mib"] == max(s["memory_mib"] for s in out["stages"])
    assert out["fits"] is True and len(out["stages"]) == 2
    assert max(s["time_ms"] for s in out["stages"]) <= out["iteration_time_ms"] + 1e-9
    assert out["stages"][1]["recompute"] == {"none": 14, "full": 14}
    assert 0 < out["mfu"] < 1


def test_overrides_and_table(plan_file, capsys):
    path, _ = plan_file
    small = _json(capsys, ["explain", str(path), "--json", "--global-batch-size", "32"])
    big = _json(capsys, ["explain", str(path), "--json"])
    assert small["num_micro_batches"] == 8 and small["iteration_time_ms"] < big["iteration_time_ms"]
    tight = _json(capsys, ["explain", str(path), "--json", "--memory-limit-mb", "4000"])
    assert tight["fits"] is False and tight["bottleneck_resource"] == "memory"
    assert main(["explain", str(path)]) == 0
    text = capsys.readouterr().out
    assert "iteration" in text and "samples/s" in text and "MFU" in text


def test_text_shows_each_stages_named_terms(plan_file, capsys):
    """Each stage's memory terms beyond the table's columns (states, activations, reserve) and its time terms are
    printed by name with the cost model's values."""
    path, plan = plan_file
    cost = make_cost_model(plan.model, plan.cluster, TrainingSpec(global_batch_size=64, precision="fp16")
                           ).evaluate(plan)
    assert main(["explain", str(path)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if " terms: " in ln]
    assert len(lines) == 2
    for i, (line, sc) in enumerate(zip(lines, cost.stages)):
        mem = sc.memory_breakdown
        assert line.startswith(f"stage {i} terms: optimizer_step {sc.terms['optimizer_step']:.1f} ms")
        assert f"recompute_peak {mem['recompute_peak'] / 1024:+.2f} GiB" in line
        assert f"p2p_buffers {mem['p2p_buffers'] / 1024:+.2f} GiB" in line
        assert "params" not in line and "reserve" not in line and "activations" not in line


def test_bad_plans_exit_2(tmp_path, plan_file, capsys):
    path, plan = plan_file
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert main(["explain", str(bad)]) == 2
    assert main(["explain", str(tmp_path / "missing.json")]) == 2
    raw = json.loads(path.read_text())
    raw["stages"][0]["tp"] = 3
    bad.write_text(json.dumps(raw))
    assert main(["explain", str(bad)]) == 2
    raw = json.loads(path.read_text())
    del raw["cluster"]
    bad.write_text(json.dumps(raw))
    assert main(["explain", str(bad)]) == 2
    assert "give --cluster" in capsys.readouterr().err
    assert main(["explain", str(path), "--cost-model", "profile"]) == 2
    assert main(["explain", str(path), "--model", "gpt-13b"]) == 2


def test_reference_config_is_converted(reference_db, capsys):
    cfg = reference_db / "configs" / "gpt_1_3B_4gpus_megatron_grid_best.json"
    out = _json(capsys, ["explain", str(cfg), "--cluster", "1x4-v100", "--json"])
    assert len(out["stages"]) == 4 and out["micro_batch_size"] == 2
    assert all(s["recompute"] == {"full": 12} for s in out["stages"])
    cfg = reference_db / "configs" / "gpt_1_3B_4gpus_reference_search.json"
    assert main(["explain", str(cfg), "--cluster", "1x4-v100"]) == 2      # boundaries inside units
    assert "--snap" in capsys.readouterr().err
    out = _json(capsys, ["explain", str(cfg), "--cluster", "1x4-v100", "--snap", "--json"])
    assert any("moved" in n for n in out["notes"])


def test_reference_configs_are_explained_exactly_under_compat(reference_db, capsys):
    """`aceso explain REFCONFIG --cost-model aceso-compat` gives the reference's own (golden) numbers, with no
    conversion to units (most reference plans cut stages inside a unit)."""
    import csv

    configs = sorted((reference_db / "configs").glob("*.json"))
    assert len(configs) >= 6
    for cfg in configs:
        assert main(["explain", str(cfg), "--cost-model", "aceso-compat", "--db", str(reference_db / "miniset"),
                     "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        rows = list(csv.DictReader(open(cfg.with_suffix(".csv"))))
        golden = [float(r["time"]) for r in rows]
        assert out["iteration_time_ms"] == pytest.approx(max(golden), rel=1e-3), cfg.name
        for st, r in zip(out["stages"], rows):
            assert st["time_ms"] == pytest.approx(float(r["time"]), rel=1e-3)
            assert st["memory_mib"] == pytest.approx(float(r["memory(total)"]), rel=1e-3)


def test_v2_features_and_exposed_hidden_comm(tmp_path, capsys):
    """An interleaved SP plan with every overlap: the report names the features and, per stage, each
    communication kind's exposed and hidden ms, which add up to the stage's comm totals."""
    from search.spec.plan import uniform_plan
    m = load_model("llama3-8b")
    c = parse_cluster("2x8-h100")
    plan = uniform_plan(m, 2, 4, 2, 4, 64, cluster=c, sequence_parallel=True, num_virtual_stages=2,
                        distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
                        tp_comm_overlap=True)
    path = tmp_path / "v2.json"
    path.write_text(plan.to_json())
    out = _json(capsys, ["explain", str(path), "--json"])
    f = out["features"]
    assert f["sequence_parallel"] == [0, 1] and f["virtual_stages"] == 2 and f["tp_comm_overlap"]
    assert f["overlap_grad_reduce"] and f["overlap_param_gather"] and f["distributed_optimizer"]
    for s in out["stages"]:
        assert {"tp", "p2p", "dp", "param_gather"} <= set(s["comm"]) and s["sp"] is True
        assert s["comm_exposed_ms"] == pytest.approx(sum(v["exposed_ms"] for v in s["comm"].values()))
        assert s["comm_hidden_ms"] == pytest.approx(sum(v["hidden_ms"] for v in s["comm"].values()))
        assert s["comm"]["tp"]["hidden_ms"] > s["comm"]["tp"]["exposed_ms"] > 0
        assert len(s["units"]) == 2                      # two chunks per stage
    lm = _json(capsys, ["explain", str(path), "--json", "--framework", "megatron-lm"])
    assert lm["stages"][0]["memory_breakdown_mib"]["grads"] == pytest.approx(
        2 * out["stages"][0]["memory_breakdown_mib"]["grads"])            # fp32 gradients under Megatron-LM
    assert main(["explain", str(path)]) == 0
    text = capsys.readouterr().out
    assert "SP on stages 0,1" in text and "exposed / hidden" in text


def test_v1_plan_and_bad_v2_fields(tmp_path, plan_file, capsys):
    path, plan = plan_file
    raw = json.loads(path.read_text())
    raw["schema_version"] = 1
    for st in raw["stages"]:                               # the v1 form: spans on the stage, no v2 fields
        ch = st.pop("chunks")[0]
        st.update(ch)
        st.pop("cp", None)
        st.pop("sequence_parallel", None)
    for k in ("distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap"):
        raw.pop(k, None)
    v1 = tmp_path / "v1.json"
    v1.write_text(json.dumps(raw))
    got = _json(capsys, ["explain", str(v1), "--json"])
    assert got["features"]["virtual_stages"] == 1 and got["features"]["sequence_parallel"] == []
    base = json.loads(path.read_text())
    for change, needle in ((lambda r: r["stages"][0].update(sequence_parallel=True, tp=1, dp=4), "sequence_parallel"),
                           (lambda r: r.update(overlap_param_gather=True), "overlap_param_gather"),
                           (lambda r: r.update(tp_comm_overlap=True), "tp_comm_overlap"),
                           (lambda r: r["stages"][0].update(cp=3, dp=1, num_gpus=6), "cp")):
        bad = json.loads(json.dumps(base))
        change(bad)
        p = tmp_path / "bad.json"
        p.write_text(json.dumps(bad))
        assert main(["explain", str(p)]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1
    sp = json.loads(json.dumps(base))
    sp["stages"][0]["sequence_parallel"] = True
    p = tmp_path / "sp.json"
    p.write_text(json.dumps(sp))
    db = tmp_path / "db.json"
    from search.costmodel.profiledb import ProfileDBWriter
    ProfileDBWriter(plan.model, gpu="a100", dtype="fp16").save(db)
    assert main(["explain", str(p), "--cost-model", "profile", "--db", str(db), "--precision", "fp16"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot price sequence parallelism" in err and len(err.splitlines()) == 1
