"""The exported layout and parallel settings build with megatron-core's own classes (0.16.1, CPU): the layout string
parses with ``PipelineParallelLayerLayout`` and gives each pipeline rank exactly the plan's layers, a
``TransformerConfig`` with the exported recompute / SP / VPP settings constructs and places every layer where the
plan does, and the Bridge override keys are fields of megatron-core's config classes."""

import dataclasses

import pytest
import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from search.io.errors import AcesoError
from search.megatron import megatron_config
from search.megatron.layout import distribution, format_layout, layout_chunk_layers
from search.megatron.names import bridge_fields
from tests.megatron_plans import CASES, case_plan

TC_FIELDS = {f.name for f in dataclasses.fields(TransformerConfig)}
# GPTModelProvider's own fields (Megatron-Bridge v0.3.1, src/megatron/bridge/models/gpt_provider.py)
PROVIDER_FIELDS = {"share_embeddings_and_output_weights", "make_vocab_size_divisible_by", "position_embedding_type",
                   "rotary_base", "seq_length", "vocab_size"}
PIPELINED = sorted(n for n in CASES if not case_plan(n, with_cluster=False).model.is_t5)


@pytest.fixture
def pp_state():
    """megatron-core reads the pipeline rank and virtual size from parallel_state; restore them afterwards."""
    yield
    ps.set_pipeline_model_parallel_rank(None)
    ps.set_virtual_pipeline_model_parallel_world_size(None)


def _plan_chunk_layers(plan):
    """(first layer, layer count) of each model chunk, model order, from the plan's unit spans."""
    starts = plan.model.layer_starts
    return [(starts.index(ch.start_unit), starts.index(ch.end_unit) - starts.index(ch.start_unit))
            for _, _, ch in plan.chunks_in_order()]


@pytest.mark.parametrize("name", PIPELINED)
def test_layout_string_parses_and_gives_each_rank_the_plans_layers(name):
    plan = case_plan(name, with_cluster=False)
    c = megatron_config(plan)
    text = format_layout(c.chunk_layers)          # the layout form, whatever form the export chose
    layout = PipelineParallelLayerLayout(text, c.pp)
    layout.validate_layer_layout(num_layers=plan.model.num_layers, mtp_num_layers=None)
    assert layout.virtual_pipeline_model_parallel_size == c.vpp
    for s, j, ch in plan.chunks_in_order():
        assert layout.layout[s][j].count(LayerType.decoder) == _plan_chunk_layers(plan)[j * c.pp + s][1]
    assert layout_chunk_layers(text, c.pp) == (c.chunk_layers, c.vpp)     # our parser agrees


def _config(c, model_fields: dict) -> TransformerConfig:
    fields = {k: v for k, v in model_fields.items() if k in TC_FIELDS}
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[c.precision]
    return TransformerConfig(**fields, bf16=c.precision == "bf16", fp16=c.precision == "fp16", params_dtype=dtype,
                             pipeline_dtype=dtype, tp_comm_overlap=c.settings.tp_comm_overlap)


@pytest.mark.parametrize("name", sorted(CASES))
def test_transformer_config_constructs_and_places_every_layer_where_the_plan_does(name, pp_state):
    plan = case_plan(name, with_cluster=False)
    c = megatron_config(plan)
    model = bridge_fields(c)["model"]
    assert set(model) - TC_FIELDS <= PROVIDER_FIELDS
    cfg = _config(c, model)
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == \
        (c.recompute.granularity, c.recompute.method, c.recompute.num_layers)
    assert cfg.sequence_parallel == c.sequence_parallel
    assert (cfg.virtual_pipeline_model_parallel_size or 1) == c.vpp
    if plan.model.is_t5:
        return
    vpp = cfg.virtual_pipeline_model_parallel_size
    ps.set_virtual_pipeline_model_parallel_world_size(vpp)
    got = []
    for j in range(c.vpp):
        for s in range(c.pp):
            ps.set_pipeline_model_parallel_rank(s)
            stage = j if vpp else None
            got.append((get_transformer_layer_offset(cfg, vp_stage=stage, pp_rank=s),
                        get_num_layers_to_build(cfg, vp_stage=stage, pp_rank=s)))
    assert got == _plan_chunk_layers(plan)


def test_bridge_ddp_and_optimizer_keys_are_megatron_core_fields():
    for name in CASES:
        b = bridge_fields(megatron_config(case_plan(name, with_cluster=False)))
        assert set(b["ddp"]) <= {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
        assert set(b["optimizer"]) <= {f.name for f in dataclasses.fields(OptimizerConfig)}


GRID = [(L, pp, vpp, first, last, emb, loss)
        for L in (6, 8, 9) for pp in (2, 3, 4) for vpp in (1, 2)
        for first, last in ((None, None), (1, None), (None, 2), (2, 2), (4, None))
        for emb, loss in ((False, False), (True, False), (True, True))]


@pytest.mark.parametrize("L,pp,vpp,first,last,emb,loss", GRID)
def test_distribution_matches_megatron_core(L, pp, vpp, first, last, emb, loss, pp_state):
    """``layout.distribution`` (the importer's reading of the uneven flags) against megatron-core's own count;
    ours raises exactly where megatron-core raises (or would build an empty middle chunk, which plans cannot hold;
    an end chunk with no layer, holding only the embedding / loss, is a plan's ``holds_only`` chunk)."""
    try:
        theirs = _megatron_distribution(L, pp, vpp, first, last, emb, loss)
    except (AssertionError, ValueError):
        theirs = None
    try:
        ours = distribution(L, pp, vpp, first, last, emb, loss)
    except AcesoError:
        ours = None
    if theirs is not None and min(theirs[1:-1], default=1) < 1:
        theirs = None
    assert ours == theirs


def _megatron_distribution(L, pp, vpp, first, last, emb, loss):
    cfg = TransformerConfig(num_layers=L, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=pp,
                            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                            num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                            account_for_embedding_in_pipeline_split=emb, account_for_loss_in_pipeline_split=loss,
                            pipeline_dtype=torch.float32)
    ps.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
    out = []
    for j in range(vpp):
        for s in range(pp):
            ps.set_pipeline_model_parallel_rank(s)
            out.append(get_num_layers_to_build(cfg, vp_stage=j if vpp > 1 else None, pp_rank=s))
    if sum(out) != L:
        raise AssertionError(f"megatron-core builds {sum(out)} of {L} layers")
    return tuple(out)
