"""The model settings megatron-core (and Megatron-LM's validate_args) refuse at model build are refused by aceso
in one place (``search.spec.model_rules``), for spec files, presets, HF imports and Megatron-LM command lines alike
(issue 32). The cases are tests/model_rule_cases.py's; tests/runtime/test_model_rules_megatron.py shows megatron-core
refuses each broken one and builds each fixed one."""

from __future__ import annotations

import pytest

from search.spec import model_rules
from search.io.errors import AcesoError
from search.megatron.importer import read_megatron
from search.spec.model import ModelSpec
from search.spec.presets import load_model
from tests.model_rule_cases import CORE, MEGATRON_LM


@pytest.mark.parametrize("rule", sorted(CORE))
def test_each_core_rule_refuses_the_broken_config_and_takes_the_fixed_one(rule):
    _cls, broken, fixed = CORE[rule]
    assert model_rules.refusal(broken, model_rules.flag_name)
    assert model_rules.refusal(fixed, model_rules.flag_name) is None


@pytest.mark.parametrize("rule", sorted(MEGATRON_LM))
def test_each_validate_args_rule_refuses_the_command_line(rule):
    broken, fixed, fields = MEGATRON_LM[rule]
    assert model_rules.refusal(fields, model_rules.flag_name)
    with pytest.raises(AcesoError, match="arguments.py"):
        read_megatron(broken, world_size=1)
    read_megatron(fixed, world_size=1)


def test_every_rule_has_a_case_and_cites_its_source():
    """The table and the cases cover each other: every rule is broken by exactly one family of cases."""
    cases = [c[1] for c in CORE.values()] + [c[2] for c in MEGATRON_LM.values()]
    hit = {i for cfg in cases for i, r in enumerate(model_rules.RULES) if r.broken(cfg)}
    assert hit == set(range(len(model_rules.RULES)))
    assert all("transformer_config.py:" in r.source or "arguments.py:" in r.source for r in model_rules.RULES)


def test_a_spec_names_its_own_fields_and_a_negative_capacity_is_dropless():
    base = load_model("qwen3-30b-a3b").model_dump()
    with pytest.raises(ValueError, match="moe.moe_router_enable_expert_bias .* needs moe.moe_router_score_function "
                                         "sigmoid"):
        ModelSpec.model_validate({**base, "moe": {**base["moe"], "moe_router_enable_expert_bias": True}})
    spec = ModelSpec.model_validate({**base, "moe": {**base["moe"], "moe_expert_capacity_factor": -1}})
    assert spec.moe.moe_expert_capacity_factor is None      # megatron-core: a negative factor is None, dropless
    ds = load_model("deepseek-v3").model_dump()
    for bad, needle in (({"position_embedding": "learned", "rope_scaling": None},
                         "mtp_num_layers with learned absolute positions"),
                        ({"num_query_groups": 8}, "mla and num_query_groups")):
        with pytest.raises(ValueError, match=needle):
            ModelSpec.model_validate({**ds, **bad})


def test_a_negative_capacity_factor_imports_as_dropless():
    """Issue 32: ``--moe-expert-capacity-factor -1`` was refused; megatron-core reads a negative factor as None
    (transformer_config.py:1105-1107), so it is the same plan as no factor."""
    line = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
            "--micro-batch-size 1 --global-batch-size 8 --tokenizer-type NullTokenizer --vocab-size 128 "
            "--num-experts 8 --moe-router-topk 2 ")
    a = read_megatron(line + "--moe-expert-capacity-factor -1", world_size=1).plan
    assert a.model.moe.moe_expert_capacity_factor is None
    assert a.model_dump() == read_megatron(line, world_size=1).plan.model_dump()
