"""The ``megatron`` block of a model spec: extra megatron-core ``TransformerConfig`` fields, kept as data (torch-free).

A spec names its architecture with our short fields (``search.spec.model.ModelSpec``); anything else megatron-core's
``TransformerConfig`` offers (``qk_layernorm``, ``softmax_scale``, ``layernorm_epsilon``, ``init_method_std``,
``add_qkv_bias``, ...) goes into ``megatron: {field: value}`` and reaches every stage's config unchanged. Three
rules, the same in the planner and in the runtime:

- a field that our spec or the plan controls (``hidden_size``, ``tensor_model_parallel_size``,
  ``sequence_parallel``, ``recompute_granularity``, ...) is refused with the field to use instead (``CONTROLLED``);
- an unknown name is refused with a did-you-mean, checked against the installed megatron-core's
  ``TransformerConfig``. The planner reads the field names from megatron-core's source files with ``ast``
  (``transformer_config_fields``: no import, so no torch); the runtime checks against the imported dataclass
  (``model_specs.extensions``), types included;
- the analytic cost model prices what it knows: the fields in ``NO_COST`` change neither time nor memory, those in
  ``PRICED`` it counts (``add_qkv_bias``); it names every other field it ignores (``unpriced``), and a profile
  (``aceso profile``) measures them all.
"""

from __future__ import annotations

import ast
import difflib
import sys
from functools import lru_cache
from pathlib import Path

_PLAN = "the plan's stages"
_RECOMPUTE = "the plan's per-unit recompute (stages[].chunks[].recompute)"
_RUNTIME = "-the runtime sets it"

# CONTROLLED fields that only older supported megatron-core releases have (removed since: an unknown field there)
OLDER_RELEASES_ONLY = frozenset({"moe_extended_tp"})   # 0.16.1; gone in 0.19

# megatron-core field -> the spec or plan field that sets it instead ("-reason": nothing does)
CONTROLLED: dict[str, str] = {
    **{f: f for f in ("hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
                      "normalization", "add_bias_linear", "hidden_dropout", "attention_dropout")},
    "num_layers": "num_layers (T5: num_decoder_layers)",
    "gated_linear_unit": "activation (gelu | swiglu | quick_geglu)",
    "activation_func": "activation (gelu | swiglu | quick_geglu), or an MLP with its own activation in your layer_spec",
    **{f: "params_dtype (and aceso search --precision)" for f in ("params_dtype", "fp16", "bf16", "pipeline_dtype")},
    "tensor_model_parallel_size": "the plan's stages[].tp",
    "context_parallel_size": "the plan's stages[].cp",
    "hierarchical_context_parallel_sizes": "the plan's stages[].cp",
    "sequence_parallel": "the plan's stages[].sequence_parallel",
    "tp_comm_overlap": "the plan's settings.tp_comm_overlap",
    **{f: _PLAN for f in ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                          "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                          "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
                          "account_for_loss_in_pipeline_split")},
    **{f: _RECOMPUTE for f in ("recompute_granularity", "recompute_method", "recompute_num_layers",
                               "recompute_modules", "distribute_saved_activations")},
    "expert_model_parallel_size": "the plan's stages[].ep",
    **{f: "the plan's stages[].etp" for f in ("expert_tensor_parallel_size", "moe_extended_tp")},
    "num_moe_experts": "moe.num_experts",
    **{f: f"moe.{f}" for f in ("moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                               "moe_layer_freq", "moe_router_score_function", "moe_router_num_groups",
                               "moe_router_group_topk", "moe_router_enable_expert_bias", "moe_aux_loss_coeff",
                               "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity",
                               "moe_router_force_load_balancing", "moe_shared_expert_gate")},
    "mtp_num_layers": "mtp_num_layers",
    "use_fused_weighted_squared_relu": "the plan's moe.fused_weighted_squared_relu",
    "moe_latent_size": "moe.moe_latent_size",
    **{f: f for f in ("window_size", "window_attn_skip_freq", "softmax_type", "glu_linear_offset",
                      "activation_func_clamp_value")},       # spec fields (search.layers.layer_variants)
    "init_method": "init_method_std (the runtime draws every weight from it)",
    "output_layer_init_method": "init_method_std (the runtime draws every weight from it)",
    "embedding_init_method": "embedding_init_method_std",
    "calculate_per_token_loss": "aceso train --calculate-per-token-loss (a training flag, as in Megatron-LM)",
    **{f: _RUNTIME for f in ("use_cpu_initialization", "perform_initialization",
                             "finalize_model_grads_func", "grad_scale_func", "no_sync_func", "grad_sync_func",
                             "param_sync_func", "timers", "variable_seq_lengths", "batch_p2p_comm",
                             "overlap_p2p_comm", "deallocate_pipeline_outputs",
                             "microbatch_group_size_per_vp_stage")},
}

# GPTModel / T5Model arguments (not TransformerConfig fields) that users look for in the megatron block
MODEL_ARGUMENTS: dict[str, str] = {
    "rotary_percent": "rotary_percent", "rotary_base": "rotary_base",
    "position_embedding_type": "position_embedding", "vocab_size": "vocab_size",
    "max_sequence_length": "seq_length", "share_embeddings_and_output_weights": "tied_embeddings",
    "rope_scaling": "rope_scaling (type llama3)", "rope_scaling_factor": "rope_scaling.factor",
}
# MLATransformerConfig's YaRN fields (not TransformerConfig's): the spec's rope_scaling of type yarn (search.spec.rope_scaling)
MLA_ROPE = ("rope_type", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
            "mscale", "mscale_all_dim")

# fields that change neither time nor memory: the analytic model prices them exactly by ignoring them
NO_COST = frozenset({"init_method_std", "embedding_init_method_std", "layernorm_epsilon",
                     "layernorm_zero_centered_gamma", "softmax_scale", "rotary_interleaved",
                     "apply_query_key_layer_scaling", "moe_router_topk_scaling_factor", "mtp_loss_scaling_factor"})
# fields the analytic model prices where they act: the QKV bias in the parameter counts (ModelSpec.unit_params; its
# add runs inside the projection, as add_bias_linear's does); the Q and K norms in the parameter counts and in the
# attention unit's time, activations and launches (costmodel.memory.qk_norm_elems)
PRICED = frozenset({"add_qkv_bias", "qk_layernorm"})

# kernel fusions: CUDA-only, the runtime switches them off on CPU whatever the block says
CPU_OFF = ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "persist_layer_norm",
           "apply_rope_fusion", "gradient_accumulation_fusion", "cross_entropy_loss_fusion")

_SOURCES = (("model_parallel_config.py", "ModelParallelConfig"),
            ("transformer/transformer_config.py", "TransformerConfig"))


def _megatron_core_dir() -> Path | None:
    for p in sys.path:
        d = Path(p or ".") / "megatron" / "core"
        if (d / "transformer" / "transformer_config.py").is_file():
            return d
    return None


@lru_cache(maxsize=1)
def transformer_config_fields() -> frozenset[str] | None:
    """Field names of the installed megatron-core's ``TransformerConfig`` (with its base ``ModelParallelConfig``),
    read from the source files; None when megatron-core is not installed (the block is then kept unchecked)."""
    root = _megatron_core_dir()
    if root is None:
        return None
    names: set[str] = set()
    for rel, cls in _SOURCES:
        try:
            tree = ast.parse((root / rel).read_text())
        except (OSError, SyntaxError, ValueError):
            return None
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == cls:
                names.update(s.target.id for s in node.body
                             if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name))
    return frozenset(names) if names else None


def check_names(block: dict, known: frozenset[str] | set[str] | None = None) -> None:
    """``ValueError`` (one line) for the first field of ``block`` that is controlled by us or unknown to megatron-core
    (``known``: its field names; None skips that check)."""
    for name in block:
        where = f"megatron.{name}"
        if name in CONTROLLED:
            instead = CONTROLLED[name]
            if instead.startswith("-"):
                raise ValueError(f"{where}: {instead[1:]}; remove it")
            raise ValueError(f"{where}: set by aceso, not by the megatron block; use {instead}")
        if name in MLA_ROPE:
            raise ValueError(f"{where}: an MLATransformerConfig field; set the spec's rope_scaling (type yarn, with "
                             "mla) instead")
        if name in MODEL_ARGUMENTS:
            raise ValueError(f"{where}: a GPTModel argument, not a TransformerConfig field; set the spec's "
                             f"{MODEL_ARGUMENTS[name]} field instead")
        if known is not None and name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"did you mean {close[0]}?" if close else "check megatron-core's TransformerConfig"
            raise ValueError(f"{where}: not a megatron-core TransformerConfig field; {hint}")


def unpriced(block: dict | None) -> list[str]:
    """The block's fields the analytic model does not price (sorted)."""
    return sorted(k for k in (block or {}) if k not in NO_COST | PRICED)


def analytic_note(model) -> str | None:
    """What the analytic model leaves unpriced in ``model`` (a ``ModelSpec``): its own layer spec, and the megatron
    fields outside ``NO_COST``; None when it prices everything."""
    parts = []
    if model.layer_spec:
        spec = model.layer_spec if isinstance(model.layer_spec, str) else ", ".join(model.layer_spec.values())
        parts.append(f"prices the stock megatron-core layer, not layer_spec {spec}")
    fields = unpriced(model.megatron)
    if fields:
        parts.append(f"ignores megatron field{'s' if len(fields) > 1 else ''} {', '.join(fields)}")
    if not parts:
        return None
    return (f"analytic cost model: {' and '.join(parts)} (they may change time and memory); "
            "profile the model (`aceso profile --model SPEC`) and plan with --cost-model profile to price them")
