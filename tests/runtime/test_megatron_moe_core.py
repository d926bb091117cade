"""MoE export / import against megatron-core 0.16.1 itself (installed): its ``PipelineParallelLayerLayout`` places
decoder and MTP layers where our layout parser does (and refuses what it refuses), and every Megatron-Bridge MLA
field we write is a field of its ``MLATransformerConfig`` (Bridge v0.3.1's ``MLAModelProvider`` base; its
Megatron-LM submodule is core_v0.16.1)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.transformer_config import MLATransformerConfig
from search.io.errors import AcesoError
from search.megatron.bridge import overrides
from search.megatron.layout import layout_chunk_layers
from tests.megatron_moe_plans import MOE_CASES, moe_case_config

# (layout, pp, decoder layers, mtp layers)
LAYOUTS = [("Et*4|(t*4|)*14tmL", 4, 61, 1), ("Et*4|(t*4|)*14tL", 4, 61, 0), ("Et*2|t*2|mmL", 3, 4, 2),
           ("E,t,t|t,t,m,L", 2, 4, 1), ("Et*3|(t*4|)*3t*2mL", 5, 17, 1), ("Et|(tt|)*4,t,m,L", 2, 10, 1)]


@pytest.mark.parametrize("text,pp,layers,mtp", LAYOUTS)
def test_layout_places_decoder_and_mtp_layers_as_megatron_core(text, pp, layers, mtp):
    ref = PipelineParallelLayerLayout(text, pp)
    ref.validate_layer_layout(layers, mtp or None)
    chunks, vpp = layout_chunk_layers(text, pp, mtp)
    assert vpp == ref.virtual_pipeline_model_parallel_size
    model_order = [ref.layout[r][v] for v in range(vpp) for r in range(pp)]   # chunk k = (vpp k // pp, rank k % pp)
    assert chunks == tuple(c.count(LayerType.decoder) for c in model_order)
    assert model_order[-1].count(LayerType.mtp) == mtp                         # the MTP block: the last chunk


@pytest.mark.parametrize("text,pp,layers,mtp", [("Et*2|t*2L", 2, 4, 1), ("Et|mt|t|tL", 2, 4, 1),
                                                ("Et*2|t*2mmL", 2, 4, 1)])
def test_layouts_megatron_core_refuses_are_refused(text, pp, layers, mtp):
    with pytest.raises(AssertionError):
        PipelineParallelLayerLayout(text, pp).validate_layer_layout(layers, mtp)
    with pytest.raises(AcesoError):
        layout_chunk_layers(text, pp, mtp)


def test_bridge_mla_fields_are_mla_transformer_config_fields():
    names = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    for case in MOE_CASES:
        c = moe_case_config(case)
        if c.model.mla is not None:
            model = overrides(c)[1]["model"]
            assert {"q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                    "multi_latent_attention"} <= set(model) and set(model) - names <= {
                "vocab_size", "make_vocab_size_divisible_by", "seq_length", "share_embeddings_and_output_weights",
                "position_embedding_type", "rotary_base", "transformer_impl"}     # GPTModelProvider's own
