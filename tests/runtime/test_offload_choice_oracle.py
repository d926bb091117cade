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


# The offload with CUDA graphs and with MoE recompute, per release: the import (stack.offload_graphs_refusal,
# stack.moe_recompute_offload_refusal, read under that release) refuses a line exactly when that release's own
# validate_args / TransformerConfig does (0.16 / 0.17: no rule for the two together; 0.18: transformer_engine graphs
# only, never the moe scope; 0.19: local graphs too with the experts' offload alone, and no expert offload inside a
# recomputed MoE layer)
RULE_LINE = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 8 --ffn-hidden-size 2048 --seq-length 1024 "
             "--max-position-embeddings 1024 --position-embedding-type rope --normalization RMSNorm --swiglu "
             "--untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 "
             "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 512 --expert-model-parallel-size 1 "
             "--moe-token-dispatcher-type alltoall --moe-grouped-gemm --micro-batch-size 1 --global-batch-size 16 "
             "--bf16 --tokenizer-type NullTokenizer --vocab-size 31999 --fine-grained-activation-offloading ")
RULE_CASES = {      # name: (flags after RULE_LINE, the releases that refuse it)
    "te attn + router, core_attn": ("--offload-modules core_attn attn_proj --cuda-graph-impl transformer_engine "
                                    "--cuda-graph-scope attn moe_router moe_preprocess", set()),
    "local attn, core_attn": ("--offload-modules core_attn --cuda-graph-impl local --cuda-graph-scope attn",
                              {"core_v0.18.2", "core_v0.19.0"}),
    "local router, moe_act": ("--offload-modules moe_act --cuda-graph-impl local --cuda-graph-scope moe_router "
                              "moe_preprocess", {"core_v0.18.2"}),
    "te moe scope, expert_fc1": ("--offload-modules expert_fc1 --cuda-graph-impl transformer_engine --cuda-graph-scope "
                                 "attn moe --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity",
                                 {"core_v0.18.2", "core_v0.19.0"}),
    "moe recompute, expert_fc1": ("--offload-modules expert_fc1 --recompute-granularity selective "
                                  "--recompute-modules moe", {"core_v0.19.0"}),
}


@pytest.mark.parametrize("tag", TAGS)
def test_the_import_refuses_the_offload_rules_as_each_release_does(tag, monkeypatch):
    from types import SimpleNamespace

    from search.io.errors import AcesoError
    from search.megatron.importer import read_megatron
    monkeypatch.setitem(os.environ, "NVTE_CPU_OFFLOAD_V1", "1")
    names = list(RULE_CASES)
    lines = [RULE_LINE + RULE_CASES[n][0] for n in names]
    got = _oracle([SimpleNamespace(world_size=8)] * len(lines), tag, lines)
    for name, line, theirs in zip(names, lines, got):
        try:
            read_megatron(line, world_size=8, version=tag)
            ours = None
        except AcesoError as e:
            ours = str(e)
        assert ("error" in theirs) == (tag in RULE_CASES[name][1]), (name, theirs)
        assert (ours is not None) == ("error" in theirs), (name, ours, theirs)
        assert ours is None or "\n" not in ours
