"""``aceso search --target megatron-bridge``: its uniform and Megatron-LM lines are Megatron-Bridge plans (the
Megatron-LM space, each plan passing Bridge's rules, priced as Bridge runs it), and ``-o`` writes that plan. The
note on a slower heterogeneous line told the user to "run the Megatron-LM plan with Megatron-LM (--target
megatron-lm, aceso export)": another framework and another search than the one asked for. Now it names Bridge and
the export that runs the plan written, and the table labels the lines as Bridge's."""

from __future__ import annotations

import json

import pytest

from search.cli import main
from search.megatron.importer import read_megatron
from search.spec.cluster import parse_cluster
from search.spec.presets import spec_text
from tests.unit.test_moe_overlap_search import SMALL_MOE


def test_a_bridge_search_says_bridge(tmp_path, capsys):
    model = read_megatron(SMALL_MOE, cluster=parse_cluster("1x8-h100")).plan.model
    spec = tmp_path / "m.json"
    spec.write_text(spec_text(model, "json", title=model.name))
    argv = ["search", "--model", str(spec), "--cluster", "1x8-h100", "--global-batch-size", "16",
            "--budget-evals", "60", "--target", "megatron-bridge", "-o", str(tmp_path / "p.json")]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    het, line = out["lines"]["aceso"]["iteration_ms"], out["lines"]["megatron_lm"]["iteration_ms"]
    assert het > line                                   # CUDA graphs and the EP overlap: not on the aceso runtime
    note = out["aceso_slower"]
    assert "slower than the Megatron-Bridge plan" in note and "aceso export --to megatron-bridge" in note, note
    assert "Megatron-LM" not in note and "--target megatron-lm" not in note, note
    written = json.loads((tmp_path / "p.json").read_text())
    assert written["predicted"]["iteration_time_ms"] == pytest.approx(line, abs=1e-3)    # the plan -o wrote
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "uniform Megatron-Bridge" in text and "\nMegatron-Bridge plan " in text and "Megatron-LM plan" not in text


def test_explain_names_a_bridge_drop_in_line(capsys):
    """``explain --megatron-args ... --framework megatron-bridge``: the drop-in line is a ``--target megatron-bridge``
    search, so it is labelled the best Megatron-Bridge plan (it read "best Megatron-LM plan (drop-in)")."""
    from tests.unit.test_megatron_explain import ARGS
    args = ARGS.replace("--fp16", "--bf16")
    assert main(["explain", "--megatron-args", args, "--cluster", "1x8-h100", "--search-budget-evals", "60",
                 "--framework", "megatron-bridge"]) == 0
    lines = capsys.readouterr().out.splitlines()
    drop_in = next(i for i, line in enumerate(lines) if line.startswith("best Megatron-"))
    assert lines[drop_in].startswith("best Megatron-Bridge plan (drop-in):"), lines[drop_in]
    assert "--target megatron-bridge" in lines[drop_in + 1]
