"""What megatron-core 0.16.1 allocates per rank, built on the meta device: parameters of every pipeline rank.

``megatron_core_params(model, tp, pp, chunk_layers)`` builds each pipeline rank's model chunks with megatron-core's
own ``GPTModel`` / ``T5Model`` (local layer specs) under ``torch.device("meta")`` -- shapes only, no memory, no
initialisation -- with ``pre_process`` on the first model chunk, ``post_process`` on the last, the
``pipeline_model_parallel_layout`` of the chunks (uneven and interleaved layouts) and ``vp_stage`` per chunk, and
sums the parameters it allocates per rank (one TP rank; all TP ranks are alike). Process groups only report a size
and this rank's index (``model.meta_groups.Group``): construction never communicates; the embedding group is left out, so the tied
copy's start-up all-reduce is skipped (it allocates nothing). DP and CP are not built: neither changes what a rank
allocates (CP touches only the attention core, which holds no parameters; megatron-core's local spec refuses CP).

Needs an initialised ``torch.distributed`` (megatron-core reads group sizes only then): ``world_of_one``.
Used by tests/runtime/test_param_counts.py and bench/megatron_memory.py against the planner's counts.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

from model_specs.builders import architecture_kwargs, bind_tp_group, t5_layer_specs
from model_specs.extensions import megatron_kwargs
from search.megatron.layout import format_layout
from search.spec.model import ModelSpec

from ..model.meta_groups import meta_groups


@contextlib.contextmanager
def world_of_one():
    """A 1-rank gloo ``torch.distributed`` group for the duration (nothing if one exists already)."""
    if torch.distributed.is_initialized():
        yield
        return
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def _config(model: ModelSpec, tp: int, pp: int, chunks: tuple[int, ...]):
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra: dict = {}
    if pp > 1:
        extra = dict(pipeline_dtype=torch.bfloat16,
                     pipeline_model_parallel_layout=PipelineParallelLayerLayout(format_layout(chunks), pp))
    if len(chunks) > pp:
        extra["virtual_pipeline_model_parallel_size"] = len(chunks) // pp
    return TransformerConfig(**architecture_kwargs(model, dtype="bf16"), tensor_model_parallel_size=tp,
                             pipeline_model_parallel_size=pp, use_cpu_initialization=True,
                             perform_initialization=False, **extra, **megatron_kwargs(model))


@contextlib.contextmanager
def _pipeline_rank(vpp: int):
    """A layout reads the pipeline rank and the virtual size from ``parallel_state``: set, then cleared."""
    from megatron.core import parallel_state as ps

    ps.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
    try:
        yield ps.set_pipeline_model_parallel_rank
    finally:
        ps.set_pipeline_model_parallel_rank(None)
        ps.set_virtual_pipeline_model_parallel_world_size(None)


def build_chunk(model: ModelSpec, tp: int, pp: int, chunks: tuple[int, ...], rank: int, vp: int):
    """Model chunk ``vp`` of pipeline rank ``rank`` as megatron-core builds it (call under the meta device)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = meta_groups(tp, pp, rank)
    if model.is_t5:    # T5Model builds its LanguageModule with the default groups: ours, for the build only
        from megatron.core.models.T5 import T5Model

        enc_spec, dec_spec = t5_layer_specs(model, te=False)     # (CrossAttention's linears read the global TP
        dec_spec = bind_tp_group(dec_spec, groups.tp)              # group, which Megatron-LM sets: bound here)
        cfg, enc_cfg = _config(model, tp, 1, (model.num_decoder_layers,)), _config(model, tp, 1, (model.num_layers,))
        with mock.patch.object(ProcessGroupCollection, "use_mpu_process_groups", lambda *a, **k: groups):
            return T5Model(cfg, enc_cfg, enc_spec, dec_spec, vocab_size=model.padded_vocab_size,
                           max_sequence_length=max(model.seq_length, model.decoder_seq_length),
                           share_embeddings_and_output_weights=model.tied_embeddings, pg_collection=groups)
    vpp = len(chunks) // pp
    spec = get_gpt_layer_local_spec(qk_layernorm=bool((model.megatron or {}).get("qk_layernorm")),
                                    normalization="RMSNorm" if model.normalization == "rmsnorm" else "LayerNorm")
    return GPTModel(_config(model, tp, pp, chunks), spec, vocab_size=model.padded_vocab_size,
                    max_sequence_length=model.seq_length, pre_process=(rank, vp) == (0, 0),
                    post_process=(rank, vp) == (pp - 1, vpp - 1),
                    share_embeddings_and_output_weights=model.tied_embeddings,
                    position_embedding_type="rope" if model.position_embedding == "rope" else "learned_absolute",
                    pg_collection=groups, vp_stage=vp if vpp > 1 else None)


def megatron_core_params(model: ModelSpec, tp: int, pp: int, chunk_layers: tuple[int, ...] | None = None,
                         ranks: list[int] | None = None) -> dict[int, int]:
    """Parameters megatron-core allocates on each pipeline rank in ``ranks`` (default all), summed over its model
    chunks; ``chunk_layers``: layers per model chunk in model order (default: even, one chunk per rank)."""
    chunks = tuple(chunk_layers) if chunk_layers else (model.num_layers // pp,) * pp
    vpp = len(chunks) // pp
    out = {}
    with torch.device("meta"), _pipeline_rank(vpp) as set_rank:
        for r in ranks if ranks is not None else range(pp):
            set_rank(r)
            out[r] = sum(p.numel() for j in range(vpp) for p in build_chunk(model, tp, pp, chunks, r, j).parameters())
    return out
