"""The expert-bias update rate is the model's: megatron-core's ``moe_router_bias_update_rate`` (default 1e-3,
TransformerConfig 0.16.1 and 0.19; Megatron-LM ``--moe-router-bias-update-rate``) moves each expert's bias by that much
per step (``moe_utils.get_updated_expert_bias``: ``expert_bias + sign(offset) * rate``). Before, a script's rate was
listed as "ignored ... does not change the plan", so compare's best plan, the import's re-export, the Bridge YAML and
the runtime (which now updates the bias: ``parallel/grads.finish_router_batch``) trained at 1e-3. A rate at its
default dumps as before (plans keep their digests)."""

from __future__ import annotations

import shlex

from search.megatron import megatron_config
from search.megatron.bridge import overrides
from search.megatron.importer import read_megatron
from search.megatron.script import args_line
from search.megatron.versions import release
from search.spec import model_rules
from search.spec.plan import uniform_plan
from search.spec.presets import load_model

FLAG = "--moe-router-bias-update-rate"


def _line() -> str:
    return args_line(megatron_config(uniform_plan(load_model("deepseek-v3", num_layers=4), 1, 1, 8, 8, 64)), release())


def test_an_imported_rate_is_the_models_and_is_exported_again():
    line = _line()
    assert FLAG not in line.split()                     # DeepSeek-V3's 1e-3 is the default: not written
    imp = read_megatron(line + f" {FLAG} 0.01", "run.sh", world_size=8)
    moe = imp.plan.model.moe
    assert moe.moe_router_enable_expert_bias and moe.moe_router_bias_update_rate == 0.01
    assert not any(FLAG in n for n in imp.notes)        # read, not listed as ignored
    again = shlex.split(args_line(megatron_config(imp.plan), release()))
    assert again[again.index(FLAG) + 1] == "0.01"
    assert read_megatron(shlex.join(again), "run.sh", world_size=8).plan.model == imp.plan.model
    # the runtime's TransformerConfig fields and the Bridge YAML say the same rate
    assert model_rules.moe_config(imp.plan.model)["moe_router_bias_update_rate"] == 0.01
    assert overrides(megatron_config(imp.plan))[1]["model"]["moe_router_bias_update_rate"] == 0.01


def test_a_default_rate_dumps_as_before():
    model = load_model("deepseek-v3")
    assert model.moe.moe_router_bias_update_rate == 1e-3
    assert "moe_router_bias_update_rate" not in model.model_dump()["moe"]
    faster = model.moe.model_copy(update={"moe_router_bias_update_rate": 0.01})
    assert faster.model_dump()["moe_router_bias_update_rate"] == 0.01
