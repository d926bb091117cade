"""Each Megatron-LM release with hybrid-pattern runs (core_v0.17.1 to core_v0.19.0) reads the CUDA-graph scope
``mamba`` the export writes for it (0.17: ``--cuda-graph-scope``, 0.18+: ``--cuda-graph-modules``) into its own
``TransformerConfig`` (``cuda_graph_scope`` / ``cuda_graph_modules``: ``CudaGraphScope.mamba`` /
``CudaGraphModule.mamba``), with the other scopes of the plan, and validates the line (``validate_args``,
``__post_init__``). Checkouts as for test_megatron_lm_oracle.py; Python 3.12."""

import pytest

from search.megatron.hybrid_pattern import args_line, hybrid_form
from search.megatron.versions import release
from search.settings.stack import CudaGraphs, StackSettings
from search.spec.presets import load_model
from tests.hybrid_plans import cut_plan
from tests.runtime.test_hybrid_pattern_oracle import _oracle


def _graphed(scope: tuple[str, ...]):
    plan = cut_plan(load_model("nemotron-3-nano"), [0, 26, 52], 2, tp=2, sp=True, gbs=8)
    st = StackSettings(cuda_graphs=CudaGraphs(impl="transformer_engine", scope=scope))
    return plan.model_copy(update={"settings": plan.settings.model_copy(update={"stack": st})})


@pytest.mark.parametrize("tag", ["core_v0.17.1", "core_v0.18.2", "core_v0.19.0"])
def test_megatron_lm_reads_the_mamba_scope_it_is_given(tag):
    rel = release(tag)
    scopes = [("mamba",), ("attn", "mamba", "moe_router", "moe_preprocess")]
    plans = [_graphed(s) for s in scopes]
    lines = [args_line(hybrid_form(p, rel)) for p in plans]
    flag = "--cuda-graph-scope" if rel.version < (0, 18) else "--cuda-graph-modules"
    assert all(f"{flag} {' '.join(s)} " in line for s, line in zip(scopes, lines))
    got = _oracle(tag, lines, [p.world_size for p in plans])
    for s, g in zip(scopes, got):
        assert "error" not in g, (s, g)
        assert g["cuda_graphs"] == ["transformer_engine", list(s)], g
