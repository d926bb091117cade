"""Every field the Megatron-Bridge export writes exists in Megatron-Bridge v0.3.1's own config dataclasses
(search/megatron/data/bridge_fields_v0.3.1.json, read from its source by bench/megatron_reference_lists.py),
and the values follow Bridge's semantics where a name alone does not say them (issue 21)."""

from __future__ import annotations

import json
import os

import pytest

from search.megatron.bridge import overrides, recipe_for
from tests.megatron_plans import CASES, case_config

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "search", "megatron", "data", "bridge_fields_v0.3.1.json")
REF = json.load(open(DATA))
BRIDGE = [n for n in CASES if not n.startswith("t5") and n != "llama-pp4-tp-comm-overlap"]


def test_reference_list_names_the_release_and_holds_the_known_fields():
    assert "v0.3.1" in REF["source"] and "9c9dd848966322fc3ed7706747ec13219ef49dda" in REF["source"]
    f = REF["fields"]
    # spot checks against Bridge v0.3.1 source: GPTDatasetConfig is megatron-core's with `sequence_length`;
    # `seq_length` is Bridge's property alias with a setter (a YAML override sets it through setattr)
    assert "sequence_length" in f["dataset"] and "seq_length" not in f["dataset"]
    assert REF["settable"] == {"dataset": ["seq_length"]}
    assert {"micro_batch_size", "global_batch_size"} <= set(f["train"])
    assert {"tp_comm_overlap", "defer_embedding_wgrad_compute"} <= set(f["comm_overlap"])


@pytest.mark.parametrize("name", BRIDGE + ["llama-pp4-tp-comm-overlap-gpt"])
def test_every_exported_field_is_a_bridge_field(name):
    if name.endswith("-gpt"):                     # tp_comm_overlap goes through the GPT recipe's comm_overlap
        c = case_config("gpt-cp2-sp-distopt")
        c = c.__class__(**{**c.__dict__, "settings": c.settings.model_copy(update={"tp_comm_overlap": True})})
    else:
        c = case_config(name)
    recipe, ov = overrides(c)
    for section, fields in ov.items():
        if section == "mixed_precision" and not isinstance(fields, dict):
            assert fields is None or fields in REF["fields"]["mixed_precision_recipes"], fields
            continue
        if "_target_" in fields:        # a config object (Bridge's instantiate: _target_ names the dataclass)
            assert fields["_target_"].rsplit(".", 1)[1] == REF["sections"][section].split(":")[1], fields["_target_"]
            fields = {k: v for k, v in fields.items() if k not in ("_target_", "_call_")}
        unknown = set(fields) - set(REF["fields"][section]) - set(REF["settable"].get(section, []))
        assert not unknown, f"{recipe}: {section}.{sorted(unknown)} are not Megatron-Bridge v0.3.1 fields"


def test_tokenizer_vocabulary_is_v_minus_one_as_megatron_lm():
    """Bridge v0.3.1 builds NullTokenizer with megatron-core's tokenizer (legacy_tokenizer false by default),
    whose vocab_size is the given value + 1 (the EOD token), as Megatron-LM's --vocab-size."""
    c = case_config("gpt-pp1-dp8")
    _, ov = overrides(c)
    assert ov["tokenizer"] == {"tokenizer_type": "NullTokenizer", "vocab_size": c.model.vocab_size - 1}
    assert ov["dataset"] == {"seq_length": c.model.seq_length}
    assert recipe_for(c) == "gpt3_175b_pretrain_config"
