"""`aceso explain PLAN` as a user meets it (issue "Right answers", user audit 2).

- A plan searched with `--attention unfused` (the README's advice without transformer-engine) is explained with
  the kernel its prediction assumed (`explain --help`: "default: what the plan's prediction assumed"), so explain
  and the search agree (docs/megatron.md, "One pricing"); it was explained with flash attention: GPT-1.3B on
  1x8-h100 at 308.7 ms against the search's 582.4 ms.
- A plan predicted by another cost model (searched with `--cost-model profile --db DB`) explained without it says
  that the numbers are the analytic model's and how to get the search's own."""

import json

import pytest

from search.cli import main


@pytest.fixture(scope="module")
def unfused_plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("unfused") / "plan.json"
    assert main(["search", "--model", "gpt-1.3b", "--cluster", "1x8-h100", "--global-batch-size", "64",
                 "--attention", "unfused", "--budget-s", "2", "-o", str(path)]) == 0
    return path


def explain_json(capsys, *argv) -> dict:
    capsys.readouterr()
    assert main(["explain", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_explain_prices_with_the_attention_the_plan_was_searched_with(unfused_plan, capsys):
    recorded = json.loads(unfused_plan.read_text())["predicted"]
    assert recorded["attention"] == "unfused"
    got = explain_json(capsys, str(unfused_plan))
    assert got["iteration_time_ms"] == pytest.approx(recorded["iteration_time_ms"], rel=1e-6)
    assert got["max_memory_mib"] == pytest.approx(max(recorded["stage_memory_mib"]), rel=1e-6)
    flash = explain_json(capsys, str(unfused_plan), "--attention", "flash")   # an explicit choice still wins
    assert flash["iteration_time_ms"] < 0.9 * got["iteration_time_ms"]


def test_plan_of_another_cost_model_is_named(unfused_plan, tmp_path, capsys):
    data = json.loads(unfused_plan.read_text())
    data["predicted"]["cost_model"] = "profile"
    other = tmp_path / "profiled.json"
    other.write_text(json.dumps(data))
    notes = explain_json(capsys, str(other))["notes"]
    assert any("profile cost model" in n and "--cost-model profile --db" in n for n in notes), notes
    assert not explain_json(capsys, str(unfused_plan))["notes"]
