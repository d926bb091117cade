"""bench/gpu/validate.sh without a GPU: ``--dry-run`` prints the profile command and eight 1-GPU plans that
validate; ``--cpu --tiny`` runs the whole pipeline (profile -> predict -> aceso train -> errors) on one plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from search.spec.plan import RECOMPUTE_CHOICES, parse_plan

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "validate.sh"
ENV = {**os.environ, "PYTHON": sys.executable}   # this interpreter, not the python on PATH


def test_dry_run_plans(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=120, check=False, env=ENV)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert "profile" in lines[0] and "--tp 1 --micro-batch-sizes 1 2" in lines[0]
    assert len(lines) == 9 and all(" train " in ln and "--train-iters 10" in ln for ln in lines[1:])
    recomputes = set()
    for f in sorted(tmp_path.glob("plan-*.json")):
        plan = parse_plan(json.loads(f.read_text()), world_size=1)
        assert plan.model.num_layers == 24 and plan.model.hidden_size == 2048 and plan.model.params_dtype == "bf16"
        recomputes.add((plan.micro_batch_size, plan.stages[0].recompute[0]))
    assert recomputes == {(m, rc) for m in (1, 2) for rc in RECOMPUTE_CHOICES if rc != "mla_up_proj"}   # no MLA


def test_cpu_tiny_pipeline(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "--cpu", "--tiny", "--steps", "3", "--max-plans", "1", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=400, check=False, env=ENV)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    res = json.loads((tmp_path / "validate.json").read_text())
    (row,) = res["plans"]
    assert row["predicted"]["iteration_ms"] > 0 and row["measured"]["iteration_ms"] > 0
    assert abs(row["time_error"]) == res["max_abs_time_error"]
    assert "memory_error" not in row            # CPU RSS is not compared with a GPU memory prediction
    assert "max |time error|" in r.stdout
