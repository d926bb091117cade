"""One memory unit (issue 25): binary MiB/GiB, labelled so, in every command, picture, export header and JSON field.
The reference is the byte count itself: an H100 has 80 GiB = 80 * 2^30 bytes of HBM, which every command must
report as 81920 MiB or 80.00 GiB; a plan written with the old field names reads to the same numbers."""

from __future__ import annotations

import json
import re

from search.cli import main
from search.spec.cluster import parse_cluster
from search.spec.plan import PlanPrediction, load_plan, uniform_plan
from search.spec.presets import load_model


def _plan(tmp_path, limit=None):
    model = load_model("gpt-1.3b").model_copy(update={"params_dtype": "bf16"})   # (the runtime: no fp16 on H100s)
    plan = uniform_plan(model, 1, 1, 8, 8, 64, cluster=parse_cluster("1x8-h100", limit))
    plan = plan.model_copy(update={"predicted": PlanPrediction(cost_model="analytic", iteration_time_ms=10.0,
                                                                samples_per_s=6400.0, stage_time_ms=[10.0],
                                                                stage_memory_mb=[30000.0])})
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    return path


def test_every_command_states_the_h100_as_80_gib(tmp_path, capsys):
    path = _plan(tmp_path)
    assert main(["clusters", "--json"]) == 0
    h100 = next(r for r in json.loads(capsys.readouterr().out) if r["gpu"] == "h100")
    assert h100["memory_gib"] * 2**30 == 80 * 2**30
    assert main(["validate", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_limit_mib"] == 81920
    assert main(["validate", str(path)]) == 0
    assert "of 81920 MiB per GPU" in capsys.readouterr().out
    assert main(["explain", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_limit_mib"] == 81920
    assert main(["explain", str(path)]) == 0
    assert re.search(r"max memory [0-9.]+ of 80\.00 GiB", capsys.readouterr().out)
    assert main(["export", str(path), "--to", "megatron-lm", "-o", "-"]) == 0
    assert re.search(r"peak memory 29\.30 of 80\.00 GiB\s+per GPU", capsys.readouterr().out)


def test_no_command_output_says_mb_or_gb_for_memory(tmp_path, capsys):
    path = _plan(tmp_path, limit=30000)
    for argv in (["validate", str(path)], ["explain", str(path)], ["export", str(path), "--to", "megatron-lm", "-o", "-"],
                 ["baseline", "--model", "gpt-1.3b", "--cluster", "1x8-h100", "--global-batch-size", "64"]):
        assert main(argv) == 0, argv
        out = capsys.readouterr()
        text = out.out + out.err
        assert not re.search(r"\b(MB|GB)\b(?!/s)", text), (argv, text)
        assert "29.30 GiB" in text or "30000 MiB" in text or argv[0] == "baseline"


def test_old_field_names_and_the_old_flag_still_read(tmp_path, capsys):
    new = json.loads(_plan(tmp_path, limit=20000).read_text())
    old = json.loads(json.dumps(new).replace("memory_limit_mib", "memory_limit_mb")
                     .replace("stage_memory_mib", "stage_memory_mb"))
    old["cluster"]["gpu"]["memory_gb"] = old["cluster"]["gpu"].pop("memory_gib") * 2**30 / 1e9   # 85.9 GB
    (tmp_path / "old.json").write_text(json.dumps(old))
    plan = load_plan(str(tmp_path / "old.json"))
    assert plan.cluster.memory_mb == 20000 and plan.predicted.stage_memory_mb == [30000.0]
    assert abs(plan.cluster.gpu.memory_gib - 80.0) < 1e-9
    assert json.loads(plan.to_json()) == new                   # written back under the new names
    args = ["validate", str(tmp_path / "old.json"), "--cluster", "1x8-h100", "--json"]
    assert main([*args, "--memory-limit-mb", "30000"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_limit_mib"] == 30000
    assert main([*args, "--memory-limit-mib", "30000"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_limit_mib"] == 30000
