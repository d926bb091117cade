"""``aceso search --json`` names the target the user gave: a ``--target megatron-bridge`` search said
``"target": "megatron-lm"`` (the planner searches Bridge's space as Megatron-LM's, ``planner/api.plan_all``), while
its plan records framework megatron-bridge."""

from __future__ import annotations

import json

import pytest

from search.cli import main


@pytest.mark.parametrize("target, framework", [("megatron-bridge", "megatron-bridge"), ("megatron-lm", "megatron-lm")])
def test_json_target_is_the_users(tmp_path, capsys, target, framework):
    plan_path = tmp_path / "p.json"
    rc = main(["search", "--model", "llama3-8b", "--cluster", "1x8-h100", "--global-batch-size", "64", "--target",
               target, "--budget-evals", "30", "--workers", "1", "--json", "-o", str(plan_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert json.loads(out)["target"] == target
    assert json.loads(plan_path.read_text())["settings"]["framework"] == framework
