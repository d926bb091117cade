"""The search's ``Megatron-LM |-pattern`` line starts from the Megatron-LM plan as it is (docs/search.md: "never
slower than either seed"). A Megatron-LM setting ``full block N`` counts layers; a GPT layer is two hybrid layers
(``block 2N`` in the pattern), but a Nemotron-H layer is one: doubling it there priced another setting than the
seed's, and the line came out slower than the Megatron-LM plan it refines (nemotron-h-8b on 1x8-h100, 30000 MiB:
9881.9 ms against 9772.7 ms, its recompute lost) and printed ``block 104 layers`` for Nano's 52."""

import json

from search.cli import main
from search.megatron.config import Recompute
from search.megatron.hybrid_pattern import unit_choices
from search.planner.hybrid_cuts import hybrid_setting
from search.spec.presets import load_model


def test_block_counts_layers_as_megatron_lm_does():
    """``block N`` over the pattern recomputes the same units as Megatron-LM's ``block N`` over the model's layers:
    a chunk's first N layers (GPT: 2N units, attention and MLP halves; Nemotron-H: N units, one per layer)."""
    for name, per_layer in (("gpt-1.3b", 2), ("nemotron-h-8b", 1), ("nemotron-3-nano", 1)):
        model = load_model(name)
        got = unit_choices(hybrid_setting(Recompute("full", "block", 3), model), model, 0, 12)
        assert got == ["full"] * (3 * per_layer) + ["none"] * (12 - 3 * per_layer), name


def test_pattern_line_is_never_slower_than_the_megatron_lm_plan(capsys):
    assert main(["search", "--model", "nemotron-h-8b", "--cluster", "1x8-h100", "--global-batch-size", "64",
                 "--target", "megatron-lm", "--pp", "2", "4", "--budget-evals", "200",
                 "--memory-limit-mib", "30000", "--json"]) == 0
    lines = json.loads(capsys.readouterr().out)["lines"]
    mlm, pattern = lines["megatron_lm"], lines["megatron_lm_pattern"]
    assert "recompute full (block, 3 layers)" in mlm["plan"]        # the scenario: a block setting is the best
    assert pattern["iteration_ms"] <= mlm["iteration_ms"]
    assert pattern["iteration_ms"] <= lines["uniform"]["iteration_ms"]
