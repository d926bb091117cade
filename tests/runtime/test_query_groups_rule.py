"""megatron-core's own TransformerConfig accepts exactly the (heads, query groups, FFN, tp) that
``search.spec.query_groups.tp_refusal`` accepts: tp above the groups where it is a multiple of them (Megatron-Bridge's
Nemotron-3 Nano: tp 4, 2 groups), refused where neither divides the other."""

from __future__ import annotations

import itertools
import warnings

import pytest

from megatron.core.transformer.transformer_config import TransformerConfig
from search.spec.query_groups import tp_refusal

HEADS, FFN = 24, 96 * 24


def _core_accepts(groups: int, tp: int) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            TransformerConfig(num_layers=1, hidden_size=HEADS * 8, num_attention_heads=HEADS, num_query_groups=groups,
                              ffn_hidden_size=FFN, tensor_model_parallel_size=tp)
        except (ValueError, AssertionError):
            return False
    return True


@pytest.mark.parametrize("groups,tp", list(itertools.product((1, 2, 3, 4, 6, 8, 12, 24), (1, 2, 3, 4, 6, 8))))
def test_rule_matches_megatron_core(groups, tp):
    assert (tp_refusal(HEADS, groups, FFN, tp) is None) == _core_accepts(groups, tp)
