"""The heterogeneous line of a ``--target megatron-lm`` report on a hybrid model is a plan the aceso runtime runs.

Nemotron-H 56B on 8x8-h200, global batch 768: the Megatron-LM plan runs its Mamba-2 layers under context parallelism
(tp2 cp2), which the aceso runtime does not (the capability table's ``runtime_rules.layers_cp``: the independent
reference, the one pre-flight ``validate --target aceso`` and ``aceso launch`` ask). Before, the report's
heterogeneous line was that same plan (74952.34 ms, "pp 2, 2x(tp2 cp2 dp8 sp)"): ``plan_all`` put the Megatron-LM
plan first in the heterogeneous result as "it also runs on the aceso runtime", without asking the heterogeneous
space, whose seeds it filters by it; and the note said the runtime "prices it slower" where it does not run it."""

from __future__ import annotations

import json

from search.cli import main
from search.spec.plan import load_plan
from search.targets.capabilities import RUNTIME, Device, plan_refusal


def test_the_heterogeneous_line_is_a_plan_the_runtime_runs(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["search", "--model", "nemotron-h-56b", "--cluster", "8x8-h200", "--global-batch-size", "768",
               "--target", "megatron-lm", "--budget-evals", "600", "--json", "-o", str(out)])
    got = json.loads(capsys.readouterr().out)
    assert rc == 0
    why = plan_refusal(load_plan(out), RUNTIME, Device.of("cuda"))     # the drop-in plan (-o): Mamba under cp 2
    assert why is not None and "context parallelism" in why and "cp2" in got["lines"]["megatron_lm"]["plan"]
    het = got["lines"]["aceso"]
    assert " cp" not in het["plan"] and het["iteration_ms"] > got["lines"]["megatron_lm"]["iteration_ms"]
    assert "does not run its stage shape tp 2 cp 2" in got["aceso_slower"], got["aceso_slower"]
