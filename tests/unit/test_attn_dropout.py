"""The ``attn_dropout`` recompute choice on the planner side: plan contract, analytic and compat cost models,
profile databases, and the exact per-kind recompute refinement of op-level plans."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from search.spec.cluster import parse_cluster
from search.compat import load_ref_config
from search.compat.costmodel import make_compat_cost_model
from search.compat.mapping import ref_to_plan
from search.pricing import make_cost_model
from search.costmodel.types import ATTN_DROPOUT, RC_CODE, UNAVAILABLE_MS
from search.io.errors import AcesoError
from search.spec.model import ModelSpec
from search.spec.plan import parse_plan
from search.planner.recompute import allowed_codes, refine_by_counts
from search.spec.presets import load_model
from search.spec.training import TrainingSpec

MB = 2.0**20
GPT = ModelSpec(name="tiny", family="gpt", num_layers=2, hidden_size=1024, num_attention_heads=16,
                ffn_hidden_size=4096, seq_length=512, vocab_size=1024, params_dtype="fp16",
                attention_dropout=0.1, hidden_dropout=0.1)
TRAIN = TrainingSpec(global_batch_size=16, precision="fp16")


def _raw_plan(recompute):
    return {"model": GPT.model_dump(), "micro_batch_size": 1, "global_batch_size": 4,
            "stages": [{"num_gpus": 1, "tp": 1, "dp": 1, "start_unit": 0, "end_unit": 4, "recompute": recompute}]}


def test_plan_accepts_attn_dropout_on_attention_units_only():
    plan = parse_plan(_raw_plan(["attn_dropout", "none", "attn_dropout", "full"]))
    assert plan.stages[0].recompute[0] == "attn_dropout"
    with pytest.raises(AcesoError, match=r"stages\[0\]\.recompute\[1\].*MLP unit.*none, selective or full"):
        parse_plan(_raw_plan(["none", "attn_dropout", "none", "none"]))


@pytest.mark.parametrize("tp,b", [(1, 1), (2, 4)])
def test_analytic_attn_dropout_frees_the_dropout_mask_and_output(tp, b):
    """Unfused attention (V100): the choice frees 1 B (mask) + 2 B (dropped probs) per score element."""
    cm = make_cost_model(GPT, parse_cluster("1x4-v100"), TRAIN)
    t = cm.unit_table(b, tp)
    a, s = GPT.num_attention_heads, GPT.seq_length
    freed = (1 + 2) * a * s * s * b / tp / MB
    assert t.act_mb[0, 0] - t.act_mb[0, ATTN_DROPOUT] == pytest.approx(freed, rel=1e-12)
    assert t.peak_mb[0, ATTN_DROPOUT] == pytest.approx(freed, rel=1e-12)
    # it re-runs part of what selective re-runs: cheaper in time, frees less
    assert 0 < t.recompute_ms[0, ATTN_DROPOUT] < t.recompute_ms[0, RC_CODE["selective"]]
    assert t.act_mb[0, RC_CODE["selective"]] < t.act_mb[0, ATTN_DROPOUT]
    assert t.recompute_ms[1, ATTN_DROPOUT] >= UNAVAILABLE_MS          # MLP unit
    assert t.act_mb[1, ATTN_DROPOUT] == t.act_mb[1, 0]


@pytest.mark.parametrize("gpu,model", [("h100", GPT), ("v100", GPT.model_copy(update={"attention_dropout": 0.0}))])
def test_analytic_attn_dropout_unavailable_where_nothing_is_freed(gpu, model):
    """Flash attention keeps no s^2 tensors; without attention dropout there is no mask or dropped copy."""
    t = make_cost_model(model, parse_cluster(f"1x4-{gpu}"), TRAIN).unit_table(1, 1)
    assert (t.recompute_ms[:, ATTN_DROPOUT] >= UNAVAILABLE_MS).all()
    assert (t.act_mb[:, ATTN_DROPOUT] == t.act_mb[:, 0]).all()


def test_compat_attn_dropout_is_the_dropout_context_segment(reference_db):
    """Reference memory rule (SPEC §3.7): the [dropout, context] segment frees the dropout op's activations
    (x1.5 shared-space factor) per in-flight micro-batch; it costs the two ops' forward."""
    model = load_model("gpt-1.3b", num_layers=2)
    cm = make_compat_cost_model(model, parse_cluster("1x4-v100", memory_limit_mb=12000), TRAIN,
                                reference_db / "miniset")
    names = cm.layout.names
    flagged = [names[k] for k in np.flatnonzero(cm.layout.flag_patterns[ATTN_DROPOUT])]
    assert flagged == ["enc-attention-dropout", "enc-attention-context"] * 2
    row = {r[0]: r for r in (line.split(",") for line in
                             (reference_db / "miniset" / "gpt_1_3B_mbs1_tp1_algo0.csv").read_text().splitlines()[1:])}
    none = cm.stage_cost(0, 2, 0, 0, 4, 1, 1, np.zeros(4, np.int8), 1)
    drop = cm.stage_cost(0, 2, 0, 0, 4, 1, 1, np.array([ATTN_DROPOUT, 0, 0, 0], np.int8), 1)
    in_flight = 2
    act_dropout = 1.5 * float(row["enc-attention-dropout"][6])
    # kept activations fall by the dropout's A' per in-flight micro-batch; the re-materialisation peak rises by it
    assert none.memory_mb - drop.memory_mb == pytest.approx(act_dropout * in_flight - act_dropout, rel=1e-9)
    fwd = float(row["enc-attention-dropout"][1]) + float(row["enc-attention-context"][1])
    assert drop.recompute_ms - none.recompute_ms == pytest.approx(fwd / 1e3, rel=1e-9)


def test_reference_plan_imports_its_dropout_context_segments_exactly(reference_db):
    """The reference search's GPT-1.3B plan recomputes [dropout, context] in 10 attention units."""
    cfg = load_ref_config(reference_db / "configs" / "gpt_1_3B_4gpus_reference_search.json")
    plan, _ = ref_to_plan(cfg, snap=True)
    assert sum(st.recompute.count("attn_dropout") for st in plan.stages) == 10


def test_profile_db_attention_rows_with_and_without_attn_dropout(tmp_path):
    from tests.unit.test_costmodel_profiledb import MODEL, write_db
    path = write_db(tmp_path / "db.json")
    cm = make_cost_model(MODEL, parse_cluster("1x4-v100"), TRAIN, kind="profile", db=str(path))
    old = cm.unit_table(1, 1)                       # 3 measured choices: attn_dropout unavailable
    assert (old.recompute_ms[:, ATTN_DROPOUT] >= UNAVAILABLE_MS).all()
    data = json.loads(path.read_text())
    for e in data["units"]:
        if e["kind"] == "attention":
            e["recompute_us"].append(e["fwd_us"] / 8)
            e["act_bytes"].append(e["act_bytes"][0] * 0.7)
    path.write_text(json.dumps(data))
    new = make_cost_model(MODEL, parse_cluster("1x4-v100"), TRAIN, kind="profile", db=str(path)).unit_table(1, 1)
    assert new.recompute_ms[0, ATTN_DROPOUT] == pytest.approx(old.fwd_ms[0] / 8)
    assert new.act_mb[0, ATTN_DROPOUT] == pytest.approx(0.7 * new.act_mb[0, 0])
    assert new.peak_mb[0, ATTN_DROPOUT] == pytest.approx(0.3 * new.act_mb[0, 0])
    assert new.recompute_ms[1, ATTN_DROPOUT] >= UNAVAILABLE_MS          # the MLP rows keep 3 entries
    data["units"][1]["act_bytes"].append(1.0)  # an MLP row with 4 entries, then mixed lengths: corrupt
    path.write_text(json.dumps(data))
    with pytest.raises(AcesoError, match="corrupt profile database"):
        make_cost_model(MODEL, parse_cluster("1x4-v100"), TRAIN, kind="profile", db=str(path)).unit_table(1, 1)


@pytest.mark.parametrize("i,a,b,limit", [(0, 0, 6, 8500), (1, 6, 12, 7400), (0, 2, 8, 6500)])
def test_refine_by_counts_equals_brute_force_on_the_compat_model(reference_db, i, a, b, limit):
    """Compat units of one kind cost the same: the per-kind count enumeration is the optimum over every
    per-unit assignment."""
    model = load_model("gpt-1.3b", num_layers=6)
    cm = make_compat_cost_model(model, parse_cluster("1x2-v100", memory_limit_mb=limit), TRAIN,
                                reference_db / "miniset")

    def cost(rc):
        return cm.stage_cost(i, 2, i, a, b, 1, 1, np.asarray(rc, np.int8), 1)
    allowed = allowed_codes(model, a, b)
    best = min((c.time_per_microbatch_ms for rc in itertools.product(*allowed) if (c := cost(rc)).fits),
               default=np.inf)
    assert np.isfinite(best)
    full = np.full(b - a, 2, np.int8)
    kinds = [(u.stack, u.kind) for u in model.units[a:b]]
    rc, got = refine_by_counts(cost, full, cost(full), kinds, allowed)
    assert got.fits and got.time_per_microbatch_ms == pytest.approx(best, rel=1e-12)
    assert got.time_per_microbatch_ms == pytest.approx(cost(rc).time_per_microbatch_ms, rel=1e-12)


# ----- the attention kernel the analytic model assumes (flash = transformer-engine, unfused = local) ----------------
def test_attention_unfused_on_h100_keeps_the_s2_terms_and_flash_on_v100_is_an_error():
    from search.costmodel.memory import unfused_core_bytes
    h100 = parse_cluster("1x4-h100")
    flash = make_cost_model(GPT, h100, TRAIN).unit_table(1, 1)
    local = make_cost_model(GPT, h100, TRAIN.model_copy(update={"attention": "unfused"})).unit_table(1, 1)
    a, s = GPT.num_attention_heads, GPT.seq_length
    core, _ = unfused_core_bytes(GPT, 1, s, s, 1, 2.0)
    assert (local.act_mb[0, 0] - flash.act_mb[0, 0]) * MB == pytest.approx(core - 4.0 * a * s, rel=1e-12)
    assert local.recompute_ms[0, ATTN_DROPOUT] < UNAVAILABLE_MS <= flash.recompute_ms[0, ATTN_DROPOUT]
    with pytest.raises(AcesoError, match="--attention flash: v100 has no flash attention"):
        make_cost_model(GPT, parse_cluster("1x4-v100"), TRAIN.model_copy(update={"attention": "flash"}))


@pytest.mark.parametrize("extra,want", [((), "flash"), (("--attention", "unfused"), "unfused")])
def test_search_records_the_attention_it_assumed(tmp_path, extra, want):
    from search.cli import main
    out = tmp_path / "plan.json"
    assert main(["search", "--model", "gpt-350m", "--num-layers", "4", "--cluster", "1x2-h100",
                 "--global-batch-size", "16", "--budget-evals", "200", "--workers", "1", "--json", *extra,
                 "-o", str(out)]) == 0
    assert json.loads(out.read_text())["predicted"]["attention"] == want
