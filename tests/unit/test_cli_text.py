"""What the commands print is whole and says what it means (issue 25): help summaries are full first paragraphs,
tables fold instead of cutting ("micro-bat…"), summaries name cp, counts agree with their nouns, a CPU cluster
is not "GPUs", and the search prints the wall time beside its own search time."""

from __future__ import annotations

import importlib
import json
import re
import time

from search.cli import PLANNER_SUBCOMMANDS, main, summary
from search.spec.cluster import parse_cluster
from search.spec.plan import uniform_plan
from search.spec.presets import load_model

ELLIPSIS = "\u2026"


def test_help_summaries_are_whole_first_paragraphs(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for name, module in PLANNER_SUBCOMMANDS.items():
        doc = importlib.import_module(f"search.cli.{module}").__doc__
        first = " ".join(doc.strip().split("\n\n")[0].split())
        assert summary(doc) == first and first in text, name
        assert first.endswith((".", ")")), f"{name}'s first paragraph is not a sentence: {first!r}"


def test_validate_names_cp_and_counts_stages(tmp_path, capsys):
    model = load_model("gpt-1.3b").model_copy(update={"params_dtype": "bf16"})   # (the runtime: no fp16 on H100s)
    plan = uniform_plan(model, 1, 2, 2, 16, 64, cluster=parse_cluster("2x8-h100"), cp=4)
    assert [(s.tp, s.cp, s.dp) for s in plan.stages] == [(2, 4, 2)]
    (tmp_path / "p.json").write_text(plan.to_json())
    assert main(["validate", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "1 stage (16gpu tp2 cp4 dp2 units 0-48)" in out and "1 stages" not in out
    assert main(["validate", str(tmp_path / "p.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stages"][0]["cp"] == 4


def test_tables_fold_rather_than_cut(tmp_path, capsys):
    argv = ["baseline", "--model", "llama3-70b", "--cluster", "8x8-h100", "--global-batch-size", "512",
            "-o", str(tmp_path / "p.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert ELLIPSIS not in out and "micro-" in out and "max mem" in out
    assert main(["explain", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert ELLIPSIS not in out and "tp2 cp4 dp2 sp" in out
    comm = re.findall(r"\s(\d+)/(\d+)\s", out)      # the exposed/hidden column in full
    report = json.loads((main(["explain", str(tmp_path / "p.json"), "--json"]), capsys.readouterr().out)[1])
    assert [(int(a), int(b)) for a, b in comm] == [(round(s["comm_exposed_ms"]), round(s["comm_hidden_ms"]))
                                                    for s in report["stages"]]


def test_search_on_cpu_says_the_cluster_and_the_wall_time(tmp_path, capsys):
    spec = tmp_path / "tiny.json"
    spec.write_text(json.dumps({"name": "tiny-gpt", "family": "gpt", "num_layers": 2, "hidden_size": 64,
                                "num_attention_heads": 4, "ffn_hidden_size": 256, "seq_length": 64,
                                "vocab_size": 512, "params_dtype": "fp32"}))
    start = time.perf_counter()
    assert main(["search", "--model", str(spec), "--cluster", "1x2-cpu", "--global-batch-size", "4",
                 "--budget-evals", "20", "-o", str(tmp_path / "p.json")]) == 0
    wall = time.perf_counter() - start
    out = capsys.readouterr().out
    assert "tiny-gpt on 1x2-cpu (" in out and "cpu GPUs" not in out
    m = re.search(r"search ([0-9.]+) s \(([0-9.]+) s wall in all", out)
    assert m and float(m.group(1)) <= float(m.group(2)) <= wall + 0.05
