"""CPU end to end: ``aceso profile`` of a tiny GPT (tp 1 and 2, two per-rank micro-batch sizes) on 2 gloo
processes; the database loads in the profile cost model; ``aceso search --cost-model profile`` plans for a 4-process
CPU "cluster"; ``aceso launch --cpu`` trains that plan for a few steps on mock data."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.test_teardown_launch import SITECUSTOMIZE

ROOT = Path(__file__).resolve().parents[2]
TINY = {"name": "tiny-gpt", "family": "gpt", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
        "ffn_hidden_size": 64, "seq_length": 16, "vocab_size": 128, "params_dtype": "fp32"}


def aceso(*argv, timeout=300, env=None):
    return subprocess.run([sys.executable, "-m", "search", *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, check=False, env=env)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """The profile run, its ranks' stderr kept (``profile.stderr``) with what each had left for interpreter
    finalization at its last ``atexit`` call (test_teardown_launch's ``sitecustomize`` on the ranks' path)."""
    d = tmp_path_factory.mktemp("profile")
    spec = d / "tiny.json"
    spec.write_text(json.dumps(TINY))
    (d / "site").mkdir()
    (d / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(d / "site"), str(ROOT)]))
    t0 = time.time()
    r = aceso("profile", "--model", spec, "--tp", "1", "2", "--micro-batch-sizes", "1", "2", "-o", d / "db.json",
              "--cpu", "--warmup", "1", "--repeats", "5", "--max-bytes", 65536, env=env)
    seconds = time.time() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    (d / "profile.stderr").write_text(r.stderr)
    return spec, d / "db.json", seconds


def test_profile_ranks_leave_nothing_for_finalization(profiled):
    """Each worker released the runtime of its optimizer probe and destroyed megatron-core's and torch's groups
    (``training/teardown.py``) before exit: no DDP or optimizer left at its last ``atexit`` call, no abort."""
    err = profiled[1].with_name("profile.stderr").read_text()
    left = sorted(line for line in err.splitlines() if "left for finalization" in line)
    assert left == ["rank 0 left for finalization: 0", "rank 1 left for finalization: 0"], err[-5000:]
    assert "terminate called" not in err, err[-5000:]


def test_profile_database(profiled):
    _spec, db, seconds = profiled
    assert seconds < 300
    d = json.loads(db.read_text())
    assert d["format"] == "aceso-profile-db" and d["hardware"]["gpu"] == "cpu" and d["dtype"] == "fp32"
    assert d["hardware"]["torch"] and d["hardware"]["megatron_core"]
    assert d["model_spec"]["hidden_size"] == TINY["hidden_size"] and d["profiler"]["settings"]["world"] == 2
    rows = {(u["kind"], u["tp"], u["batch"]): u for u in d["units"]}
    assert set(rows) == {(k, t, b) for k in ("attention", "mlp") for t in (1, 2) for b in (1, 2)}
    h, s = TINY["hidden_size"], TINY["seq_length"]
    for (kind, tp, b), u in rows.items():
        assert u["act_bytes"][2] == 4 * s * b * h            # full recompute: the unit input only
        assert u["fwd_us"] > 0 and u["bwd_us"] > 0
    # TP halves the split weights: attention tp2 = (QKV + proj weights and QKV bias) / 2 + replicated norm + bias
    qkv, proj = 3 * h * h + 3 * h, h * h
    assert rows[("attention", 2, 1)]["weight_bytes"] == 4 * ((qkv + proj) / 2 + 2 * h + h)
    assert {(e["tp"], e["batch"]) for e in d["embedding"]} == {(t, b) for t in (1, 2) for b in (1, 2)}
    assert {c["kind"] for c in d["collectives"]} == {"all_reduce", "all_gather", "reduce_scatter"}
    assert all(c["group"] == 2 and [p[0] for p in c["points"]] == [1024, 4096, 16384, 65536]
               for c in d["collectives"])
    assert d["p2p"][0]["inter"] is False and d["all_to_all"][0]["group"] == 2
    assert d["optimizer"]["us_per_param"] > 0
    assert not db.with_name(db.name + ".partial.jsonl").exists()


def test_cost_model_reads_it(profiled):
    from search.spec.cluster import parse_cluster
    from search.pricing import make_cost_model
    from search.spec.presets import load_model
    from search.spec.training import TrainingSpec

    spec, db, _ = profiled
    d = json.loads(db.read_text())
    model = load_model(str(spec))
    tr = TrainingSpec(global_batch_size=8, micro_batch_sizes=[1, 2], precision="fp32")
    cm = make_cost_model(model, parse_cluster("1x4-cpu"), tr, kind="profile", db=db)
    t = cm.unit_table(2, 2)
    row = next(u for u in d["units"] if (u["kind"], u["tp"], u["batch"]) == ("mlp", 2, 2))
    assert t.fwd_ms[1] == pytest.approx(row["fwd_us"] / 1e3)
    assert cm.source.warnings == []


def test_search_then_launch(profiled, tmp_path):
    spec, db, _ = profiled
    plan = tmp_path / "plan.json"
    r = aceso("search", "--model", spec, "--cluster", "1x4-cpu", "--global-batch-size", 8, "--micro-batch-sizes",
              1, 2, "--cost-model", "profile", "--db", db, "--budget-evals", 200, "-o", plan)
    assert r.returncode == 0, r.stderr[-2000:]
    p = json.loads(plan.read_text())
    assert sum(s["num_gpus"] for s in p["stages"]) == 4
    log = tmp_path / "log.jsonl"
    r = aceso("launch", plan, "--cpu", "--", "--mock-data", "--train-iters", 3, "--log-interval", 1,
              "--log-file", log, timeout=400)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    recs = [json.loads(ln) for ln in log.read_text().splitlines()]
    losses = [x["loss"] for x in recs if x.get("kind") == "train"]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    summary = next(x for x in recs if x.get("kind") == "summary")
    assert summary["predicted_iteration_time_ms"] > 0
