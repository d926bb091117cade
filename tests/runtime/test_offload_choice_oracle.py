"""The search's fine-grained offload choice (search/planner/fine_offload.py) as Megatron-LM runs it: the found plan's
exported line is parsed and validated by each release's own parser (core_v0.16.1 to core_v0.19.0, in the environment
the exported script sets: ``NVTE_CPU_OFFLOAD_V1=1``) and megatron-core's TransformerConfig holds the offload as the
search priced it (megatron_lm_oracle.py)."""

import os

import pytest

from search.megatron import megatron_config
from search.megatron.script import args_line
from search.megatron.versions import release
from search.planner.state import to_plan
from search.spec.cluster import parse_cluster
from tests.runtime.test_megatron_lm_oracle import TAGS, _oracle
from tests.unit.test_search_offload_choice import GBS, MODEL, _search


@pytest.mark.parametrize("tag", TAGS)
def test_megatron_lm_takes_the_searched_offload(tag, monkeypatch):
    _, best, _ = _search()
    plan = to_plan(best, MODEL, parse_cluster("1x8-h100"), GBS, "analytic", predicted=False)
    line = args_line(megatron_config(plan), release(tag))
    assert "--fine-grained-activation-offloading" in line.split()
    monkeypatch.setitem(os.environ, "NVTE_CPU_OFFLOAD_V1", "1")
    got = _oracle([plan], tag, [line])[0]
    assert "error" not in got, got
    assert got["fine_grained_offload"] == [True, ["core_attn"], 1.0]
    assert got["recompute"][0] is None                  # no recompute: the offload made the room
