"""Multi-token prediction on the last stage: megatron-core's ``MultiTokenPredictionBlock`` and its loss, as stock
``GPTModel`` builds and computes them.

The plan's ``mtp`` units (``search.spec.model``: one per MTP layer, after the last decoder layer) are the last units
of the last chunk of the last stage; that chunk builds one ``MultiTokenPredictionBlock`` of them (canonical names
``mtp.layers.<j>.*``, as ``GPTModel``'s) from megatron-core's MTP layer spec (``get_mtp_layer_spec_for_backend``)
around the spec of the last decoder layer (stock ``get_gpt_mtp_block_spec`` takes ``layer_specs[-1]``), with the
stage's groups bound where megatron-core 0.16.1 builds without them (the transformer layer's ``pg_collection``,
``eh_proj``'s ``tp_group``: ``patches.compat.mtp_layer_spec``; the two mappings it calls without a group:
``patches.mla_mtp_tp_group``), and the
sequence-parallel norms of an SP stage. With ``mtp_use_repeated_layer`` (megatron-core 0.17 on; the stage's config
carries it) the block is built of one layer spec, as stock ``get_gpt_mtp_block_spec``: one layer (``mtp.layers.0``)
run at every depth, the plan's later ``mtp`` units without weights of their own.

The chunk also holds a copy of the embedding (stock: "MTP needs both embedding layer and output layer"; tied: the
output layer uses it, as ``shared_embedding_or_output_weight``), whose gradients are summed with the first
stage's (``parallel.grads``, an embedding stage like a tied last stage).

``mtp_loss`` follows ``GPTModel._postprocess``: the hidden states after the final norm are the main output and one
output per MTP layer; layer ``j``'s logits (the shared output layer) against the labels rolled ``j + 1`` to the
left (the last positions masked, ``roll_tensor``), scaled ``mtp_loss_scaling_factor / mtp_num_layers``, enter the
backward through ``MTPLossAutoScaler``: divided by the micro-batch's count of rolled mask tokens (megatron-core's
default), or not (``calculate_per_token_loss``: the gradients are divided by the main loss's global token count
instead, and megatron-core 0.19's ``process_mtp_loss`` weighs layer ``j``'s loss by the micro-batch's tokens before
rolling over those left after it: ``patches.compat.mtp_loss_scale``, 1 on 0.16.1); the schedule sets the scaler's
scale (``engine``: the same loss scale as the main loss). The reported loss stays the main loss, as in stock
training.
"""

from __future__ import annotations

import dataclasses
import torch

from model_specs.builders import bind_tp_group, layer_spec

from .norms import sequence_parallel_norm

UNIT = "mtp"


def block_spec(model, config, pg_collection, te: bool):
    """The ``MultiTokenPredictionBlockSubmodules`` of ``model``'s MTP layers for a stage with ``config``."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlockSubmodules

    from patches.compat import mtp_layer_spec

    if te:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        backend = TESpecProvider()
    else:
        backend = LocalSpecProvider()
    # the MTP depth's inner layer: GPTModel's last decoder layer; a hybrid model's '/' pattern (its attention and MLP
    # or MoE layer, '*-' / '*E': one TransformerLayer computes what HybridModel's inner HybridStack of the two does)
    layer = model.num_layers if model.hybrid_layer_pattern else model.num_layers - 1
    last = layer_spec(model, "decoder", te, layer, bool(getattr(config, "moe_grouped_gemm", False)))
    last = bind_tp_group(last, pg_collection.tp)
    if config.sequence_parallel:
        from .norms import with_sequence_parallel_norms

        last = with_sequence_parallel_norms(last)
    spec = mtp_layer_spec(last, backend, pg_collection)   # with the stage's groups where megatron-core omits them
    sub = spec.submodules
    norm = sequence_parallel_norm if config.sequence_parallel else (lambda s: s)
    sub = dataclasses.replace(sub, enorm=norm(sub.enorm), hnorm=norm(sub.hnorm), layer_norm=norm(sub.layer_norm))
    spec = dataclasses.replace(spec, submodules=sub)
    # shared (``mtp_use_repeated_layer``, in the config): one layer, run at every depth, as get_gpt_mtp_block_spec
    return MultiTokenPredictionBlockSubmodules(layer_specs=[spec] * (1 if model.mtp_use_repeated_layer
                                                                     else model.mtp_num_layers))


def build_block(model, config, pg_collection, te: bool):
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    return MultiTokenPredictionBlock(config=config, spec=block_spec(model, config, pg_collection, te),
                                     pg_collection=pg_collection)


def reset_loss_tracker(num_layers: int | None = None) -> None:
    """Drop megatron-core's MTP loss-logging tracker (``MTPLossLoggingHelper.tracker``, one process-wide dict whose
    ``values`` tensor is sized by the first MTP model's depth) unless it already has ``num_layers`` entries, so a
    process that builds models of another MTP depth (a test running several plans) logs into a tensor of its size."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from patches.compat import mtp_tracker_key

    values = MTPLossLoggingHelper.tracker.get(mtp_tracker_key())
    if num_layers is None or values is None or values.numel() != num_layers:
        MTPLossLoggingHelper.tracker.clear()


def mtp_loss(stage, hidden: torch.Tensor, labels: torch.Tensor, loss_mask) -> torch.Tensor:
    """The main hidden states of ``hidden`` (main and MTP outputs concatenated on the sequence) with every MTP
    layer's loss attached for the backward (``MTPLossAutoScaler``), as ``GPTModel._postprocess``."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, roll_tensor

    from patches.compat import mtp_loss_scale, save_mtp_loss

    cfg = stage.config
    n = cfg.mtp_num_layers
    parts = torch.chunk(hidden, 1 + n, dim=0)
    hidden, cp = parts[0], stage.pg_collection.cp
    mtp_labels = labels.clone()
    mask = torch.ones_like(mtp_labels) if loss_mask is None else loss_mask
    original_tokens = mask.sum()   # megatron-core 0.19 weighs layer j by these over the tokens left after rolling
    if stage.training:
        reset_loss_tracker(n)
    for j in range(n):
        logits, _ = stage.output_layer(parts[j + 1], weight=stage.output_weight())
        mtp_labels, _ = roll_tensor(mtp_labels, shifts=-1, dims=-1, cp_group=cp)
        mask, num_tokens = roll_tensor(mask, shifts=-1, dims=-1, cp_group=cp)
        loss = mask * stage._loss(logits, mtp_labels)
        if stage.training:
            save_mtp_loss(torch.sum(loss) / num_tokens, j, n, avg_group=stage.pg_collection.dp_cp)
        scale = cfg.mtp_loss_scaling_factor / n
        if cfg.calculate_per_token_loss:
            scale = scale * mtp_loss_scale(original_tokens, num_tokens)   # 1 on 0.16.1 (patches.compat)
            hidden = MTPLossAutoScaler.apply(hidden, scale * loss)
        else:
            hidden = MTPLossAutoScaler.apply(hidden, scale * loss / num_tokens)
    return hidden
