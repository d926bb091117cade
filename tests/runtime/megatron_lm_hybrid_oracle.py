"""Run Megatron-LM's own argument handling and megatron-core's pipeline-segment selection on exported hybrid-pattern
command lines (used by test_hybrid_pattern_oracle.py).

Reads ``[{"line": ARGS, "world": N}, ...]`` as JSON on stdin; for each, runs the checkout's ``parse_args`` and
``validate_args`` as ``pretrain_hybrid.py`` (0.17: ``pretrain_mamba.py``) does, ``core_transformer_config_from_args``
and its tokenizer, then asks the checkout's own ``select_pipeline_segment`` (``models/hybrid/hybrid_layer_allocation``,
0.17 ``ssm/mamba_hybrid_layer_allocation``) which layers every (virtual stage, pipeline rank) builds, and
``parse_hybrid_pattern`` the MTP part; prints one JSON list: per case ``{"error": ...}`` or what it found. The
CPU stubs are those of megatron_lm_oracle.py (imported); the process groups are stand-ins answering rank and size.
"""

import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_lm_oracle as base  # noqa: E402  (its stubs: device arch, TE version, batch-invariant kernels)

import torch  # noqa: E402

A = base.A


class _Group:
    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


torch.distributed.get_rank = lambda group=None: group.rank
torch.distributed.get_world_size = lambda group=None: group.size


def _allocation():
    try:
        from megatron.core.models.hybrid import hybrid_layer_allocation as H
    except ImportError:          # core_v0.17
        from megatron.core.ssm import mamba_hybrid_layer_allocation as H
    H.log_on_each_pipeline_stage = lambda *a, **k: None
    H.log_single_rank = lambda *a, **k: None
    return H


def _spec_defined(spec) -> bool:
    """``--spec MODULE ATTR`` names a module file of the checkout that assigns ATTR."""
    module, attr = spec
    path = os.path.join(os.environ["PYTHONPATH"].split(os.pathsep)[0], *module.split(".")) + ".py"
    return os.path.isfile(path) and f"\n{attr} = " in open(path).read()


def run(line: str, world: int) -> dict:
    os.environ.update(WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0", CUDA_DEVICE_MAX_CONNECTIONS="1")
    if "--use-megatron-fsdp" in line:
        del os.environ["CUDA_DEVICE_MAX_CONNECTIONS"]
    sys.argv = ["pretrain_hybrid.py", *shlex.split(line), "--no-rope-fusion"]
    args = A.parse_args()
    A.validate_args(args)
    cfg = A.core_transformer_config_from_args(args)
    from megatron.training import global_vars
    tokenizer = global_vars.build_tokenizer(args)
    H = _allocation()
    parsed = H.parse_hybrid_pattern(args.hybrid_layer_pattern)
    pp, vpp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    chunks = []
    for vs in range(vpp or 1):
        for r in range(pp):
            types, offset = H.select_pipeline_segment(parsed.main_pattern or "", _Group(r, pp), vs if vpp else None)
            chunks.append([offset, "".join(types)])
    return {"chunks": chunks, "num_layers": args.num_layers, "vpp": vpp, "dp": args.data_parallel_size,
            "mtp": [parsed.mtp_pattern, parsed.mtp_num_depths, args.mtp_num_layers],
            "recompute": [cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers,
                          cfg.recompute_modules if cfg.recompute_granularity == "selective" else None],
            "micro_batch_size": args.micro_batch_size, "tp": cfg.tensor_model_parallel_size,
            "gated": cfg.gated_linear_unit, "num_query_groups": cfg.num_query_groups,
            "moe": [cfg.num_moe_experts, cfg.moe_router_topk, cfg.expert_model_parallel_size],
            "position_embedding_type": args.position_embedding_type, "rotary_base": args.rotary_base,
            "vocab": [tokenizer.vocab_size, args.padded_vocab_size], "spec_defined": _spec_defined(args.spec),
            "bf16_layers": _bf16_layers(cfg, args.num_layers), "mamba": _mamba(cfg),
            "gdn": [cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_key_heads,
                    cfg.linear_num_value_heads, cfg.linear_conv_kernel_dim],
            "activation": getattr(cfg.activation_func, "__name__", None),
            "latent": getattr(cfg, "moe_latent_size", None),
            "mtp_repeated": getattr(cfg, "mtp_use_repeated_layer", None),
            "topk_scaling": cfg.moe_router_topk_scaling_factor,
            "init_std": cfg.init_method_std, "mtp_loss": cfg.mtp_loss_scaling_factor,
            "cuda_graphs": [cfg.cuda_graph_impl, [x.name for x in getattr(cfg, "cuda_graph_modules", None)
                                                  or getattr(cfg, "cuda_graph_scope", None) or []]]}


def _mamba(cfg):
    """The Mamba-2 shape megatron-core's ``MambaMixer`` takes from the config: state, head dim, groups, heads (its
    own ``nheads`` rule: ``mamba_num_heads`` or ``expand * hidden / head_dim``, expand 2), the mem-eff path."""
    heads = cfg.mamba_num_heads or 2 * cfg.hidden_size // cfg.mamba_head_dim
    return [cfg.mamba_state_dim, cfg.mamba_head_dim, cfg.mamba_num_groups, heads, cfg.use_mamba_mem_eff_path]


def _bf16_layers(cfg, num_layers: int):
    """The hybrid layers megatron-core keeps in bf16 under an FP8 / FP4 recipe (``fp8_utils.is_first_last_bf16_layer``
    on the global layer index HybridStack passes), or None."""
    if not getattr(cfg, "first_last_layers_bf16", False):
        return None
    from megatron.core.fp8_utils import is_first_last_bf16_layer
    return [i for i in range(num_layers) if is_first_last_bf16_layer(cfg, i)]


if __name__ == "__main__":
    base.serve(run)
