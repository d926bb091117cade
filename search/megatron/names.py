"""The one translation of our short names into Megatron-LM flags and Megatron-Bridge ``ConfigContainer`` fields.

Megatron-LM: ``megatron/training/arguments.py`` of each release (``versions.py``; many flags are generated there
from ``TransformerConfig`` field names); every flag written here is in every release's parser (a test checks), and
``script.arg_groups`` renames one for a release that reads it by another name. Megatron-Bridge: ``ConfigContainer`` of ``v0.3.1`` (``model`` is a
``GPTModelProvider``, a ``TransformerConfig`` subclass, so its fields are megatron-core's names). ``TABLE`` is the
mapping documented in docs/megatron.md (``mapping_table``); ``megatron_lm_args`` and ``bridge_fields`` apply it.
"""

from __future__ import annotations

from search.costmodel.plan_view import run_settings
from search.settings.data_parallel import for_target, to_flags as dp_flags
from search.settings.optimizer_state import bridge_fields as pa_bridge_fields, to_flags as pa_flags
from search.settings.precision import megatron_flags as precision_flags
from search.spec.rope_scaling import yarn_on_standard_attention
from . import layer_variant_flags
from .config import MegatronConfig, NotExpressible
from .layout import split_for
from .moe_flags import moe_args, moe_bridge_fields, moe_parallel_args
from .stack_flags import stack_args, stack_bridge_fields

# (ours, Megatron-LM, Megatron-Bridge ConfigContainer field, note)
TABLE: tuple[tuple[str, str, str, str], ...] = (
    ("model.num_layers", "--num-layers (T5: --encoder-num-layers, --decoder-num-layers)", "model.num_layers", ""),
    ("model.hidden_size", "--hidden-size", "model.hidden_size", ""),
    ("model.ffn_hidden_size", "--ffn-hidden-size", "model.ffn_hidden_size", ""),
    ("model.num_attention_heads", "--num-attention-heads", "model.num_attention_heads", ""),
    ("model.num_query_groups", "--group-query-attention --num-query-groups", "model.num_query_groups",
     "Megatron-LM: when set; Bridge: always, by value"),
    ("model.kv_channels", "--kv-channels", "model.kv_channels", "Megatron-LM: when set; Bridge: always, by value"),
    ("model.seq_length", "--seq-length --max-position-embeddings (T5: --encoder-seq-length)",
     "model.seq_length, dataset.seq_length", ""),
    ("model.decoder_seq_length", "--decoder-seq-length", "(no T5 recipe)", "T5"),
    ("model.vocab_size", "TOKENIZER_ARGS placeholder: --tokenizer-type NullTokenizer --vocab-size V (before 0.18: "
     "V-1)", "tokenizer.vocab_size (NullTokenizer, V-1), model.vocab_size (padded)",
     "NullTokenizer adds the EOD token before 0.18 (Bridge v0.3.1: megatron-core 0.16.1)"),
    ("model.make_vocab_size_divisible_by", "--make-vocab-size-divisible-by (ours / tp)",
     "model.make_vocab_size_divisible_by", "Megatron-LM pads to a multiple of it x tp"),
    ("model.activation swiglu", "--swiglu", "recipe: a Llama recipe", "gelu: the default / a GPT recipe"),
    ("model.activation quick_geglu", "--quick-geglu", "recipe: a GPT-OSS recipe", "gated quick-GELU"),
    ("model.glu_linear_offset", "--glu-linear-offset", "model.glu_linear_offset", "when set"),
    ("model.activation_func_clamp_value", "--activation-func-clamp-value", "model.activation_func_clamp_value",
     "when set"),
    ("model.softmax_type", "--softmax-type", "model.softmax_type", "when set (not vanilla)"),
    ("model.window_size", "--window-size LEFT,RIGHT", "model.window_size", "when set"),
    ("model.window_attn_skip_freq", "--window-attn-skip-freq N or [0/1 list]", "model.window_attn_skip_freq",
     "when set"),
    ("model.normalization", "--normalization LayerNorm or RMSNorm", "model.normalization", ""),
    ("model.position_embedding", "--position-embedding-type learned_absolute or rope", "model.position_embedding_type",
     ""),
    ("model.rotary_base", "--rotary-base", "model.rotary_base", "rope; an integer"),
    ("model.tied_embeddings false", "--untie-embeddings-and-output-weights",
     "model.share_embeddings_and_output_weights", ""),
    ("model.add_bias_linear false", "--disable-bias-linear", "model.add_bias_linear", ""),
    ("model.attention_dropout", "--attention-dropout", "model.attention_dropout", ""),
    ("model.hidden_dropout", "--hidden-dropout", "model.hidden_dropout", ""),
    ("model.params_dtype", "--bf16 or --fp16 (fp32: neither)", "mixed_precision (bf16: the recipe default; fp16, fp32 set)", ""),
    ("settings.grad_reduce_in_fp32", "bf16: --grad-reduce-in-bf16 when off; fp16: "
     "--accumulate-allreduce-grads-in-fp32 when on", "ddp.grad_reduce_in_fp32, mixed_precision.grad_reduce_in_fp32",
     "Megatron-LM reduces bf16 gradients in fp32 by default; Bridge copies mixed_precision's over ddp's"),
    ("settings.data_parallel", "--ddp-bucket-size, --ddp-num-buckets, --no-align-grad-reduce, "
     "--no-align-param-gather, --use-tp-pp-dp-mapping, --use-sharp", "ddp.bucket_size, dist.align_grad_reduce, ddp.align_param_gather (the others: refused)",
     "search/settings/data_parallel.py; nvls is NCCL_NVLS_ENABLE, not a flag"),
    ("settings.low_precision", "--fp8-format --fp8-recipe (or --fp4-format --fp4-recipe), --fp8-param-gather, "
     "--first-last-layers-bf16 --num-layers-at-start-in-bf16 --num-layers-at-end-in-bf16",
     "mixed_precision.fp8, fp8_recipe, fp8_param_gather, fp4, fp4_recipe, first_last_layers_bf16, ...",
     "the recipes of search/settings/precision.py; with --bf16"),
    ("settings.low_precision.per_module", "--te-precision-config-file FILE (the script writes FILE with a quoted "
     "here-document before torchrun)", "refused (model.quant_recipe is a RecipeConfig object)",
     "megatron-core's glob matchers, search/settings/precision_overrides.py"),
    ("predicted.attention", "--transformer-impl transformer_engine (flash) or local (unfused)",
     "model.transformer_impl", ""),
    ("stages[].tp", "--tensor-model-parallel-size", "model.tensor_model_parallel_size", "one for all stages"),
    ("num_stages", "--pipeline-model-parallel-size", "model.pipeline_model_parallel_size", ""),
    ("stages[].cp", "--context-parallel-size", "model.context_parallel_size", ""),
    ("stages[].dp", "(world size / (tp x pp x cp))", "(world size / (tp x pp x cp))", "torchrun's process count"),
    ("stages[].sequence_parallel", "--sequence-parallel", "model.sequence_parallel", ""),
    ("stages[].chunks (count)", "--num-virtual-stages-per-pipeline-rank", "model.virtual_pipeline_model_parallel_size",
     "or the layout's stage count"),
    ("stages[].chunks > 1: settings.overlap_p2p_comm", "(Megatron-LM's default with virtual stages); False: "
     "--no-overlap-p2p-communication", "model.overlap_p2p_comm, model.batch_p2p_comm", "as priced (None: async "
     "p2p); Bridge's recipes without a comm_overlap section (llama3_8b, qwen3) run it off"),
    ("stages[].chunks (layers)", "none (even), --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers, "
     "or --pipeline-model-parallel-layout", "model.num_layers_in_first_pipeline_stage / "
     "model.num_layers_in_last_pipeline_stage, or model.pipeline_model_parallel_layout", "the simplest form that gives "
     "the plan's split"),
    ("recompute selective (attention)", "--recompute-granularity selective --recompute-modules core_attn",
     "model.recompute_granularity, model.recompute_modules", "MLP units none"),
    ("recompute full", "--recompute-granularity full --recompute-method uniform (N = 1) or block --recompute-num-layers N",
     "model.recompute_granularity, model.recompute_method, model.recompute_num_layers", "block: first N layers"),
    ("micro_batch_size", "--micro-batch-size (= micro_batch_size / dp)", "train.micro_batch_size (= micro_batch_size / dp)",
     "per rank in Megatron"),
    ("global_batch_size", "--global-batch-size", "train.global_batch_size", ""),
    ("settings.distributed_optimizer", "--use-distributed-optimizer",
     "ddp.use_distributed_optimizer, optimizer.use_distributed_optimizer", ""),
    ("settings.overlap_grad_reduce", "--overlap-grad-reduce", "ddp.overlap_grad_reduce", ""),
    ("settings.overlap_param_gather", "--overlap-param-gather", "ddp.overlap_param_gather", "needs overlap_grad_reduce"),
    ("settings.tp_comm_overlap", "--tp-comm-overlap", "comm_overlap.tp_comm_overlap", "transformer-engine"),
    ("settings.megatron_fsdp.data_parallel_sharding_strategy", "--use-megatron-fsdp --data-parallel-sharding-strategy S "
     "--ckpt-format fsdp_dtensor", "ddp.use_megatron_fsdp, ddp.data_parallel_sharding_strategy, "
     "checkpoint.ckpt_format",
     "Megatron-LM asserts the fsdp_dtensor checkpoint format"),
    ("settings.activation_offload.num_layers", "--cpu-offloading-num-layers N", "model.cpu_offloading, "
     "model.cpu_offloading_num_layers", "one stage, no recompute"),
    ("settings.megatron_fsdp.main_params_dtype, main_grads_dtype", "--megatron-fsdp-main-params-dtype, "
     "--megatron-fsdp-main-grads-dtype", "ddp.megatron_fsdp_main_params_dtype, ddp.megatron_fsdp_main_grads_dtype",
     "megatron-core 0.19; when set"),
    ("settings.stack.cuda_graphs", "--cuda-graph-impl local|transformer_engine --cuda-graph-scope S ...",
     "model.cuda_graph_impl, model.cuda_graph_scope", "0.18+: --cuda-graph-modules (read)"),
    ("settings.stack.offload", "--fine-grained-activation-offloading --offload-modules M ... (--activation-offload-fraction)",
     "model.fine_grained_activation_offloading, model.offload_modules, model.activation_offload_fraction",
     "the fraction: megatron-core 0.19"),
    ("settings.stack.cross_entropy_fusion", "--cross-entropy-loss-fusion --cross-entropy-fusion-impl native|te",
     "model.cross_entropy_loss_fusion, model.cross_entropy_fusion_impl",
     "Bridge: always stated (false when off); a Bridge search prices its recipe's"),
    ("settings.optimizer", "--optimizer adam|muon|dist_muon", "optimizer.optimizer", "adam: not written"),
    ("settings.precision_aware_optimizer", "--use-precision-aware-optimizer --main-params-dtype "
     "--exp-avg-dtype --exp-avg-sq-dtype", "optimizer.use_precision_aware_optimizer, optimizer.main_params_dtype, "
     "optimizer.exp_avg_dtype, optimizer.exp_avg_sq_dtype", "adam with the distributed optimizer; an fp32 dtype "
     "is not written (search/settings/optimizer_state.py)"),
    # MoE / MLA / MTP (moe_flags.py)
    ("model.moe.num_experts", "--num-experts", "model.num_moe_experts", ""),
    ("model.moe.moe_router_topk, moe_ffn_hidden_size, moe_shared_expert_intermediate_size, "
     "moe_router_score_function, moe_router_num_groups, moe_router_group_topk, moe_expert_capacity_factor",
     "--moe-router-topk, --moe-ffn-hidden-size, ... (the field name with - for _)", "model.(the same name)",
     "Megatron-LM defaults: topk 2, moe_ffn_hidden_size = ffn_hidden_size"),
    ("model.moe.moe_router_enable_expert_bias, moe_router_force_load_balancing, moe_pad_expert_input_to_capacity",
     "--moe-router-enable-expert-bias, --moe-router-force-load-balancing, --moe-pad-expert-input-to-capacity",
     "model.(the same name)", "off by default"),
    ("model.moe.moe_shared_expert_gate", "--moe-shared-expert-gate", "model.moe_shared_expert_gate",
     "with a shared expert only (HF Qwen2-MoE's shared_expert_gate); Bridge: always written"),
    ("model.moe.moe_router_pre_softmax", "--moe-router-pre-softmax", "model.moe_router_pre_softmax",
     "softmax routers (top-1: always); read only where it changes the model; Bridge: always written"),
    ("model.moe.moe_layer_freq, first_k_dense_layers", "--moe-layer-freq N or '[0]*k+[1]*n'",
     "model.moe_layer_freq (N or a 0/1 list)", "first k dense: a list"),
    ("model.moe.moe_router_load_balancing_type, moe_aux_loss_coeff",
     "--moe-router-load-balancing-type T --moe-aux-loss-coeff C (coefficient 0: none)",
     "model.moe_router_load_balancing_type, model.moe_aux_loss_coeff",
     "several types with coefficients: one aux_loss of their sum"),
    ("model.mla.*", "--multi-latent-attention --q-lora-rank --kv-lora-rank --qk-head-dim --qk-pos-emb-head-dim "
     "--v-head-dim", "model.multi_latent_attention, model.(the same names)", "recipe: deepseek_v3_pretrain_config"),
    ("model.mtp_num_layers", "--mtp-num-layers (a layout: m before L)", "model.mtp_num_layers",
     "the MTP block in the last model chunk"),
    ("model.mtp_use_repeated_layer", "--mtp-use-repeated-layer (core_v0.17 on; core_v0.16.1: refused)",
     "model.mtp_use_repeated_layer (where set)", "one MTP layer run at every depth"),
    ("model.moe.moe_latent_size", "--moe-latent-size", "model.moe_latent_size (where set)",
     "LatentMoE (Nemotron-3 Super, Ultra)"),
    ("model.megatron.qk_layernorm", "--qk-layernorm", "model.qk_layernorm", ""),
    ("model.megatron.moe_router_topk_scaling_factor", "--moe-router-topk-scaling-factor F (when set)",
     "model.moe_router_topk_scaling_factor (always; null: none)",
     "the model's, never the recipe's (the Nemotron-3 Nano recipe that runs Super sets 2.5, Super's is 5.0)"),
    ("model.megatron.layernorm_epsilon, init_method_std, mtp_loss_scaling_factor",
     "--norm-epsilon, --init-method-std, --mtp-loss-scaling-factor (when set)",
     "model.layernorm_epsilon (always), init_method_std, mtp_loss_scaling_factor (when set)",
     "the model's config.json (rms_norm_eps 1e-6: DeepSeek-V3, Kimi-K2, Qwen; Mixtral's 1e-5 over the Qwen3 "
     "recipe's 1e-6); Super's 0.014 / 0.3 over the Nano recipe's 0.0173 / 0.1"),
    ("stages[].ep, stages[].etp", "--expert-model-parallel-size, --expert-tensor-parallel-size (when set)",
     "model.expert_model_parallel_size, model.expert_tensor_parallel_size", "one expert folding for all stages"),
    ("settings.moe.token_dispatcher", "--moe-token-dispatcher-type", "model.moe_token_dispatcher_type", ""),
    ("settings.moe.flex_backend", "--moe-flex-dispatcher-backend (flex only)", "model.moe_flex_dispatcher_backend",
     "deepep (Megatron-LM's default) or hybridep"),
    ("settings.moe.grouped_gemm, permute_fusion, shared_expert_overlap, overlap_ep_comm",
     "--moe-grouped-gemm, --moe-permute-fusion, --moe-shared-expert-overlap, --overlap-moe-expert-parallel-comm",
     "model.moe_grouped_gemm, moe_permute_fusion, moe_shared_expert_overlap, overlap_moe_expert_parallel_comm",
     "off by default in Megatron-LM"),
    ("settings.moe.delay_wgrad, router_fusion, router_dtype", "--delay-wgrad-compute, --moe-router-fusion, --moe-router-dtype",
     "model.delay_wgrad_compute, moe_router_fusion, moe_router_dtype (always; null: the model's dtype)",
     "off / fp32 from `aceso search` (NVIDIA's MoE runs and Bridge's MoE recipes; `--moe-router-dtype model`: the "
     "model's dtype, Megatron-LM's default); the recipes' fp32 never stands in for the plan's"),
    ("settings.moe.hybridep_num_sms", "--moe-hybridep-num-sms (read also from 0.19's --moe-flex-dispatcher-num-sms)",
     "model.moe_hybridep_num_sms", "flex hybridep only; 16 or 32 (HybridEP's published rates); unset: the release's"),
    ("settings.moe.rank_capacity_factor, paged_stash", "--moe-expert-rank-capacity-factor, --moe-paged-stash",
     "model.moe_expert_rank_capacity_factor, moe_paged_stash", "megatron-core 0.19"),
    ("settings.moe.fused_weighted_squared_relu", "--use-fused-weighted-squared-relu",
     "model.use_fused_weighted_squared_relu (where set)", "squared-ReLU experts' fused weighted activation"),
)

_NORM = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}
_POS = {"learned": "learned_absolute", "rope": "rope", "none": "none"}
_PRECISION = {"bf16": "--bf16", "fp16": "--fp16", "fp32": None}


def megatron_lm_args(c: MegatronConfig) -> dict[str, list[str]]:
    """Megatron-LM arguments by group (``model``, ``parallel``, ``recompute``, ``batch``, ``precision``)."""
    m = c.model
    model = (["--encoder-num-layers", str(m.num_layers), "--decoder-num-layers", str(m.num_decoder_layers)]
             if m.is_t5 else ["--num-layers", str(m.num_layers)])
    model += ["--hidden-size", str(m.hidden_size), "--ffn-hidden-size", str(m.ffn_hidden_size),
              "--num-attention-heads", str(m.num_attention_heads)]
    if m.kv_channels is not None:
        model += ["--kv-channels", str(m.kv_channels)]
    if m.num_query_groups is not None:
        model += ["--group-query-attention", "--num-query-groups", str(m.num_query_groups)]
    if m.is_t5:
        model += ["--encoder-seq-length", str(m.seq_length), "--decoder-seq-length", str(m.decoder_seq_length),
                  "--max-position-embeddings", str(max(m.seq_length, m.decoder_seq_length))]
    else:
        model += ["--seq-length", str(m.seq_length), "--max-position-embeddings", str(m.seq_length)]
    model += ["--position-embedding-type", "yarn" if yarn_on_standard_attention(m) else _POS[m.position_embedding]]
    if m.position_embedding == "rope":
        model += ["--rotary-base", str(int(m.rotary_base))]
    model += ["--normalization", _NORM[m.normalization]]
    model += ["--swiglu"] if m.activation == "swiglu" else (["--squared-relu"] if m.activation == "squared_relu"
                                                             else [])
    model += layer_variant_flags.write(m)          # --quick-geglu, --window-size, --softmax-type, ...
    model += [] if m.tied_embeddings else ["--untie-embeddings-and-output-weights"]
    model += [] if m.add_bias_linear else ["--disable-bias-linear"]
    model += ["--attention-dropout", _num(m.attention_dropout), "--hidden-dropout", _num(m.hidden_dropout),
              "--make-vocab-size-divisible-by", str(c.vocab_divisor), "--transformer-impl", c.transformer_impl]
    model += moe_args(m)
    return {"model": model, "parallel": _parallel(c), "recompute": _recompute(c),
            "batch": ["--micro-batch-size", str(c.micro_batch_size), "--global-batch-size", str(c.global_batch_size)],
            "precision": [f for f in [_PRECISION[c.precision]] if f] + grad_reduce_args(c) + low_precision_args(c)}


def low_precision_args(c: MegatronConfig) -> list[str]:
    """The recipe's flags (``search/settings/precision.py``)."""
    low = c.settings.low_precision
    if low is None:
        return []
    out = precision_flags(low.recipe, low.param_gather, low.bf16_layers_start, low.bf16_layers_end,
                          low.reuse_grad_buf)
    # per-module overrides: the launch script writes the YAML before torchrun (script.py, TE_CONFIG_FILE)
    return out + (["--te-precision-config-file", TE_CONFIG_FILE] if low.per_module else [])


TE_CONFIG_FILE = "te_precision_config.yaml"


def grad_reduce_args(c: MegatronConfig) -> list[str]:
    """The flag that makes Megatron-LM reduce gradients in the plan's dtype (``plan_settings.py`` has its rule):
    bf16 reduces in fp32 unless ``--grad-reduce-in-bf16``; fp16 in fp16 unless
    ``--accumulate-allreduce-grads-in-fp32``; fp32 gradients are fp32 either way."""
    if c.precision == "bf16" and not c.settings.grad_reduce_in_fp32:
        return ["--grad-reduce-in-bf16"]
    if c.precision == "fp16" and c.settings.grad_reduce_in_fp32:
        return ["--accumulate-allreduce-grads-in-fp32"]
    return []


def tokenizer_args(c: MegatronConfig, rel) -> list[str]:
    """The placeholder tokenizer: NullTokenizer with exactly the plan's vocabulary under ``rel``
    (``Release.null_vocab``: before 0.18 it adds the EOD token to --vocab-size)."""
    n = c.model.vocab_size - (0 if rel.rule("null_tokenizer_counts_eod") else 1)
    return ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(n)]


def _parallel(c: MegatronConfig) -> list[str]:
    out = ["--tensor-model-parallel-size", str(c.tp), "--pipeline-model-parallel-size", str(c.pp),
           "--context-parallel-size", str(c.cp)]
    out += ["--sequence-parallel"] if c.sequence_parallel else []
    out += moe_parallel_args(c)
    split = split_for(c.chunk_layers, c.pp, c.vpp, c.model.mtp_num_layers or 0)
    if split.layout is not None:
        out += ["--pipeline-model-parallel-layout", split.layout]
    else:
        out += ["--num-virtual-stages-per-pipeline-rank", str(c.vpp)] if c.vpp > 1 else []
        out += ["--decoder-first-pipeline-num-layers", str(split.first)] if split.first is not None else []
        out += ["--decoder-last-pipeline-num-layers", str(split.last)] if split.last is not None else []
    s = c.settings
    for on, flag in ((s.distributed_optimizer, "--use-distributed-optimizer"),
                     (s.overlap_grad_reduce, "--overlap-grad-reduce"),
                     (s.overlap_param_gather, "--overlap-param-gather"), (s.tp_comm_overlap, "--tp-comm-overlap")):
        out += [flag] if on else []
    if (f := s.megatron_fsdp) is not None:
        out += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", f.data_parallel_sharding_strategy,
                "--ckpt-format", "fsdp_dtensor"]
        for flag, v in (("--megatron-fsdp-main-params-dtype", f.main_params_dtype),
                        ("--megatron-fsdp-main-grads-dtype", f.main_grads_dtype)):
            out += [flag, v] if v else []         # megatron-core 0.19 flags
    off = s.activation_offload
    out += ["--cpu-offloading-num-layers", str(off.num_layers)] if off is not None else []
    out += dp_flags(_dp_written(c, "megatron-lm"))
    out += pa_flags(s.precision_aware_optimizer)
    out += ["--no-overlap-p2p-communication"] if s.overlap_p2p_comm is False and c.vpp > 1 else []
    return out + stack_args(s.stack, s.optimizer)


def _recompute(c: MegatronConfig) -> list[str]:
    rc = c.recompute
    if rc.granularity is None:
        return []
    if rc.granularity == "selective":
        return ["--recompute-granularity", "selective", "--recompute-modules", *rc.modules]
    return ["--recompute-granularity", "full", "--recompute-method", rc.method, "--recompute-num-layers",
            str(rc.num_layers)]


def _num(x: float) -> str:
    return repr(float(x))


def bridge_fields(c: MegatronConfig) -> dict[str, dict[str, object]]:
    """Megatron-Bridge ``ConfigContainer`` overrides by section (``model``, ``train``, ``ddp``, ...)."""
    m, s = c.model, c.settings
    split = split_for(c.chunk_layers, c.pp, c.vpp, m.mtp_num_layers or 0)
    rc = c.recompute
    model = {
        "num_layers": m.num_layers, "hidden_size": m.hidden_size, "ffn_hidden_size": m.ffn_hidden_size,
        "num_attention_heads": m.num_attention_heads, "kv_channels": m.head_dim, "num_query_groups": m.groups,
        "seq_length": m.seq_length,
        "position_embedding_type": _POS[m.position_embedding], "rotary_base": int(m.rotary_base),
        "normalization": _NORM[m.normalization], "share_embeddings_and_output_weights": m.tied_embeddings,
        "add_bias_linear": m.add_bias_linear, "attention_dropout": m.attention_dropout,
        "hidden_dropout": m.hidden_dropout, "make_vocab_size_divisible_by": m.make_vocab_size_divisible_by,
        "vocab_size": m.padded_vocab_size, "transformer_impl": c.transformer_impl,
        "tensor_model_parallel_size": c.tp, "pipeline_model_parallel_size": c.pp, "context_parallel_size": c.cp,
        "sequence_parallel": c.sequence_parallel,
        "virtual_pipeline_model_parallel_size": c.vpp if c.vpp > 1 else None,
        "pipeline_model_parallel_layout": split.layout,
        "num_layers_in_first_pipeline_stage": split.first, "num_layers_in_last_pipeline_stage": split.last,
        "recompute_granularity": rc.granularity, "recompute_method": rc.method,
        "recompute_num_layers": rc.num_layers, "recompute_modules": list(rc.modules) if rc.modules else None,
        **layer_variant_flags.bridge(m),
        **moe_bridge_fields(c),
        **stack_bridge_fields(s.stack),
    }
    model.update(_p2p_fields(c))
    if s.activation_offload is not None:
        model.update(cpu_offloading=True, cpu_offloading_num_layers=s.activation_offload.num_layers)
    out: dict[str, dict[str, object]] = {
        "model": model,
        "train": {"micro_batch_size": c.micro_batch_size, "global_batch_size": c.global_batch_size},
        "ddp": {"use_distributed_optimizer": s.distributed_optimizer, "overlap_grad_reduce": s.overlap_grad_reduce,
                "overlap_param_gather": s.overlap_param_gather,
                "grad_reduce_in_fp32": s.grad_reduce_in_fp32 or c.precision == "fp32"},
        "optimizer": {"use_distributed_optimizer": s.distributed_optimizer,
                      **({"optimizer": s.optimizer} if s.optimizer != "adam" else {}),
                      **pa_bridge_fields(s.precision_aware_optimizer)},
        # Bridge's own name (v0.3.1: a property that sets megatron-core's sequence_length; v0.6: a field that
        # finalize() copies over sequence_length, so sequence_length alone would be lost there)
        "dataset": {"seq_length": m.seq_length},
        # megatron-core's NullTokenizer (Bridge v0.3.1's default, legacy_tokenizer false) adds the EOD token
        "tokenizer": {"tokenizer_type": "NullTokenizer", "vocab_size": m.vocab_size - 1},
    }
    if (f := s.megatron_fsdp) is not None:   # Bridge's ConfigContainer.validate sets dist.use_megatron_fsdp from
        #                                        it; saving needs the format
        out["ddp"].update(use_megatron_fsdp=True, data_parallel_sharding_strategy=f.data_parallel_sharding_strategy)
        out["ddp"].update({k: v for k, v in (("megatron_fsdp_main_params_dtype", f.main_params_dtype),
                                             ("megatron_fsdp_main_grads_dtype", f.main_grads_dtype)) if v})
        out["checkpoint"] = {"ckpt_format": "fsdp_dtensor"}
    if s.tp_comm_overlap:
        out["comm_overlap"] = {"tp_comm_overlap": True}
    written = _dp_written(c, "megatron-bridge")
    out["ddp"].update(bridge_ddp_fields(written))
    if written is not None and written.align_grad_reduce is not None:
        # DistributedInitConfig.align_grad_reduce (default True): setup.py sets grad_sync_func only when on
        out["dist"] = {"align_grad_reduce": written.align_grad_reduce}
    return out


def _p2p_fields(c: MegatronConfig) -> dict[str, bool]:
    """The interleaved schedule's p2p as priced (``RunSettings.overlap_p2p_comm``: async behind the next chunk, so
    not batched; megatron-core raises on both), stated for a plan with virtual stages. Megatron-LM turns it on with
    virtual stages; Bridge v0.3.1 does so only in ``CommOverlapConfig`` (comm_overlap.py:443-452), and a recipe
    without that section (``llama3_8b``, ``qwen3_30b_a3b``) runs megatron-core's ``ModelParallelConfig`` defaults
    (off, batched). A section's own rule gives the same values, and Bridge writes them onto the model after the
    YAML, so the fields agree with every recipe. Without virtual stages the defaults are what is priced
    (1F1B's sends batched with receives): nothing written."""
    if c.vpp == 1:
        return {}
    overlap = run_settings(c.settings, c.precision).overlap_p2p_comm
    return {"overlap_p2p_comm": overlap, "batch_p2p_comm": not overlap}


def comm_overlap_dp_fields(c: MegatronConfig, core: str) -> dict[str, object]:
    """The DP overlaps a Bridge ``comm_overlap`` section must state so that the run is the one priced (the YAML's
    header: ``written_settings`` at megatron-core ``core``). With the distributed optimizer and dp > 1, Bridge
    v0.3.1's ``CommOverlapConfig._get_optimizer_overlap_cfgs`` (comm_overlap.py:527-548) writes its own onto the
    DDP config after the YAML (overlap_grad_reduce / overlap_param_gather on, bucket_size 128M, align_param_gather
    on with virtual stages) except where the section states one: the plan's overlaps, its alignment as priced and
    the bucket size priced (megatron-core's default ``max(40M, 1M x dp)`` unless the plan sets one)."""
    rs = run_settings(written_settings(c, "megatron-bridge", core), c.precision)
    if rs.ddp_num_buckets:
        bridge_ddp_fields(c.settings.data_parallel)          # refused there: Bridge v0.3.1 has no such field
    s = c.settings
    return {"overlap_grad_reduce": s.overlap_grad_reduce, "overlap_param_gather": s.overlap_param_gather,
            "align_param_gather": rs.align_param_gather,
            "bucket_size": rs.ddp_bucket_size or max(rs.bucket_params, 1_000_000 * c.dp)}


def _dp_written(c: MegatronConfig, target: str):
    """The plan's DP settings with the alignment it was priced with, as ``target``'s flags must say it
    (``data_parallel.for_target``; Megatron FSDP has no DDP schedule hooks). Bridge v0.3.1 holds the gradient
    alignment as ``dist.align_grad_reduce`` (``DistributedInitConfig``, default on), the parameter one as
    ``ddp.align_param_gather`` (default off)."""
    s = c.settings
    ddp = s.megatron_fsdp is None
    grad = ddp and s.overlap_grad_reduce and (c.pp > 1 or c.vpp > 1)
    return for_target(s.data_parallel, s.framework, target, grad, ddp and s.overlap_param_gather and c.vpp > 1)


def written_settings(c: MegatronConfig, target: str, core: str):
    """The settings ``target``'s run of the exported flags has (what its import reads back): ``target``'s framework,
    the megatron-core release ``core`` the flags are written for, and the DP alignment as written
    (``_dp_written``; the rest ``target``'s default)."""
    return c.settings.model_copy(update={"framework": target, "release": core,
                                         "data_parallel": _dp_written(c, target)})


def bridge_ddp_fields(d) -> dict[str, object]:
    """The DP synchronization settings (``search/settings/data_parallel.py``) as Megatron-Bridge v0.3.1 ``ddp`` fields
    (the gradient alignment is ``dist``'s, ``bridge_fields``); the ones its config has no field for are refused."""
    if d is None:
        return {}
    if d.rank_order != "tp-cp-ep-dp-pp" or d.sharp:
        raise NotExpressible("--use-tp-pp-dp-mapping and --use-sharp have no Megatron-Bridge v0.3.1 config field; "
                             "export for Megatron-LM (--framework megatron-lm)")
    if d.num_buckets is not None:
        raise NotExpressible("settings.data_parallel.num_buckets (--ddp-num-buckets) has no Megatron-Bridge v0.3.1 "
                             "ddp field; export for Megatron-LM (--framework megatron-lm)")
    out: dict[str, object] = {"bucket_size": d.bucket_size} if d.bucket_size else {}
    if d.align_param_gather is not None:
        out["align_param_gather"] = d.align_param_gather
    return out


def bridge_precision(c: MegatronConfig) -> str | None:
    """``mixed_precision`` recipe name (None: fp32)."""
    return {"bf16": "bf16_mixed", "fp16": "fp16_mixed", "fp32": None}[c.precision]


def mapping_table() -> str:
    """The markdown table of ``TABLE`` (docs/megatron.md carries it verbatim; a test checks)."""
    from .versions import releases
    tags = [r.tag for r in releases()]
    rows = [f"| ours (plan) | Megatron-LM {tags[0]} to {tags[-1]} | Megatron-Bridge v0.3.1 ConfigContainer | note |",
            "|---|---|---|---|"]
    rows += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in TABLE]
    return "\n".join(rows) + "\n"
