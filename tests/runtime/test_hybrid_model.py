"""Stages as megatron-core's hybrid layer pattern (``aceso_megatron.model.hybrid``): the pattern of units, a chunk's
layers placed by megatron-core's ``HybridStack`` where the installed megatron-core has the hybrid models (0.19; a
plain list on 0.16.1), and a one-stage plan equal to a single-process stock ``HybridModel`` built from the same
pattern (loss and every gradient). The pipelined plans against ``HybridModel``: tests/distributed/test_hybrid_plans.py.
"""

from __future__ import annotations

import pytest

from patches.compat import have_hybrid
from tests.runtime.test_layer_specs import assert_equal, plan
from tests.tiny_models import GPT, LLAMA, T5

needs_hybrid = pytest.mark.skipif(not have_hybrid(), reason="megatron-core without models.hybrid (before 0.19)")


@pytest.fixture(scope="module")
def single_process():
    from aceso_megatron.testing import free_port
    from aceso_megatron.testing.reference import init_single_process

    init_single_process(free_port())


def test_units_are_hybrid_layer_symbols():
    from aceso_megatron.model.hybrid import pattern
    from search.layers.moe_spec import MoESpec

    assert pattern(GPT, list(GPT.units)) == "*-*-"
    assert pattern(LLAMA, list(LLAMA.units)[1:3]) == "-*"
    moe = GPT.model_copy(update={"num_layers": 3, "add_bias_linear": False,
                                 "moe": MoESpec(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                                                first_k_dense_layers=1)})
    assert pattern(moe, list(moe.units)) == "*-*E*E"
    assert pattern(T5, list(T5.units)) is None            # cross-attention is no hybrid layer


@needs_hybrid
def test_pattern_symbols_are_megatron_cores():
    from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
    from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols

    from aceso_megatron.model.hybrid import hybrid_layers

    slots = {f for f in HybridStackSubmodules.__dataclass_fields__}
    assert {k.symbol for k in hybrid_layers()} <= Symbols.VALID_LAYERS
    assert {k.hybrid_slot for k in hybrid_layers()} <= slots
    assert {(k.symbol, k.hybrid_slot) for k in hybrid_layers()} == {
        (Symbols.ATTENTION, "attention_layer"), (Symbols.MLA, "mla_layer"), (Symbols.MLP, "mlp_layer"),
        (Symbols.MOE, "moe_layer"), (Symbols.MAMBA, "mamba_layer"), (Symbols.GDN, "gdn_layer")}


def test_a_chunk_is_a_hybrid_stack_where_megatron_core_has_one(single_process):
    from aceso_megatron.training.engine import build_runtime

    rt = build_runtime(plan(GPT, (0, 4, ["none", "selective", "full", "none"])), 0, 1, seed=1)
    chunk = rt.stage_module
    if have_hybrid():
        from megatron.core.models.hybrid.hybrid_block import HybridStack

        assert isinstance(chunk.decoder, HybridStack) and chunk.decoder.layer_type_list == list("*-*-")
        assert chunk.units is chunk.decoder.layers
        assert [u.unit.kind for u in chunk.units] == ["attention", "mlp"] * 2
    else:
        assert not hasattr(chunk, "decoder") and len(chunk.units) == 4
    # the canonical names are GPTModel's either way
    names = chunk.canonical_names()
    assert "decoder.layers.1.mlp.linear_fc1.weight" in names.values()
    assert sum(1 for _ in chunk.parameters()) == len(names)


@needs_hybrid
@pytest.mark.parametrize("model, rc", [
    (GPT, ["attn_dropout", "selective", "full", "none"]),
    (LLAMA, ["selective", "full", "none", "selective"]),
])
def test_one_stage_equals_stock_hybrid_model(single_process, model, rc):
    from aceso_megatron.testing import make_batches
    from aceso_megatron.testing.reference import Reference
    from aceso_megatron.training.engine import TrainConfig, build_runtime

    tc = TrainConfig(lr=1e-3)
    rt = build_runtime(plan(model, (0, 4, rc)), 0, 1, seed=5, train_config=tc)
    batches = make_batches(model, rt.plan.micro_batch_size, rt.plan.global_batch_size, 5)
    got = rt.forward_backward(iter(batches)), rt.full_grads()
    ref = Reference(model, seed=5, train_config=tc, hybrid=True)
    assert type(ref.gpt).__name__ == "HybridModel"
    assert_equal(got, (ref.forward_backward(batches), ref.grads()))
