"""``aceso search --target megatron-bridge`` of a hybrid model: the ``|``-pattern line is priced as Megatron-LM runs
it (``api._pattern_line``: a ``megatron-lm`` Evaluator at the Megatron-LM release), so the report says so, as a
Megatron-LM alternative to the Bridge lines (before, it stood among the Bridge lines as "Megatron-LM |-pattern"
with no word that it is not a Bridge plan, and its JSON line named no framework)."""

from __future__ import annotations

import json

from search.cli import main

from tests.unit.test_hybrid_megatron_refusal import SPEC as REFUSED

# that test's model with a chunk Megatron-LM's flags set (128), so Megatron-LM and Bridge run it
SPEC = {**REFUSED, "seq_length": 256, "params_dtype": "bf16", "mamba": {**REFUSED["mamba"], "chunk_size": 128}}
PROBLEM = ["--cluster", "1x4-h100", "--global-batch-size", "64", "--budget-evals", "100"]


def _search(tmp_path, target: str, *extra) -> int:
    (tmp_path / "m.json").write_text(json.dumps(SPEC))
    return main(["search", "--model", str(tmp_path / "m.json"), *PROBLEM, "--target", target, *extra])


def test_a_bridge_search_labels_the_pattern_line_megatron_lm(tmp_path, capsys):
    assert _search(tmp_path, "megatron-bridge") == 0
    out = capsys.readouterr().out
    assert "Megatron-Bridge plan" in out
    assert any(line.startswith("Megatron-LM alternative |-pattern ") for line in out.splitlines()), out
    assert _search(tmp_path, "megatron-bridge", "--json") == 0
    lines = json.loads(capsys.readouterr().out)["lines"]
    assert lines["megatron_lm_pattern"]["framework"] == "megatron-lm"


def test_a_megatron_lm_search_keeps_its_label(tmp_path, capsys):
    assert _search(tmp_path, "megatron-lm") == 0
    assert any(line.startswith("Megatron-LM |-pattern ") for line in capsys.readouterr().out.splitlines())


def test_a_bridge_search_writes_the_pattern_file_as_the_megatron_lm_plan_it_is(tmp_path, capsys):
    """``-o plan.json`` writes the |-pattern line beside the plan as ``plan.pattern.json``: in a Bridge search its
    settings said framework megatron-bridge at Bridge's megatron-core (0.16, which runs no hybrid pattern: Megatron-LM
    builds one from core_v0.17), while its line is the Megatron-LM alternative; now it names Megatron-LM and the
    release a Megatron-LM search states (None: the newest), and the Bridge plan beside it keeps Bridge's."""
    out = tmp_path / "plan.json"
    assert _search(tmp_path, "megatron-bridge", "-o", str(out)) == 0
    capsys.readouterr()
    plan, pattern = (json.loads(p.read_text())["settings"] for p in (out, tmp_path / "plan.pattern.json"))
    assert (plan["framework"], plan["release"]) == ("megatron-bridge", "0.16")
    assert (pattern["framework"], pattern.get("release")) == ("megatron-lm", None)
