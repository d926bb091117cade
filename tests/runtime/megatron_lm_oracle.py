"""Run Megatron-LM's own argument handling on exported command lines (used by test_megatron_lm_oracle.py).

Reads ``[{"line": ARGS, "world": N}, ...]`` as JSON on stdin; for each, runs Megatron-LM's ``parse_args``,
``validate_args`` and ``core_transformer_config_from_args`` (from the checkout on PYTHONPATH: any release from
core_v0.16.1 to core_v0.19.0, with its own megatron-core) and builds its tokenizer (``global_vars.build_tokenizer``,
which pads the vocabulary), and prints one JSON list: per case either ``{"error": ...}`` or the ``(first layer,
layer count)`` megatron-core builds on each model chunk in model order (``get_transformer_layer_offset`` /
``get_num_layers_to_build``), the recompute settings, the data-parallel size, the distributed optimizer as
validate_args leaves it and the tokenizer's (padded) vocabulary. CPU only: the device-architecture query is answered as Hopper (9.0), the transformer-engine version query as
new enough (``--fp4-format``), the Triton-only
batch-invariant kernels and transformer-engine's fused MoE permute kernels are stubbed, and ``--no-rope-fusion`` is
added (rope fusion needs transformer-engine). MoE lines also report the MoE / MLA / MTP config fields and the chunk
megatron-core builds the MTP layers on; every line its attention / norm / RoPE fields (``arch``).
"""

import json
import os
import shlex
import sys
import types
import warnings

warnings.filterwarnings("ignore")
try:
    import six  # noqa: F401
except ImportError:          # core_v0.16.1's BERT tokenizer imports it at module level and uses it only to tokenize
    six = types.ModuleType("six")
    six.PY2, six.PY3 = False, True
    sys.modules["six"] = six
try:
    import regex  # noqa: F401
except ImportError:          # core_v0.16.1's GPT-2 BPE tokenizer: the same, at module level (the lines here tokenize
    import re as regex       # nothing: NullTokenizer)
    sys.modules["regex"] = regex
stub = types.ModuleType("megatron.core.transformer.custom_layers.batch_invariant_kernels")
stub.enable_batch_invariant_mode = lambda *a, **k: None
stub.is_batch_invariant_mode_enabled = lambda: False
sys.modules[stub.__name__] = stub

import megatron.training.utils as mlm_utils  # noqa: E402

mlm_utils.get_device_arch_version = lambda: 9
import megatron.training.arguments as A  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.transformer.transformer_block import get_num_layers_to_build  # noqa: E402
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset  # noqa: E402

A.get_device_arch_version = lambda: 9
A.is_te_min_version = lambda *a, **k: True   # --fp4-format asks for transformer-engine >= 2.7 (absent on CPU)
import torch  # noqa: E402

torch.cuda.get_device_capability = lambda *a, **k: (9, 0)   # --moe-grouped-gemm asks for it (Hopper)
import megatron.core.transformer.moe.moe_utils as moe_utils  # noqa: E402

for _name in ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
              "fused_sort_chunks_by_index_with_probs", "fused_unpermute"):   # --moe-permute-fusion: TE's kernels
    setattr(moe_utils, _name, getattr(moe_utils, _name, None) or (lambda *a, **k: None))


def run(line: str, world: int) -> dict:
    os.environ.update(WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0", CUDA_DEVICE_MAX_CONNECTIONS="1")
    if "--use-megatron-fsdp" in line:     # Megatron FSDP asserts the opposite (the exported script leaves it unset)
        del os.environ["CUDA_DEVICE_MAX_CONNECTIONS"]
    sys.argv = ["pretrain_gpt.py", *shlex.split(line), "--no-rope-fusion"]
    args = A.parse_args()
    A.validate_args(args)
    cfg = A.core_transformer_config_from_args(args)
    from megatron.training import global_vars
    tokenizer = global_vars.build_tokenizer(args)          # the release's own (pads: args.padded_vocab_size)
    pp, vpp = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size
    ps.set_virtual_pipeline_model_parallel_world_size(vpp)
    chunks = []
    for vs in range(vpp or 1):
        for r in range(pp):
            ps.set_pipeline_model_parallel_rank(r)
            stage = vs if vpp else None
            chunks.append([get_transformer_layer_offset(cfg, vp_stage=stage, pp_rank=r),
                           get_num_layers_to_build(cfg, vp_stage=stage, pp_rank=r)])
    return {"chunks": chunks, "dp": args.data_parallel_size, "micro_batch_size": args.micro_batch_size,
            "recompute": [cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers,
                          cfg.recompute_modules if cfg.recompute_granularity == "selective" else None],
            "sequence_parallel": cfg.sequence_parallel, "ffn_hidden_size": cfg.ffn_hidden_size,
            "num_query_groups": cfg.num_query_groups, "kv_channels": cfg.kv_channels,
            "layer_variants": {"window_size": list(cfg.window_size) if cfg.window_size else None,
                               "window_attn_skip_freq": cfg.window_attn_skip_freq,
                               "softmax_type": cfg.softmax_type, "glu_linear_offset": cfg.glu_linear_offset,
                               "activation_func_clamp_value": cfg.activation_func_clamp_value,
                               "activation": cfg.activation_func.__name__, "gated": cfg.gated_linear_unit},
            "fsdp": [args.use_megatron_fsdp, args.data_parallel_sharding_strategy, args.ckpt_format],
            "distributed_optimizer": args.use_distributed_optimizer,
            "optimizer_state": [str(getattr(args, k, None)) for k in (
                "use_precision_aware_optimizer", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")],
            "cuda_graph_impl": getattr(args, "cuda_graph_impl", None),
            "align": [args.align_grad_reduce, args.align_param_gather],
            "vocab": [tokenizer.vocab_size, args.padded_vocab_size],
            "offload": [cfg.cpu_offloading, cfg.cpu_offloading_num_layers],
            "fine_grained_offload": [cfg.fine_grained_activation_offloading, list(cfg.offload_modules or []),
                                     getattr(cfg, "activation_offload_fraction", 1.0)],
            "moe": {k: _plain(getattr(cfg, k, None)) for k in MOE_FIELDS},
            "recipe": {k: _plain(getattr(cfg, k, None)) for k in RECIPE_FIELDS},
            "mtp_chunk": _mtp_chunk(cfg, pp, vpp),
            "arch": {**{k: _plain(getattr(cfg, k, None)) for k in ARCH_FIELDS},
                     **{k: _plain(getattr(args, k)) for k in ARCH_ARGS}},
            "yarn": _yarn(args, cfg)}


def _yarn(args, cfg):
    """``--position-embedding-type yarn`` on standard attention (None otherwise): the config's ``yarn_*``
    attributes, and what megatron-core's ``YarnRotaryEmbedding`` built as ``GPTModel`` builds it computes on CPU
    (the inverse frequencies, position 1's angles, and its cos/sin scale), with the attention's concentration
    factor (``_yarn_get_concentration_factor_from_config``)."""
    if args.position_embedding_type != "yarn" or args.multi_latent_attention:
        return None
    if not hasattr(cfg, "yarn_rotary_scaling_factor"):       # before core_v0.19.0: GPTModel would raise
        return {"missing": True}
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as Y
    names = ("rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "correction_range_round_to_int")
    attrs = {n: getattr(cfg, "yarn_" + n) for n in names}
    torch.cuda.current_device = lambda: "cpu"          # get_emb moves its tables to the current device
    rot = Y.YarnRotaryEmbedding(kv_channels=cfg.kv_channels, rotary_percent=args.rotary_percent,
                                rotary_base=args.rotary_base, scaling_factor=attrs["rotary_scaling_factor"],
                                **{n: attrs[n] for n in names[1:]}, use_cpu_initialization=True)
    emb, mscale = rot.get_emb(2)
    return {"attrs": attrs, "apply_rope_fusion": cfg.apply_rope_fusion,
            "inv_freq": emb[1, 0, 0, : emb.shape[-1] // 2].tolist(), "mscale": float(mscale),
            "concentration": float(Y._yarn_get_concentration_factor_from_config(cfg))}


# what a converted model's attention, norms and RoPE build with: TransformerConfig / MLATransformerConfig fields and
# the GPTModel arguments pretrain_gpt.py passes from args (rotary_percent, rope_scaling, rope_scaling_factor)
ARCH_FIELDS = ("add_bias_linear", "add_qkv_bias", "qk_layernorm", "layernorm_epsilon", "moe_router_topk_scaling_factor",
               "rope_type", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
               "mscale", "mscale_all_dim", "init_method_std", "moe_router_pre_softmax", "moe_shared_expert_gate")
ARCH_ARGS = ("rotary_percent", "rotary_base", "use_rope_scaling", "rope_scaling_factor")


# TransformerConfig / MLATransformerConfig fields of MoE, MLA and MTP (what the MoE export must set)
MOE_FIELDS = ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
              "moe_layer_freq", "moe_router_score_function", "moe_router_num_groups", "moe_router_group_topk",
              "moe_router_enable_expert_bias", "moe_aux_loss_coeff", "moe_router_load_balancing_type",
              "moe_expert_capacity_factor", "moe_router_force_load_balancing", "expert_model_parallel_size",
              "expert_tensor_parallel_size", "moe_token_dispatcher_type", "moe_grouped_gemm", "moe_permute_fusion",
              "moe_shared_expert_overlap", "overlap_moe_expert_parallel_comm", "moe_flex_dispatcher_backend",
              "moe_pad_expert_input_to_capacity", "multi_latent_attention",
              "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "qk_layernorm",
              "mtp_num_layers")


# TransformerConfig fields of the low-precision recipes (aceso_megatron.model.lowprec.DEFAULTS)
RECIPE_FIELDS = ("fp8", "fp8_recipe", "fp8_param", "fp8_margin", "fp8_interval", "fp8_amax_history_len",
                 "fp8_amax_compute_algo", "fp8_wgrad", "fp8_dot_product_attention", "fp8_multi_head_attention", "fp4",
                 "fp4_recipe", "fp4_param", "first_last_layers_bf16", "num_layers_at_start_in_bf16",
                 "num_layers_at_end_in_bf16")


def _plain(v):
    return v if v is None or isinstance(v, (bool, int, float, str, list)) else str(v)


def _mtp_chunk(cfg, pp, vpp):
    """The model chunk (model order) megatron-core builds the MTP layers on (None: no MTP)."""
    if not cfg.mtp_num_layers:
        return None
    if cfg.pipeline_model_parallel_layout is not None:
        layout = cfg.pipeline_model_parallel_layout.layout
        return next(v * pp + r for v in range(vpp or 1) for r in range(pp) if "mtp" in str(layout[r][v]).lower())
    return pp * (vpp or 1) - 1            # get_mtp_num_layers_to_build: the last pipeline stage's last chunk


def serve(run_case) -> None:
    """Answer the cases on stdin with ``run_case(line, world)`` each (an error as ``{"error": ...}``), one JSON
    list on the last line of stdout."""
    out = []
    for case in json.load(sys.stdin):
        try:
            out.append(run_case(case["line"], case["world"]))
        except (AssertionError, ValueError, SystemExit) as e:
            out.append({"error": f"{type(e).__name__}: {e}"})
    sys.stdout.write("\n" + json.dumps(out) + "\n")


if __name__ == "__main__":
    serve(run)
